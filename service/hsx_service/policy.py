"""The server's policy on a job: what a submitter may ask of this coordinator.

A job names data and tunes an engine; it never names code. `vet_spec` is called by the
submit route before the scheduler sees a job, and refuses (422, the field named):

- `trust_remote_code` unless the operator allows models' own code;
- a `vllm:` option that is not on the list of engine options a job may set
  (`ENGINE_OPTIONS`, owned by the vllm engine's rules, hsx_workers/engines/vllm/rules.py:
  the ones that tune capture and memory, each taking one plain value), naming the
  option and the list. vLLM takes many options that load code or files
  (`log_config_file` hands a file to `logging.config.dictConfig`, whose handlers may be
  any callable; `model_class_overrides`, `compilation_config.backend`, `worker_cls`
  name classes to import), so the list says what is allowed rather than what is not.
  An operator extends it with `HSX_ENGINE_OPTIONS`, never a job;
- `ray_address`: a coordinator runs every job on its own Ray (`HSX_RAY_ADDRESS`, its
  operator's); a job that names another cluster is refused rather than silently run
  elsewhere than it says;
- any path outside the caller's roots (users.py gives each caller theirs), and hub ids
  where the hub is not allowed (paths.check_job_paths).

`hsx extract` runs none of this: it runs as its user, who may already run any code.
"""

from __future__ import annotations

import re
from typing import Any

from hsx.spec import JobSpec
from hsx_service.config import Settings
from hsx_service.errors import JobRefused
from hsx_service.paths import check_job_paths
from hsx_service.users import Caller
from hsx_workers.engines.vllm.rules import engine_options_problem


def vet_spec(spec: JobSpec, settings: Settings, caller: Caller) -> None:
    """The server's policy on a job `caller` submits, checked before the scheduler sees
    it."""
    if spec.ray_address is not None:
        raise JobRefused(
            "ray_address: this coordinator runs every job on its own Ray cluster (its "
            "operator's HSX_RAY_ADDRESS); leave ray_address out of a submitted job (it is "
            "for `hsx extract`)")
    if spec.trust_remote_code and not settings.allow_trust_remote_code:
        raise JobRefused(
            "trust_remote_code: this server does not run models' own code "
            "(its operator can allow it with HSX_ALLOW_TRUST_REMOTE_CODE=1)"
        )
    problem = engine_options_problem(spec.vllm, settings.engine_options)
    if problem:
        raise JobRefused(f"vllm: {problem}")
    hosts = sorted(set(spec.images.allow_hosts) - set(settings.image_hosts)
                   ) if spec.images is not None else []
    if hosts:
        allowed = ", ".join(settings.image_hosts) or "none"
        raise JobRefused(
            f"images.allow_hosts: this server fetches no images from {', '.join(hosts)} "
            f"(its operator allows {allowed}: HSX_IMAGE_HOSTS)")
    check_job_paths(spec, caller.roots, hub_allowed=settings.hub_allowed)


# Keys whose values are kept out of statuses, logs and metrics.
_SECRET_KEY = re.compile(
    r"(?:^|[_-])(?:token|secret|password|passwd|credentials?|api_?key|access_?key|"
    r"secret_?key|private_?key|auth|authorization)(?:$|[_-])", re.IGNORECASE)
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
REDACTED = "***"


def _redact_value(key: str, value: Any) -> Any:
    if _SECRET_KEY.search(key):
        return REDACTED
    if isinstance(value, dict):
        return {k: _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(key, v) for v in value]
    if isinstance(value, str):
        return _USERINFO.sub(rf"\1{REDACTED}@", value)
    return value


def redacted(spec: JobSpec) -> JobSpec:
    """The spec as others may read it: the values of keys that look secret (`hf_token`,
    `api_key`, ...) in `vllm:` and `chat_template_kwargs`, and the user:password of URIs,
    replaced by `***`."""
    data = spec.model_dump(mode="json")
    for field in ("model", "tokenizer", "output"):
        if isinstance(data.get(field), str):
            data[field] = _redact_value(field, data[field])
    data["dataset"] = _redact_value("dataset", data["dataset"])
    data["vllm"] = _redact_value("vllm", data["vllm"])
    data["chat_template_kwargs"] = _redact_value("chat_template_kwargs",
                                                 data["chat_template_kwargs"])
    return JobSpec.model_validate(data)
