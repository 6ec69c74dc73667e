"""Where a job's driver-side actors run: on the node of the process that drives the job."""

from __future__ import annotations

from typing import Any


def on_this_node() -> Any:
    """A Ray scheduling strategy that places an actor (of no CPU: it must fit anywhere)
    on this process's node and nowhere else.

    The actors it places live and die with the job's driver (the online stream, the
    driver of a Ray Train run). Ray's soft affinity does not keep them here when this
    node has no CPU, as a head started with `num_cpus=0` has (KubeRay's, the test
    clusters'): it put a zero-CPU actor on another node 4 times in 5, where it died with
    that node, a trainer's, and took the job with it. This node is alive while the
    driver runs on it, so the hard affinity always places."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
