"""The actors that live and die with a job's driver (the online job's stream, the driver
of a Ray Train run) are placed on the driver's node, also where that node has no CPU
(a head of `num_cpus=0`, as KubeRay's and tests/cluster.py's are). Ray's soft affinity
put them on a worker node most times, where they died with a trainer's node and the job
with them (test_online's first fault). The cluster runs in a child process, apart from
the test session's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PLACED = 6  # actors of each kind; soft affinity kept about one in five here

SCRIPT = f"""
import json, ray
from ray.cluster_utils import Cluster
from tests.cluster import HEAD_ARGS, NODE_ARGS
from hsx_workers.nodes import on_this_node
from hsx_workers.stream import open_stream

class Driven:
    pass

cluster = Cluster(initialize_head=True, head_node_args=HEAD_ARGS)
try:
    for _ in range(3):
        cluster.add_node(**NODE_ARGS)
    ray.init(address=cluster.address)
    here = ray.get_runtime_context().get_node_id()
    node = lambda self: ray.get_runtime_context().get_node_id()
    streams = [ray.get(open_stream(f"out-{{i}}").__ray_call__.remote(node))
               for i in range({PLACED})]
    driven = [ray.get(ray.remote(Driven).options(num_cpus=0, scheduling_strategy=on_this_node())
                      .remote().__ray_call__.remote(node)) for _ in range({PLACED})]
    print(json.dumps({{"head": cluster.head_node.node_id, "driver": here,
                      "streams": streams, "driven": driven}}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_driver_actors_stay_on_the_drivers_node_of_no_cpu() -> None:
    tmp = tempfile.mkdtemp(prefix="hsxray", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=500, env={**env, "RAY_TMPDIR": tmp})
    assert done.returncode == 0, done.stderr[-4000:]
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    assert placed["driver"] == placed["head"]
    assert placed["streams"] == [placed["head"]] * PLACED
    assert placed["driven"] == [placed["head"]] * PLACED
