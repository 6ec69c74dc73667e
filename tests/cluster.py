"""A local Ray cluster of several nodes, in a process of its own, that loses nodes on
demand: `python -m tests.cluster STATE.json`, then one command a line on its stdin.

The cluster (`ray.cluster_utils.Cluster`): a head with no CPU (where the coordinator's
driver, the online stream and the training's driver run) and worker nodes of one CPU
each, so each engine and each trainer worker takes a node of its own. It runs apart
from the test session's own Ray, in a temporary folder of its own (RAY_TMPDIR): no other
Ray client of this machine finds and joins it.

Commands (each answered by STATE.json rewritten: the address and the live nodes):

- `add NAME`: a worker node named NAME (its Ray label `hsx-test-node`);
- `kill NODE_ID`: the node dies as a machine does: SIGKILL of every process of it at
  once (its raylet, object store, and the workers the raylet started with their engine
  and trainer processes; `Cluster.remove_node` alone leaves a node's workers running);
- `quit`: the cluster shuts down.

tests/chaos/node_loss.py kills a node the same way from inside a job's driver.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

# Every node of a test cluster shares one core with the engines and trainers it runs
# (tests/conftest.py pins each pytest-xdist worker): a live raylet may answer Ray's
# health checks late. Each check here may take 30 s (a live node is dead only after ~5
# minutes without an answer), while a killed node, whose port refuses at once, is dead
# after 10 checks a second apart.
HEALTH_CHECKS: dict[str, Any] = {"health_check_period_ms": 1000,
                                 "health_check_timeout_ms": 30_000,
                                 "health_check_failure_threshold": 10}
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 120 * 2**20}
HEAD_ARGS: dict[str, Any] = {"num_cpus": 0, "object_store_memory": 120 * 2**20,
                             "_system_config": HEALTH_CHECKS}


def kill_node(cluster: Any, node: Any) -> int:
    """SIGKILL every process of `node` at once; how many there were."""
    import psutil
    from ray._private.ray_constants import PROCESS_TYPE_RAYLET

    raylet = psutil.Process(node.all_processes[PROCESS_TYPE_RAYLET][0].process.pid)
    victims = [*raylet.children(recursive=True), raylet]
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    cluster.remove_node(node, allow_graceful=False)  # the rest: object store, agents
    return len(victims)


def main(state_path: str) -> int:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=HEAD_ARGS)
    nodes: dict[str, tuple[str, Any]] = {}  # node id -> (name, node)
    killed: dict[str, int] = {}

    def write() -> None:
        state = {"address": cluster.address,
                 "nodes": {nid: name for nid, (name, _) in nodes.items()},
                 "head": cluster.head_node.node_id, "killed": killed}
        tmp = Path(state_path + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(state_path)

    write()
    try:
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "add":
                node = cluster.add_node(labels={"hsx-test-node": arg}, **NODE_ARGS)
                nodes[node.node_id] = (arg, node)
            elif command == "kill" and arg in nodes:
                _, node = nodes.pop(arg)
                killed[arg] = kill_node(cluster, node)
            elif command == "quit":
                break
            write()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
