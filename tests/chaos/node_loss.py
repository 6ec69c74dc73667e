"""A job on a local three-node Ray cluster that loses the node of one of its engines.

Run by tests/chaos/test_node_loss.py in its own process (it owns its Ray, apart from the
session's): `python -m tests.chaos.node_loss SPEC.json RESULT.json`.

The cluster (`ray.cluster_utils.Cluster`): a head with no CPU (the driver's node) and two
worker nodes of one CPU each, so the job's two engines (`replicas: 2`, one CPU each)
land one on each node. Once a unit is committed and both engines hold units, the node
of `engine-1` dies as a machine does: SIGKILL of every process of that node at once (its
raylet, object store, and the workers the raylet started with their engine processes;
`Cluster.remove_node` alone leaves a node's workers running). The job must go on: the
units engine-1 held fail an attempt and run on engine-0, whose node is untouched.
RESULT.json says what happened; the test audits the output.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

KILLED = "engine-1"


def main(spec_path: str, result_path: str) -> int:
    import psutil
    import ray
    from ray._private.ray_constants import PROCESS_TYPE_RAYLET
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    from hsx.spec import JobSpec
    from hsx_service.dispatch import DispatchHooks
    from hsx_service.engine_pool import EnginePool
    from hsx_service.runner import run_job
    from tests.cluster import HEALTH_CHECKS

    logging.basicConfig(level=logging.WARNING)
    spec = JobSpec.model_validate(json.loads(Path(spec_path).read_text()))
    small = {"object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "_system_config": HEALTH_CHECKS, **small})
    nodes = [cluster.add_node(num_cpus=1, **small) for _ in range(2)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    pool = EnginePool()
    result: dict[str, Any] = {"units_by_worker": {}, "held_at_kill": [], "killed_node": None,
                              "engine_nodes": {}, "done_after_kill": []}
    units_by: dict[str, list[int]] = result["units_by_worker"]
    lock = threading.Lock()

    def kill_node(node: Any) -> None:
        result["kill_at"] = time.time()
        raylet = psutil.Process(node.all_processes[PROCESS_TYPE_RAYLET][0].process.pid)
        victims = [*raylet.children(recursive=True), raylet]
        result["processes_killed"] = len(victims)
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        cluster.remove_node(node, allow_graceful=False)  # the rest: object store, agents

    def on_progress(progress: Any) -> None:
        with lock:
            if result["killed_node"] is not None:
                return
            busy = [w for w, state in progress.workers.items() if state == "busy"]
            if len(busy) < 2 or not units_by or KILLED not in progress.worker_units:
                return
            slots = {s.name: s for group in pool.actors.values() for s in group}
            where = {name: placement_group_table(s.placement_group)["bundles_to_node_id"][0]
                     for name, s in slots.items()}
            result["engine_nodes"] = where
            victim = next(n for n in nodes if n.node_id == where[KILLED])
            result["killed_node"] = victim.node_id
            result["held_at_kill"] = sorted(u.unit for u in slots[KILLED].inflight.values())
            threading.Thread(target=kill_node, args=(victim,), daemon=True).start()

    def on_unit_done(report: Any) -> None:
        with lock:
            units_by.setdefault(report.worker, []).append(report.unit)
            if "kill_at" in result:
                result["done_after_kill"].append([report.worker, report.unit])

    hooks = DispatchHooks(on_progress=on_progress, on_unit_done=on_unit_done)
    started = time.time()
    try:
        summary = run_job(spec, pool=pool, hooks=hooks)
        result["summary"] = summary.as_dict()
        result["seconds"] = time.time() - started
        # Ray marks the node dead once its health checks fail (the job may end first).
        deadline = time.time() + 120
        while sum(1 for n in ray.nodes() if n["Alive"]) > 2 and time.time() < deadline:
            time.sleep(1)
        result["alive_nodes"] = sum(1 for n in ray.nodes() if n["Alive"])
        result["node_dead_after_s"] = round(time.time() - result["kill_at"], 1)
    finally:
        Path(result_path).write_text(json.dumps(result))
        pool.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
