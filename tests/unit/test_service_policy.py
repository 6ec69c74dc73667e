"""The server's policy without a cluster: engine options by allow-list, hub access,
redaction, who may start open, the Host check, users from a tokens file or a proxy's
header, ownership through the routes (a fake scheduler), and 500s that keep their text
in the log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hsx.spec import JobSpec, VllmOptions
from hsx_service.config import Settings
from hsx_service.errors import JobRefused
from hsx_service.main import create_app
from hsx_service.paths import Roots, check_job_paths
from hsx_service.policy import redacted, vet_spec
from hsx_service.users import TokenTable, caller
from hsx_workers.engines.vllm.rules import ENGINE_OPTIONS, engine_options_problem

from .test_api import FakeScheduler, job_fields, local_client

ALICE, BOB, ROOT = "alice-token-0123456789", "bob-token-0123456789", "root-token-0123456789"


def _tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens:\n"
                    f"  - {{token: {ALICE}, user: alice}}\n"
                    f"  - {{token: {BOB}, user: bob}}\n"
                    f"  - {{token: {ROOT}, user: root, admin: true}}\n")
    return path


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_engine_options_are_an_allow_list() -> None:
    def problem_of(vllm: dict[str, Any], extra: list[str] | None = None) -> str | None:
        return engine_options_problem(VllmOptions.model_validate(vllm), extra or [])

    assert problem_of({"max_num_seqs": 8, "load_format": "dummy"}) is None
    problem = problem_of({"log_config_file": "/x", "max_num_seqs": 8})
    assert problem is not None and problem.startswith("log_config_file is not among")
    assert all(name in problem for name in ENGINE_OPTIONS)
    assert "takes one plain value" in (problem_of({"seed": [1]}) or "")
    assert "tensorizer" in (problem_of({"load_format": "tensorizer"}) or "")
    # hsx's own fields of `vllm:` are not engine arguments passed through.
    assert problem_of({"enforce_eager": True, "cpu_kvcache_gib": 2}) is None
    # The operator's additions pass as the job gives them.
    assert problem_of({"hf_overrides": {"a": 1}}, ["hf_overrides"]) is None


def test_vet_spec_names_the_field(tmp_path: Path) -> None:
    spec = JobSpec(model=str(tmp_path / "m"), dataset=str(tmp_path / "d.jsonl"),
                   output=str(tmp_path / "o"), vllm={"model_class_overrides": {"A": "os.x"}})
    settings = Settings(allowed_roots=[tmp_path])
    operator = caller("operator", True, settings)
    with pytest.raises(JobRefused, match=r"^vllm: model_class_overrides is not among"):
        vet_spec(spec, settings, operator)
    vet_spec(spec, Settings(allowed_roots=[tmp_path], engine_options=["model_class_overrides"]),
             operator)
    # A coordinator runs jobs on its own Ray: a job cannot send it elsewhere.
    elsewhere = spec.model_copy(update={"ray_address": "ray://10.0.0.9:10001"})
    with pytest.raises(JobRefused, match=r"^ray_address: this coordinator runs every job on "
                                         r"its own Ray"):
        vet_spec(elsewhere, settings, operator)
    assert Settings.model_validate({"engine_options": "a, b"}).engine_options == ["a", "b"]


def test_image_roots_and_hosts_are_the_operators(tmp_path: Path) -> None:
    """A job's images are read under `images.roots`, each judged as any path it names,
    and fetched only from hosts the operator allows (HSX_IMAGE_HOSTS)."""
    (tmp_path / "d.jsonl").touch()
    (tmp_path / "pictures").mkdir()
    spec = JobSpec(model=str(tmp_path / "m"), dataset=str(tmp_path / "d.jsonl"),
                   output=str(tmp_path / "o"),
                   images={"roots": [str(tmp_path / "pictures"), "/etc"]})  # type: ignore[arg-type]
    settings = Settings(allowed_roots=[tmp_path])
    operator = caller("operator", True, settings)
    with pytest.raises(JobRefused, match=r"^images\.roots\.1: /etc"):
        vet_spec(spec, settings, operator)
    inside = spec.model_copy(update={"images": spec.images.model_copy(  # type: ignore[union-attr]
        update={"roots": [str(tmp_path / "pictures")], "allow_hosts": ["img.example.com"]})})
    with pytest.raises(JobRefused, match=r"^images\.allow_hosts: this server fetches no "
                                         r"images from img\.example\.com \(its operator allows "
                                         r"none: HSX_IMAGE_HOSTS\)"):
        vet_spec(inside, settings, operator)
    allowing = Settings(allowed_roots=[tmp_path], image_hosts="img.example.com")
    vet_spec(inside, allowing, caller("operator", True, allowing))


def test_hub_ids_need_the_operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").touch()
    hub = JobSpec(model="org/model", dataset=str(tmp_path / "d.jsonl"), output=str(tmp_path / "o"))
    restricted = Settings(allowed_roots=[tmp_path])
    assert not restricted.hub_allowed and Settings().hub_allowed
    roots = Roots(tuple(restricted.effective_roots() or ()))
    with pytest.raises(JobRefused, match=r"^model: org/model names a hub repository"):
        check_job_paths(hub, roots, hub_allowed=False)
    check_job_paths(hub, roots, hub_allowed=True)
    with pytest.raises(JobRefused, match=r"^dataset: org/data names a hub repository"):
        check_job_paths(hub.model_copy(update={"dataset": "org/data", "model": "m"}), None,
                        hub_allowed=False)
    # A folder inside the roots whose file leads out of them.
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").symlink_to("/etc/hostname")
    with pytest.raises(JobRefused, match=r"folder/a\.jsonl is outside") as refused:
        check_job_paths(hub.model_copy(update={"dataset": str(tmp_path / "folder")}),
                        roots, hub_allowed=True)
    assert "/etc/hostname" not in str(refused.value)


def test_secrets_are_redacted() -> None:
    spec = JobSpec(model="m", dataset="s3://user:pw@bucket/x", output="o",
                   vllm={"max_num_seqs": 4, "hf_token": "hf_abc"},
                   chat_template_kwargs={"tools": [{"api_key": "k"}], "tokenize": False})
    shown = redacted(spec)
    assert shown.vllm.engine_args() == {"max_num_seqs": 4, "hf_token": "***"}
    assert shown.chat_template_kwargs == {"tools": [{"api_key": "***"}], "tokenize": False}
    assert shown.dataset == "s3://***@bucket/x"
    assert spec.vllm.engine_args()["hf_token"] == "hf_abc"  # the job itself is unchanged


def test_who_may_start_and_which_hosts_are_answered(tmp_path: Path) -> None:
    assert Settings().refusal_to_start() is None
    refusal = Settings(host="0.0.0.0").refusal_to_start()
    assert refusal is not None and "HSX_ALLOW_OPEN" in refusal
    assert Settings(host="0.0.0.0", allow_open=True).refusal_to_start() is None
    assert Settings(host="0.0.0.0", allow_open=True).open_to_all
    assert Settings(host="0.0.0.0", api_token="t" * 20).refusal_to_start() is None
    assert Settings(host="0.0.0.0", tokens_file=_tokens(tmp_path)).refusal_to_start() is None
    local = Settings()
    for host in ("localhost:8642", "127.0.0.1:8642", "[::1]:8642", "localhost"):
        assert local.host_allowed(host), host
    for host in ("attacker.example", "attacker.example:8642", None):
        assert not local.host_allowed(host), host
    assert Settings(host="10.0.0.5", api_token="t" * 20).host_allowed("hsx.internal:8642")
    named = Settings(allowed_hosts="hsx.internal")
    assert named.host_allowed("hsx.internal:8642") and not named.host_allowed("localhost")


def test_tokens_file_errors_name_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    for text, message in (("tokens: {}", "expected `tokens:`"),
                          ("tokens: []", "lists no token, and would let every caller in"),
                          ("tokens:\n  - {token: short, user: a}", "entry 1: `token`"),
                          ("tokens:\n  - {token: replace-with-a-long-random-token, user: a}",
                           "entry 1: `token` is an example's placeholder"),
                          ("tokens:\n  - {token: 6f1c...32 random bytes as hex..., user: a}",
                           "placeholder"),
                          (f"tokens:\n  - {{token: {ALICE}, user: 'a b'}}", "not a user name"),
                          (f"tokens:\n  - {{token: {ALICE}, user: '..'}}", "not a user name"),
                          (f"tokens:\n  - {{token: {ALICE}, user: a, role: x}}", "the keys"),
                          (f"tokens:\n  - {{token: {ALICE}, user: a, roots: /x}}",
                           "`roots` must be a list"),
                          (f"tokens:\n  - {{token: {ALICE}, user: a, read_roots: [data]}}",
                           "not an absolute folder"),
                          (f"tokens:\n  - {{token: {ALICE}, user: a}}\n"
                           f"  - {{token: {ALICE}, user: b}}", "given twice")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as refused:
            TokenTable.load(Settings(tokens_file=path))
        assert str(path) in str(refused.value)
    table = TokenTable.load(Settings(api_token="operator-token-123", tokens_file=_tokens(tmp_path)))
    bob = table.caller(BOB)
    assert bob is not None and (bob.user, bob.admin) == ("bob", False)
    assert table.caller("nope") is None


@pytest.mark.parametrize(("token", "says"), [
    ("s3cret-token", "is shorter than 16 characters"),
    ("REPLACE-ME-with-openssl-rand-hex-32", "is an example's placeholder, not a token"),
    ("replace-with-a-long-random-token", "is an example's placeholder, not a token"),
])
def test_a_short_or_placeholder_api_token_stops_the_start(token: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"^HSX_API_TOKEN \\(or hsx --token\\) {says}: make one "
                                         "with `openssl rand -hex 32`") as refused:
        create_app(Settings(api_token=token), FakeScheduler())
    assert token not in str(refused.value)


def test_each_user_reads_and_writes_in_their_own_roots(tmp_path: Path) -> None:
    """By default a user's roots are their own folder in each allowed root; an admin's the
    whole roots; HSX_READ_ROOTS every caller reads; the tokens file may say otherwise."""
    homes, shared, team = tmp_path / "homes", tmp_path / "shared", tmp_path / "team"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n"
                      f"  - {{token: {ALICE}, user: alice}}\n"
                      f"  - {{token: {BOB}, user: bob, roots: [{team}], "
                      f"read_roots: ['{homes}/alice']}}\n"
                      f"  - {{token: {ROOT}, user: root, admin: true}}\n")
    settings = Settings(tokens_file=tokens, allowed_roots=[homes, "s3://team-hs/jobs"],
                        read_roots=[shared])
    table = TokenTable.load(settings)
    alice, bob, root = (table.caller(t) for t in (ALICE, BOB, ROOT))
    assert alice is not None and bob is not None and root is not None
    assert alice.roots == Roots((homes / "alice", "s3://team-hs/jobs/alice"), (shared,),
                                who="alice")
    assert bob.roots == Roots((team,), (homes / "alice", shared), who="bob")
    assert root.roots == Roots((homes, "s3://team-hs/jobs"), (shared,))
    proxied = caller("carol", False, Settings(user_header="X-User", allowed_roots=[homes]))
    assert proxied.roots == Roots((homes / "carol",), who="carol")
    # Without users and roots (a laptop's server), anywhere.
    assert caller("anonymous", True, Settings()).roots is None


def test_alice_cannot_read_or_write_bobs_folder(tmp_path: Path) -> None:
    homes = tmp_path / "homes"
    (homes / "bob").mkdir(parents=True)
    (homes / "bob" / "private.jsonl").write_text("{}\n")
    settings = Settings(tokens_file=_tokens(tmp_path), allowed_roots=[homes],
                        read_roots=[tmp_path / "data"])
    fake = FakeScheduler()
    mine = job_fields(tmp_path, model=str(tmp_path / "data"),
                      output=str(homes / "alice" / "out"))
    with local_client(create_app(settings, fake)) as c:
        for change, field, says in (
                ({"dataset": str(homes / "bob" / "private.jsonl")}, "dataset", "may read"),
                ({"output": str(homes / "bob" / "alice-out")}, "output", "may write"),
                ({"output": str(tmp_path / "data" / "out")}, "output", "may write")):
            answer = c.post("/v1/jobs", json={"spec": {**mine, **change}}, headers=_as(ALICE))
            assert answer.status_code == 422, change
            assert answer.json()["field"] == f"spec.{field}"
            assert f"is outside the roots alice {says}" in answer.json()["message"]
        inspect = c.post("/v1/models/inspect", headers=_as(ALICE),
                         json={"model": str(homes / "bob")})
        assert inspect.status_code == 422 and "the roots alice may read" in inspect.text
        assert c.post("/v1/jobs", json={"spec": mine}, headers=_as(ALICE)).status_code == 201
        # The admin writes anywhere in the allowed roots.
        theirs = {**mine, "output": str(homes / "bob" / "by-root")}
        assert c.post("/v1/jobs", json={"spec": theirs}, headers=_as(ROOT)).status_code == 201
    assert not (homes / "alice").exists()  # nothing was written


def test_users_see_only_their_own_jobs(tmp_path: Path) -> None:
    fake = FakeScheduler()
    settings = Settings(tokens_file=_tokens(tmp_path), allowed_roots=[tmp_path / "homes"],
                        read_roots=[tmp_path])
    with local_client(create_app(settings, fake)) as c:
        alices = job_fields(tmp_path, output=str(tmp_path / "homes" / "alice" / "out"))
        made = c.post("/v1/jobs", json={"id": "a1", "spec": alices}, headers=_as(ALICE))
        assert made.status_code == 201 and made.json()["owner"] == "alice"
        for method, path in (("GET", "/v1/jobs/a1"), ("DELETE", "/v1/jobs/a1"),
                             ("GET", "/v1/jobs/a1/errors"), ("GET", "/v1/jobs/a1/events"),
                             ("GET", "/v1/jobs/a1/throughput"), ("GET", "/v1/jobs/a1/train")):
            answer = c.request(method, path, headers=_as(BOB))
            assert answer.status_code == 404, path
            assert answer.json()["message"] == "no job 'a1'"
        post = c.post("/v1/jobs/a1/train", json={}, headers=_as(BOB))
        assert post.status_code == 404
        bobs = job_fields(tmp_path, output=str(tmp_path / "homes" / "bob" / "out"))
        taken = c.post("/v1/jobs", json={"id": "a1", "spec": bobs}, headers=_as(BOB))
        assert taken.status_code == 409
        assert c.get("/v1/jobs", headers=_as(BOB)).json()["jobs"] == []
        assert [j["id"] for j in c.get("/v1/jobs", headers=_as(ROOT)).json()["jobs"]] == ["a1"]
        assert c.get("/v1/jobs/a1", headers=_as(ROOT)).status_code == 200
        assert c.get("/v1/whoami", headers=_as(BOB)).json() == {
            "user": "bob", "admin": False, "open": False}
        assert c.get("/metrics", headers=_as(BOB)).status_code == 401
        assert c.get("/metrics", headers=_as(ROOT)).status_code == 200
    assert fake.calls.count("cancel") == 0


def test_a_proxys_user_header(tmp_path: Path) -> None:
    settings = Settings(user_header="X-Forwarded-User", admins="root",
                        allowed_roots=[tmp_path])
    with local_client(create_app(settings, FakeScheduler())) as c:
        assert c.get("/v1/jobs").status_code == 401
        assert c.get("/v1/jobs", headers={"X-Forwarded-User": "a b"}).status_code == 401
        me = c.get("/v1/whoami", headers={"X-Forwarded-User": "root"}).json()
        assert me == {"user": "root", "admin": True, "open": False}


class _Broken(FakeScheduler):
    def errors(self, job_id: str, offset: int, limit: int) -> Any:
        raise RuntimeError("secret path /srv/private/key.pem")


def test_internal_errors_keep_their_text_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _Broken()
    with local_client(create_app(Settings(), fake), raise_server_exceptions=False) as c:
        c.post("/v1/jobs", json={"id": "j", "spec": job_fields(tmp_path)})
        answer = c.get("/v1/jobs/j/errors")
    assert answer.status_code == 500
    body = answer.json()
    assert body["type"] == "InternalError" and "/srv/private" not in answer.text
    error_id = body["message"].split("error id ")[1].split(";")[0]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)


def test_training_refuses_a_manifest_changed_under_the_job(tmp_path: Path) -> None:
    """Whoever can write an output could turn `trust_remote_code` on in its manifest and
    point the model at code of theirs: the trainer takes neither from the manifest, and
    the coordinator trains only on a manifest that is the job's, field by field."""
    from hsx.wire import JobState
    from hsx_service.ledger import JobRow
    from hsx_service.scheduler import check_manifest_is_the_jobs

    from .outputs import make_manifest, write_manifest

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": 4, "hidden_size": 8, "num_attention_heads": 2,
        "vocab_size": 32}))
    spec = JobSpec(model=str(tmp_path / "model"), dataset=str(tmp_path / "d.jsonl"),
                   output=str(tmp_path / "out"), layers=[1, 4])
    row = JobRow(seq=1, id="j", spec=spec, output=spec.output, state=JobState.succeeded,
                 created_at=0.0, started_at=None, finished_at=None, last_error=None,
                 cancel_requested=False, restarts=0, owner="alice")
    manifest = make_manifest(layers=[1, 4], hidden_size=8, num_layers=4, units=[(0, 1)],
                             model=spec.model, spec=spec.model_dump(mode="json"),
                             job_fingerprint=spec.data_fingerprint())
    write_manifest(spec.output, manifest)
    check_manifest_is_the_jobs(row)  # as the job wrote it
    changed = manifest.model_copy(update={
        "model": str(tmp_path / "evil"),
        "spec": {**manifest.spec, "trust_remote_code": True}})
    (Path(spec.output) / "manifest.json").write_text(changed.model_dump_json())
    with pytest.raises(JobRefused, match=r"model, spec\.trust_remote_code differ from job j's"):
        check_manifest_is_the_jobs(row)
