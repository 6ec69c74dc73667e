"""A Ray node lost mid-job: its engine's units move to the engine on the other node.

The job (`replicas: 2`) runs on a local three-node Ray cluster in its own process
(tests/chaos/node_loss.py: the session's Ray stays untouched); the node holding
`engine-1` is SIGKILLed (every process of it: raylet, store, workers, engines) while
that engine holds units. The job completes on the engine
left, and the output passes the audit. Starting a cluster and two engines costs about two
minutes on a 2-core machine; the case runs in `make test`, like the rest of the matrix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from hsx_workers.tiny_models import make_chat_dataset

from .audit import audit
from .node_loss import KILLED
from .test_faults import report

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_a_lost_node_moves_its_units_to_the_other_engine(make_job: Any, tmp_path: Path) -> None:
    dataset = make_chat_dataset(tmp_path / "chat.jsonl", n=40, seed=5, bad_rows=2)
    spec = make_job(tmp_path / "out", dataset=str(dataset.path), unit_tokens=500, replicas=2)
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(spec.model_dump_json())
    # Its cluster records itself in a temporary folder of its own (short: Ray's socket
    # paths), so no other Ray client of this machine finds and joins it.
    ray_tmp = tempfile.mkdtemp(prefix="hsxray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.chaos.node_loss", str(spec_path),
                               str(result_path)], cwd=ROOT, env={**env, "RAY_TMPDIR": ray_tmp},
                              capture_output=True, text=True, timeout=1200, check=False)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(result_path.read_text())
    nodes = result["engine_nodes"]
    assert len(set(nodes.values())) == 2, nodes  # one engine on each worker node
    assert result["killed_node"] == nodes[KILLED] and result["held_at_kill"], result
    by_worker = result["units_by_worker"]
    held = set(result["held_at_kill"])
    # What the lost engine held was committed by the other one; after the kill it
    # reported nothing but a unit it had committed just before dying (found committed).
    late = {unit for worker, unit in result["done_after_kill"] if worker == KILLED}
    assert late <= held and held - late <= set(by_worker["engine-0"]), result
    assert held & set(by_worker["engine-0"]), result
    assert result["summary"]["restarts"] >= 1
    assert result["alive_nodes"] == 2  # Ray saw the node die: the head and the node left
    figures = audit(Path(spec.output), dataset)
    report("node lost", {"faults": 1, "held_at_kill": result["held_at_kill"],
                         "units_by_worker": by_worker,
                         "processes_killed": result["processes_killed"],
                         "node_dead_after_s": result["node_dead_after_s"],
                         "job_seconds": round(result["seconds"], 1), **figures})
