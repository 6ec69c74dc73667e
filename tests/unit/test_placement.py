"""The plan of a job's GPUs and the arbiter that hands them out (service/hsx_service/placement.py).

The plan: where engines, the trainer and the evaluation run on clusters of 1, 2 and 8
GPUs and on a CPU machine, with the defaults and with explicit sizes; what a cluster can
never provide is refused naming the field and both numbers. The arbiter: requests are
served in the order job, then engines < trainer < evaluation; a waiter hears what it
waits for and who holds it; idle engines are named as such; a cancel ends a wait.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.spec import JobSpec, TrainSpec
from hsx_service.errors import JobRefused
from hsx_service.placement import (
    ENGINE,
    EVALUATION,
    TRAINER,
    ClusterShape,
    GpuArbiter,
    Holder,
    NodeShape,
    labels_match,
    plan_job,
)


def _spec(train: dict[str, Any] | None = None, **fields: Any) -> JobSpec:
    return JobSpec(model="/m", dataset="/d.jsonl", output="/o",
                   train=TrainSpec(**train) if train is not None else None, **fields)


def gpus(n: int) -> ClusterShape:
    return ClusterShape(gpus=n, cpus=16 * max(n, 1), cores=16)


def test_one_gpu_extracts_then_trains_then_measures_on_it() -> None:
    plan = plan_job(_spec(train={}), gpus(1))
    assert (plan.replicas, plan.engine_gpus, plan.train_gpus, plan.eval_gpus) == (1, 1, 1, 1)
    assert plan.training == "after"
    assert plan.summary == ("1 GPU: 1 engine on 1; when the extraction ends the engines yield "
                            "their GPUs and the trainer on 1 GPU trains; then vLLM measures "
                            "the draft on 1 GPU")


def test_two_gpus_train_beside_the_engine() -> None:
    plan = plan_job(_spec(train={}), gpus(2))
    assert (plan.replicas, plan.engine_gpus, plan.train_gpus, plan.training) == (1, 1, 1, "beside")


def test_eight_gpus_give_the_engines_all_but_the_trainers() -> None:
    assert plan_job(_spec(train={}), gpus(8)).replicas == 7
    assert plan_job(_spec(train={"workers": 2}), gpus(8)).replicas == 6
    assert plan_job(_spec(), gpus(8)).replicas == 8  # nothing to train: every GPU extracts
    tp2 = plan_job(_spec(train={}, tensor_parallel_size=2), gpus(8))
    assert (tp2.replicas, tp2.engine_gpus, tp2.training, tp2.eval_gpus) == (3, 6, "beside", 2)


def test_a_target_as_wide_as_the_node_trains_after_and_is_measured_as_wide() -> None:
    plan = plan_job(_spec(train={}, tensor_parallel_size=8), gpus(8))
    assert (plan.replicas, plan.engine_gpus, plan.training, plan.eval_gpus) == (1, 8, "after", 8)
    assert "then vLLM measures the draft on 8 GPUs (TP 8)" in plan.summary


def test_explicit_replicas_that_leave_no_gpu_train_after() -> None:
    plan = plan_job(_spec(train={}, replicas=8), gpus(8))
    assert (plan.replicas, plan.training) == (8, "after")
    assert plan_job(_spec(train={"device": "cpu"}, replicas=8), gpus(8)).training == "beside"


def test_no_evaluation_no_eval_gpus() -> None:
    assert plan_job(_spec(train={"eval_prompts": 0}), gpus(1)).eval_gpus == 0


@pytest.mark.parametrize(("fields", "cluster", "words"), [
    ({"train": {"workers": 4}}, gpus(2),
     "train.workers: 4 training workers need a GPU each, but the Ray cluster has 2"),
    ({"tensor_parallel_size": 4}, gpus(2),
     "tensor_parallel_size: one engine needs 4 GPUs, but the Ray cluster has 2"),
    ({"replicas": 3}, gpus(2), "replicas: 3 engines x tensor_parallel_size 1 need 3 GPUs"),
    ({"replicas": 3, "tensor_parallel_size": 2}, ClusterShape(gpus=0, cpus=8, cores=2),
     "they need 6 cores, this machine has 2; set replicas to 1"),
    ({"tensor_parallel_size": 4}, ClusterShape(gpus=0, cpus=8, cores=2),
     "lower tensor_parallel_size to 2"),
    ({"replicas": 9}, ClusterShape(gpus=0, cpus=8, cores=None),
     "replicas: 9 engines x tensor_parallel_size 1 need 9 CPUs, but the Ray cluster has 8"),
    ({"train": {"device": "cuda"}}, ClusterShape(gpus=0, cpus=8, cores=2),
     "train.device: cuda, but the Ray cluster has no GPU"),
])
def test_what_the_cluster_can_never_provide_is_refused(
    fields: dict[str, Any], cluster: ClusterShape, words: str
) -> None:
    train = fields.pop("train", None)
    with pytest.raises(JobRefused, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_job(_spec(train=train, **fields), cluster)


def test_cpu_clusters_share_the_cores() -> None:
    tp2 = plan_job(_spec(tensor_parallel_size=2), ClusterShape(gpus=0, cpus=8, cores=2))
    assert (tp2.replicas, tp2.gpus, tp2.engine_gpus) == (1, 0, 0)
    plan = plan_job(_spec(train={}, replicas=2), ClusterShape(gpus=0, cpus=8, cores=2))
    assert (plan.replicas, plan.training, plan.train_gpus) == (2, "beside", 0)
    assert plan.summary == ("CPU cluster: 2 engines on CPUs; the trainer beside them on a CPU; "
                            "then the evaluation on a CPU")


def test_an_engines_environment_is_the_vllm_engines_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM reads from the environment of an engine's process (its CPU KV cache,
    each rank's cores on a CPU machine, each rank's part of a shared GPU), said by the
    vllm engine's rules; the pool only adds its crash tests' fault point."""
    from hsx_workers.engines.vllm import rules

    monkeypatch.setattr(rules.os, "sched_getaffinity", lambda pid: set(range(8)),
                        raising=False)
    cpu = rules.engine_env(4, tp=2, gpus=False, replica=1, replicas=2)
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == "4-5|6-7"  # the second engine's ranks
    assert "VLLM_RAY_PER_WORKER_GPUS" not in cpu
    shared = rules.engine_env(1, tp=2, gpus=True, part=0.5)
    assert shared["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in shared
    assert "VLLM_RAY_PER_WORKER_GPUS" not in rules.engine_env(1, tp=1, gpus=True, part=0.5)
    assert rules.cpu_binding(0, 16, 1) is None  # fewer cores than ranks: vLLM binds


# ------------------------------------------------------------------ the arbiter


def _in_thread(arbiter: GpuArbiter, holder: Holder, seen: list[str | None],
               cancel: threading.Event | None = None) -> tuple[threading.Thread, list[bool]]:
    got: list[bool] = []

    def run() -> None:
        got.append(arbiter.acquire(holder, on_wait=seen.append, poll_s=0.01,
                                   cancelled=cancel.is_set if cancel else None))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def _until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def test_a_waiter_hears_who_holds_the_gpu_and_gets_it_when_released() -> None:
    arbiter = GpuArbiter(total=lambda: 1)
    engine = Holder("job-a", "engine-0", 1, (1.0, ENGINE))
    assert arbiter.acquire(engine)
    seen: list[str | None] = []
    trainer = Holder("job-a", "trainer", 1, (1.0, TRAINER))
    thread, got = _in_thread(arbiter, trainer, seen)
    _until(lambda: seen)
    assert seen[0] == "waiting for 1 GPU of 1: held by engine-0 of job job-a"
    assert not arbiter.blocked_by_idle()  # the engine works: nothing to release
    engine.idle = True
    assert arbiter.blocked_by_idle()
    _until(lambda: "(idle, kept warm)" in (seen[-1] or ""))
    arbiter.release(engine)
    thread.join(5)
    assert got == [True] and seen[-1] is None
    assert arbiter.holders() == [trainer] and arbiter.waiters() == []


def test_requests_are_served_by_job_then_engines_trainer_evaluation() -> None:
    arbiter = GpuArbiter(total=lambda: 1)
    blocker = Holder("job-a", "trainer", 1, (1.0, TRAINER))
    assert arbiter.acquire(blocker)
    order: list[str] = []
    later_engine = Holder("job-b", "engine-0", 1, (2.0, ENGINE))
    evaluation = Holder("job-a", "evaluation", 1, (1.0, EVALUATION))
    threads = []
    for holder in (later_engine, evaluation):  # the evaluation asks second
        seen: list[str | None] = []
        thread, _ = _in_thread(arbiter, holder, seen)
        threads.append(thread)
        _until(lambda seen=seen: seen)  # type: ignore[misc]
    arbiter.release(blocker)
    for _ in range(2):
        _until(lambda: bool(arbiter.holders()))
        held = arbiter.holders()[0]
        order.append(held.describe())
        arbiter.release(held)
    for thread in threads:
        thread.join(5)
    assert order == ["the evaluation of job job-a", "engine-0 of job job-b"]


def test_a_free_gpu_goes_to_whoever_is_first_in_line() -> None:
    arbiter = GpuArbiter(total=lambda: 2)
    big = Holder("job-a", "engine-0", 2, (1.0, ENGINE))
    small = Holder("job-b", "engine-0", 1, (2.0, ENGINE))
    one = Holder("job-z", "trainer", 1, (0.5, TRAINER))
    assert arbiter.acquire(one)
    seen_big: list[str | None] = []
    seen_small: list[str | None] = []
    t_big, _ = _in_thread(arbiter, big, seen_big)
    _until(lambda: seen_big)
    t_small, _ = _in_thread(arbiter, small, seen_small)
    _until(lambda: seen_small)
    # One GPU is free, but job-a's engine waits ahead of job-b's: no overtaking.
    assert "engine-0 of job job-a waits ahead of it" in (seen_small[-1] or "")
    arbiter.release(one)
    t_big.join(5)
    assert big in arbiter.holders() and small not in arbiter.holders()
    arbiter.release(big)
    t_small.join(5)
    assert arbiter.holders() == [small]


def test_a_cancelled_wait_holds_nothing() -> None:
    arbiter = GpuArbiter(total=lambda: 1)
    assert arbiter.acquire(Holder("job-a", "engine-0", 1, (1.0, ENGINE)))
    cancel = threading.Event()
    seen: list[str | None] = []
    thread, got = _in_thread(arbiter, Holder("job-b", "engine-0", 1, (2.0, ENGINE)), seen,
                             cancel)
    _until(lambda: seen)
    cancel.set()
    thread.join(5)
    assert got == [False] and len(arbiter.holders()) == 1 and arbiter.waiters() == []


def test_no_gpus_asked_no_wait() -> None:
    arbiter = GpuArbiter(total=lambda: 0)
    assert arbiter.acquire(Holder("job-a", "trainer", 0, (1.0, TRAINER)))
    assert arbiter.holders() == []


def test_a_trainer_planned_after_the_extraction_keeps_its_place_in_line() -> None:
    """Not served before its job ends; once it has, ahead of the next job's engines, which
    see it waiting and do not reuse the idle warm engine in its way."""
    arbiter = GpuArbiter(total=lambda: 1)
    extracted = threading.Event()
    engine = Holder("job-a", "engine-0", 1, (1.0, ENGINE))
    assert arbiter.acquire(engine)
    trainer = Holder("job-a", "trainer", 1, (1.0, TRAINER), ready=extracted,
                     until="waiting for the extraction of job job-a to end")
    seen: list[str | None] = []
    thread, got = _in_thread(arbiter, trainer, seen)
    _until(lambda: seen)
    assert seen[0] == "waiting for the extraction of job job-a to end"
    assert not arbiter.blocked_by_idle() and not arbiter.waits_ahead_of((2.0, ENGINE))
    engine.idle = True  # job-a ended: its engine is kept warm
    assert not arbiter.blocked_by_idle()  # the trainer is not ready yet: nothing yields
    extracted.set()
    assert arbiter.waits_ahead_of((2.0, ENGINE)) and not arbiter.waits_ahead_of((1.0, ENGINE))
    assert arbiter.blocked_by_idle()
    arbiter.release(engine)  # the pool lets the idle engine go
    thread.join(5)
    assert got == [True] and arbiter.holders() == [trainer]


def test_the_evaluation_takes_its_place_before_the_trainer_leaves() -> None:
    arbiter = GpuArbiter(total=lambda: 1)
    trainer = Holder("job-a", "trainer", 1, (1.0, TRAINER))
    assert arbiter.acquire(trainer)
    seen: list[str | None] = []
    later, later_got = _in_thread(arbiter, Holder("job-b", "engine-0", 1, (2.0, ENGINE)), seen)
    _until(lambda: seen)
    evaluation = Holder("job-a", "evaluation", 1, (1.0, EVALUATION))
    arbiter.enqueue(evaluation)
    arbiter.release(trainer)
    time.sleep(0.1)
    assert arbiter.holders() == []  # job-b's engine did not slip in
    assert arbiter.acquire(evaluation)
    arbiter.release(evaluation)
    later.join(5)
    assert later_got == [True]


def test_ensure_ray_joins_a_cluster_already_running_here(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without an address ray.init() joins a `ray start --head` cluster of this machine,
    which refuses sizing: hsx then joins it as it is (seen on GPU nodes)."""
    import ray

    from hsx_service.engine_pool import ensure_ray

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> None:
        calls.append(kwargs)
        if "num_cpus" in kwargs:
            raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus "
                             "must not be provided.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_ray(None, cpus_needed=2)
    assert "num_cpus" in calls[0] and "num_cpus" not in calls[1] and len(calls) == 2
    # `ray_address: local` asks for a private Ray, sized, whatever runs here.
    calls.clear()
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    ensure_ray("local", cpus_needed=2)
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] >= 2


def test_ensure_ray_starts_again_a_local_node_that_timed_out(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    """On a busy machine a new local node can miss the 30 s ray.init() gives it to
    register (seen with the test suite's two workers on 2 cores): started again, said so;
    a third timeout, or another error, is raised."""
    import ray

    from hsx_service.engine_pool import RAY_START_ATTEMPTS, ensure_ray

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    timeout = Exception("The current node timed out during startup. This could happen "
                        "because some of the raylet failed to startup or the GCS has "
                        "become overloaded.")
    outcomes: list[Exception | None] = [timeout, None]
    shutdowns: list[int] = []

    def init(**kwargs: Any) -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_ray(None, cpus_needed=2)
    assert not outcomes and len(shutdowns) == 1
    assert "did not register" in caplog.text and "attempt 2 of 3" in caplog.text

    outcomes[:] = [timeout] * RAY_START_ATTEMPTS
    with pytest.raises(Exception, match="timed out during startup"):
        ensure_ray(None, cpus_needed=2)
    assert not outcomes
    outcomes[:] = [RuntimeError("no space left on device")]
    with pytest.raises(RuntimeError, match="no space"):
        ensure_ray(None, cpus_needed=2)


def test_an_online_trainer_shares_the_engines_gpu_when_none_is_left_for_it() -> None:
    plan = plan_job(_spec(train={"online": True}), gpus(1))
    assert (plan.replicas, plan.engine_gpus, plan.train_gpus, plan.training) == \
        (1, 1, 0, "shared")
    # The trainer takes 0.3 of the GPU; vLLM the default 0.85 less that and the margin.
    assert (plan.train_share, plan.engine_memory) == (0.3, 0.65)
    assert "the online trainer shares a GPU with them: it takes 0.3 of it" in plan.summary
    assert "vLLM 0.65 of each GPU's memory" in plan.summary
    # What it asks for wins when it is smaller; a target as wide as the node shares too.
    plan = plan_job(_spec(train={"online": True, "gpu_share": 0.5},
                          vllm={"gpu_memory_utilization": 0.4}), gpus(1))
    assert (plan.train_share, plan.engine_memory) == (0.5, 0.4)
    plan = plan_job(_spec(train={"online": True}, tensor_parallel_size=2), gpus(2))
    assert (plan.replicas, plan.training, plan.train_share) == (1, "shared", 0.3)
    # Explicit replicas that take every GPU share; a GPU to spare is the trainer's own.
    assert plan_job(_spec(train={"online": True}, replicas=2), gpus(2)).training == "shared"
    plan = plan_job(_spec(train={"online": True}), gpus(2))  # replicas unset: 1 beside
    assert (plan.replicas, plan.train_gpus, plan.training, plan.train_share) == \
        (1, 1, "beside", 0.0)
    assert plan.engine_memory == 0.85
    # An offline trainer still waits for the engines' GPU; a CPU cluster shares nothing.
    assert plan_job(_spec(train={}), gpus(1)).training == "after"
    cpu = plan_job(_spec(train={"online": True}), ClusterShape(gpus=0, cpus=8, cores=2))
    assert (cpu.training, cpu.train_share) == ("beside", 0.0)
    with pytest.raises(ValueError, match=r"less than or equal to 0\.8"):
        TrainSpec(online=True, gpu_share=0.9)


def test_an_engine_and_its_online_trainer_hold_one_gpu_together() -> None:
    arbiter = GpuArbiter(total=lambda: 1)
    engine = Holder(job="a", role="engine-0", gpus=0.7, order=(1.0, ENGINE))
    trainer = Holder(job="a", role="trainer", gpus=0.3, order=(1.0, TRAINER))
    assert arbiter.acquire(engine) and arbiter.acquire(trainer)  # neither waits
    later = Holder(job="b", role="engine-0", gpus=1, order=(2.0, ENGINE))
    heard: list[str | None] = []
    stop = threading.Event()
    waiter = threading.Thread(target=arbiter.acquire, args=(later,),
                              kwargs={"on_wait": heard.append, "cancelled": stop.is_set,
                                      "poll_s": 0.01})
    waiter.start()
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heard[0] == ("waiting for 1 GPU of 1: held by engine-0 of job a, "
                        "the trainer of job a")
    arbiter.release(engine)
    time.sleep(0.1)
    assert later not in arbiter.holders()  # 0.7 free is not the 1 it needs
    arbiter.release(trainer)
    waiter.join(timeout=10)
    assert later in arbiter.holders()


def test_online_training_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"train\.online with regenerate is not built"):
        _spec(train={"online": True}, regenerate={"max_tokens": 8})
    # Several online workers need GPUs of their own: an engine's share is for one.
    with pytest.raises(JobRefused, match=r"train\.workers: 2 online training workers need "
                                         r"a GPU each beside the engines'"):
        plan_job(_spec(train={"online": True, "workers": 2}, replicas=2), gpus(2))
    with pytest.raises(JobRefused, match=r"train\.place: apart, but the engines take every "
                                         "GPU"):
        plan_job(_spec(train={"online": True, "place": "apart"}, replicas=1),
                 ClusterShape(gpus=1, cpus=16))


# ------------------------------------------------------------------ nodes


def _node(name: str, cpus: float = 1, gpus: float = 0, **labels: str) -> NodeShape:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return NodeShape(name * 8, "10.0.0." + name, resources, {"ray.io/node-id": name * 8,
                                                            **labels})


HEAD = NodeShape("h" * 8, "10.0.0.1", {}, {})  # the driver's: no CPU to run anything


def test_a_plan_says_which_node_runs_each_engine_and_each_trainer_worker() -> None:
    cluster = ClusterShape(gpus=0, cpus=3, nodes=(HEAD, _node("a"), _node("b"), _node("c")))
    spec = _spec(train={"online": True, "workers": 2, "place": "apart"})
    plan = plan_job(spec, cluster)
    where = {n.node[0]: (n.engines, n.trainer_workers) for n in plan.nodes}
    assert where == {"a": (["engine-0"], []), "b": ([], [0]), "c": ([], [1])}
    assert plan.train_place == "apart"
    assert "by node (the trainer apart from the engines): node aaaaaaaa: engine-0; node " \
        "bbbbbbbb: trainer worker 0; node cccccccc: trainer worker 1" in plan.summary


def test_a_trainer_kept_apart_is_refused_without_nodes_for_it() -> None:
    cluster = ClusterShape(gpus=0, cpus=2, nodes=(HEAD, _node("a"), _node("b")))
    with pytest.raises(JobRefused, match=r"train\.place: 2 trainer workers need 1 CPU each "
                                         r"on nodes without the job's engines; the cluster "
                                         r"has room for 1 there"):
        plan_job(_spec(train={"online": True, "workers": 2, "place": "apart"}), cluster)
    # Beside the engines (`any`) Ray finds room as the cluster frees it: no refusal.
    assert plan_job(_spec(train={"online": True, "workers": 2}), cluster).nodes


def test_labels_and_resources_the_cluster_lacks_are_named() -> None:
    cluster = ClusterShape(gpus=0, cpus=3, nodes=(
        HEAD, _node("a", **{"hsx-role": "engine"}), _node("b", **{"hsx-role": "trainer"})))
    with pytest.raises(JobRefused, match=r"train\.node_labels: no node of the Ray cluster has "
                                         r"hsx-role=gpu-trainer \(its nodes' labels: "
                                         r"hsx-role=engine, hsx-role=trainer\)"):
        plan_job(_spec(train={"node_labels": {"hsx-role": "gpu-trainer"}}), cluster)
    with pytest.raises(JobRefused, match=r"train\.resources: no node of the Ray cluster has "
                                         r"1 trainer"):
        plan_job(_spec(train={"resources": {"trainer": 1}}), cluster)
    # The engine goes where the trainer may not: the trainer's labelled node stays free.
    plan = plan_job(_spec(train={"node_labels": {"hsx-role": "trainer"}}), cluster)
    assert {n.node[0]: (n.engines, n.trainer_workers) for n in plan.nodes} == {
        "a": (["engine-0"], []), "b": ([], [0])}


def test_a_trainer_apart_on_labelled_nodes_keeps_the_engines_off_them() -> None:
    from hsx_service.placement import engine_selector

    cluster = ClusterShape(gpus=0, cpus=3, nodes=(
        HEAD, _node("a", **{"hsx-role": "trainer"}), _node("b", **{"hsx-role": "trainer"}),
        _node("c", **{"hsx-role": "engine"})))
    spec = _spec(train={"online": True, "workers": 2, "place": "apart",
                        "node_labels": {"hsx-role": "trainer"}})
    assert engine_selector(spec) == {"hsx-role": "!trainer"}
    plan = plan_job(spec, cluster)
    assert {n.node[0]: (n.engines, n.trainer_workers) for n in plan.nodes} == {
        "a": ([], [0]), "b": ([], [1]), "c": (["engine-0"], [])}
    assert engine_selector(_spec(train={"node_labels": {"hsx-role": "trainer"}})) == {}


def test_label_selectors_match_as_rays_do() -> None:
    labels = {"hsx-role": "trainer", "zone": "b"}
    assert labels_match(labels, {"hsx-role": "trainer"})
    assert not labels_match(labels, {"hsx-role": "!trainer"})
    assert labels_match(labels, {"zone": "in(a, b)"})
    assert not labels_match(labels, {"zone": "!in(a,b)"})
    assert labels_match(labels, {"gpu": "!h100"})  # absent: not that value


def test_a_pool_without_a_scheduler_hands_its_idle_engines_gpu_to_its_next_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs one after another on one pool and one GPU (run_job(pool=...)), each on an
    engine of its own configuration: the second's engine gets the GPU the first's idle
    engine held, which the pool stops (seen on one H200: the second waited forever). A
    pool in the service leaves that to the scheduler (its arbiter's on_waiter)."""
    import types

    import ray

    from hsx import settings
    from hsx.spec import VllmOptions
    from hsx_service import engine_pool
    from hsx_service.engine_pool import EnginePool, EngineSlot
    from hsx_workers.engines.base import EngineConfig
    from hsx_workers.engines.hf_settings import HfSettings
    from hsx_workers.engines.vllm.rules import engine_env
    from hsx_workers.engines.vllm.settings import VllmSettings

    stopped: list[str] = []
    envs: list[dict[str, str]] = []

    class Actor:
        def __init__(self, name: str) -> None:
            self.name = name
            self.ready = types.SimpleNamespace(remote=lambda: f"ready-{name}")

    class Remote:
        def options(self, **options: Any) -> Any:
            envs.append(options["runtime_env"]["env_vars"])
            return types.SimpleNamespace(remote=lambda engine, config, name: Actor(name))

    def stop(pool: EnginePool, slots: list[EngineSlot]) -> None:
        for slot in slots:  # as EnginePool._stop ends: the arbiter's books last
            stopped.append(slot.name)
            if slot.holder is not None:
                pool.arbiter.release(slot.holder)

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    monkeypatch.setattr(ray, "remote", lambda cls: Remote())
    monkeypatch.setattr(engine_pool, "place", lambda *a, **k: "group")
    monkeypatch.setattr(engine_pool, "in_group", lambda group: None)
    monkeypatch.setattr(EnginePool, "_stop", stop)
    monkeypatch.delenv(settings.FAULT_POINT.name, raising=False)
    config = EngineConfig(model="m", layers=[1], num_layers=2, hidden_size=8, max_seq_len=16,
                          settings=VllmSettings(options=VllmOptions(cpu_kvcache_gib=3)))

    pool = EnginePool(arbiter=GpuArbiter(total=lambda: 1))
    first = pool.slots("vllm", config, 1, _spec(), job="a")
    assert [h.job for h in pool.arbiter.holders()] == ["a"]
    assert envs == [engine_env(3, tp=1, gpus=True)]  # its settings' KV cache, vLLM's rule
    pool.park()  # job a ended; its engine is kept warm

    got: list[list[EngineSlot]] = []
    other = EngineConfig(model="m", layers=[1], num_layers=2, hidden_size=8, max_seq_len=16,
                         settings=HfSettings(), dtype="float32")
    thread = threading.Thread(target=lambda: got.append(pool.slots("hf", other, 1, _spec(),
                                                                   job="b")), daemon=True)
    thread.start()
    thread.join(5)
    assert got, "job b's engine still waits for the GPU of job a's idle engine"
    assert stopped == [first[0].name]
    assert [h.job for h in pool.arbiter.holders()] == ["b"]
    assert list(pool.actors) == [("hf", repr(other))]

    # The service's pool leaves it to the scheduler's loop, which its arbiter wakes.
    def wake_the_scheduler() -> None: ...

    arbiter = GpuArbiter(total=lambda: 1, on_waiter=wake_the_scheduler)
    assert EnginePool(arbiter=arbiter).arbiter.on_waiter is wake_the_scheduler


def test_a_local_rays_token_file_is_owner_only(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Ray writes its token with the umask's mode (0644): hsx makes it first, owner-only,
    before it starts a local Ray, and narrows one that others may read."""
    import stat

    import ray

    from hsx_service.engine_pool import ensure_ray, private_ray_token

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = tmp_path / "ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    assert private_ray_token(make=False) is None and not path.exists()  # joining elsewhere
    seen: list[int] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **_: seen.append(stat.S_IMODE(path.stat().st_mode)))
    ensure_ray(None, cpus_needed=1)
    assert seen == [0o600], "the token file was not owner-only when Ray started"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(path.read_text()) == 64
    token = path.read_text()
    path.chmod(0o644)
    assert private_ray_token(make=False) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == token
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the operator's choice: left alone
    path.chmod(0o644)
    assert private_ray_token(make=True) is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_trainer_kept_apart_learns_where_the_engines_run() -> None:
    """`place: apart`: the training waits until its job's engines are placed (None), then
    keeps off their nodes; a job that ended before any engine ran has none to avoid."""
    from hsx_service.training import EngineNodes

    extracted = threading.Event()
    engines = EngineNodes(extracted)
    assert engines() is None
    engines.placed({"engine-0": "n1", "engine-1": "n2", "engine-2": ""})  # one not placed
    assert engines() == {"n1", "n2"}
    assert EngineNodes(extracted)() is None
    extracted.set()
    assert EngineNodes(extracted)() == set()
