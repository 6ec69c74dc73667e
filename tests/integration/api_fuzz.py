"""Fuzz every operation of a running coordinator from its OpenAPI schema (schemathesis).

Each operation gets `examples` schema-valid requests and `examples` schema-violating
ones (schemathesis' positive and negative generation: wrong types, missing fields,
bad headers and tokens, bodies that are not JSON). Half of the schema-valid jobs and
inspections are pointed at a real model and dataset, so the server's preflight runs
past its first check, with an output it cannot create (a path below a file): no fuzzed
job can ever be queued and start engines. Schema-violating requests are sent as made
(pointing them at real files could repair the very field they violate).

Every response is judged by schemathesis' checks — no 5xx, status codes and bodies as
the schema documents them, auth enforced — except `positive_data_acceptance`: a
schema-valid job that names a model or dataset that does not exist is rightly refused
(422). A response slower than `hang_s` counts as a hang.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable


@dataclass
class FuzzReport:
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # a failed check, with its repro
    hangs: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return sum(self.statuses.values())

    def server_errors(self) -> int:
        return sum(n for (_, _, code), n in self.statuses.items() if code >= 500)


def fuzz_api(url: str, token: str, real: dict[str, str], examples: int,
             slow_examples: int, hang_s: float = 30.0) -> FuzzReport:
    """Fuzz the coordinator at `url`; `real` holds model, dataset and output for the
    requests pointed at real files; `slow_examples` for the model preflight (vLLM)."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    report = FuzzReport()

    def pointed_at_real_files(pair: tuple[Any, bool]) -> Any:
        case, real_files = pair
        body = case.body
        if real_files and isinstance(body, dict):
            spec = body.get("spec")
            if isinstance(spec, dict):
                spec.update(real)
            elif "model" in body:
                body["model"] = real["model"]
        return case

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for result in schema.get_all_operations():
            operation = result.ok()  # type: ignore[union-attr]  # an invalid schema raises
            label = operation.label
            count = slow_examples if "inspect" in label else examples
            real_files = st.booleans() if mode == GenerationMode.POSITIVE else st.just(False)
            strategy = st.tuples(operation.as_strategy(generation_mode=mode),
                                 real_files).map(pointed_at_real_files)

            run = _fuzz_one(strategy, count, mode, label, token, hang_s, report,
                            positive_data_acceptance, FailureGroup)
            with contextlib.suppress(Unsatisfiable):  # nothing to violate: no parameters
                run()
    return report


def _fuzz_one(strategy: Any, count: int, mode: Any, label: str, token: str, hang_s: float,
              report: FuzzReport, excluded: Any, failure_group: Any) -> Any:
    """The hypothesis test of one operation in one mode (@given takes no defaults, so
    what it needs is bound here)."""

    @settings(max_examples=count, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=strategy)
    def run(case: Any) -> None:
        started = time.monotonic()
        response = case.call(headers={"Authorization": f"Bearer {token}"}, timeout=hang_s)
        if time.monotonic() - started > hang_s:
            report.hangs.append(f"{label}: {case.as_curl_command()}")
        report.statuses[(mode.value, label, response.status_code)] += 1
        try:
            case.validate_response(response, excluded_checks=[excluded])
        except failure_group as failed:
            report.failures.append(f"{mode.value} {label}: {failed}")

    return run
