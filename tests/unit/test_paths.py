"""Allowed roots: a job's dataset and output must really land inside one of them, what
it writes inside the caller's write roots, and a refusal names the field, never where a
path resolves to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsx.spec import DatasetSpec, JobSpec
from hsx_service.errors import JobRefused, refused_field
from hsx_service.paths import (
    Roots,
    check_job_paths,
    check_path,
    local_candidates,
    resolve,
    within,
)


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """/data (allowed), /data-evil and /elsewhere beside it, symlinks out of /data."""
    data = tmp_path / "data"
    (data / "sets").mkdir(parents=True)
    evil = tmp_path / "data-evil"
    evil.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.jsonl").write_text("{}\n")
    (data / "link-out").symlink_to(elsewhere)
    (data / "file-link").symlink_to(elsewhere / "secret.jsonl")
    (data / "dangling").symlink_to(elsewhere / "not-yet")
    (data / "link-in").symlink_to(data / "sets")
    return {"root": tmp_path, "data": data, "evil": evil, "elsewhere": elsewhere}


def refused(value: str, roots: list[Path], field: str = "output") -> str:
    with pytest.raises(JobRefused) as info:
        check_path(field, value, roots)
    assert refused_field(info.value) == field
    return str(info.value)


def test_inside_is_allowed(tree: dict[str, Path]) -> None:
    data = tree["data"]
    for value in (str(data), str(data / "sets" / "a.jsonl"), str(data / "new" / "deeper"),
                  str(data / "link-in" / "x"), str(data / "sets" / ".." / "out"),
                  f"file://{data}/out"):
        check_path("output", value, [data])


def test_dotdot_escape_is_refused(tree: dict[str, Path]) -> None:
    data = tree["data"]
    message = refused(str(data / ".." / "elsewhere" / "x"), [data])
    assert "outside the server's allowed roots" in message
    assert str(data) in message  # says which roots are allowed
    # `..` through a directory that does not exist yet still counts.
    refused(str(data / "new" / ".." / ".." / "elsewhere"), [data])


def test_prefix_of_a_root_is_not_inside_it(tree: dict[str, Path]) -> None:
    refused(str(tree["evil"] / "x"), [tree["data"]])
    assert not within(tree["evil"], tree["data"])
    assert within(tree["data"] / "x", tree["data"])
    assert within(tree["data"], tree["data"])


def test_symlinks_out_are_refused(tree: dict[str, Path]) -> None:
    data = tree["data"]
    message = refused(str(data / "link-out" / "new-output"), [data])
    # Where the link leads is the server's business, not the submitter's.
    assert str(tree["elsewhere"]) not in message and "resolves" not in message
    refused(str(data / "file-link"), [data], field="dataset")
    refused(str(data / "dangling"), [data])  # a link to a path that does not exist yet
    refused(str(data / "dangling" / "sub"), [data])


def test_symlinked_root_and_relative_paths(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    alias = tree["root"] / "alias"
    alias.symlink_to(tree["data"])
    check_path("output", str(tree["data"] / "out"), [alias])
    check_path("output", str(alias / "out"), [tree["data"]])
    monkeypatch.chdir(tree["data"])
    check_path("output", "relative/out", [tree["data"]])
    refused("../elsewhere/out", [tree["data"]])


def test_file_uris(tree: dict[str, Path]) -> None:
    data = tree["data"]
    refused(f"file://{tree['elsewhere']}/x", [data])
    # Percent-encoded `..`: refused whichever way a reader decodes the URI.
    refused(f"file://{data}/%2e%2e/elsewhere", [data])
    for host in ("otherhost", "localhost"):
        assert "no host" in refused(f"file://{host}{data}/x", [data])
    assert local_candidates("output", "s3://bucket/x") is None
    assert local_candidates("output", "file:///a%20b") == ["/a b", "/a%20b"]


def test_bucket_prefixes_as_roots(tree: dict[str, Path]) -> None:
    roots: list[str | Path] = [tree["data"], "s3://team/hs/", "GS://other"]
    for value in ("s3://team/hs", "s3://team/hs/job-1", "s3://team/hs/a/b/", "gs://other/x",
                  str(tree["data"] / "out")):
        check_path("output", value, roots)
    for value in ("s3://team/hs-evil/x", "s3://team/x", "s3://team", "s3://teamx/hs/a",
                  "gs://team/hs/a", "az://team/hs/a"):
        assert "outside the server's allowed roots" in refused(value, roots)
    for value in ("s3://team/hs/../x", "s3://team/hs//x", "s3://team/hs/./x", "s3:///hs"):
        assert "no empty, '.' or '..' segments" in refused(value, roots)
    # A bucket is not a local root and a directory is not a bucket root.
    refused("s3://bucket/x", [tree["data"]])
    refused(str(tree["data"] / "x"), ["s3://team/hs"])
    # Schemes that name neither are refused while roots are set.
    assert "only local paths, file:// and bucket URIs" in refused("http://host/x", roots)
    check_job_paths(JobSpec(model="m", dataset="s3://team/hs/data.jsonl",
                            output="s3://team/hs/out"), Roots(tuple(roots)))
    # A bucket dataset is judged as a bucket output, with or without a split.
    split = DatasetSpec(path="s3://team/hs/ultrachat", split="train_sft")
    check_job_paths(JobSpec(model="m", dataset=split, output="s3://team/hs/out"),
                    Roots(tuple(roots)))
    with pytest.raises(JobRefused, match=r"^dataset: s3://team/x/ultrachat is outside"):
        check_job_paths(JobSpec(model="m", dataset=split.model_copy(
            update={"path": "s3://team/x/ultrachat"}), output="s3://team/hs/out"),
            Roots(tuple(roots)))


def test_a_hub_dataset_reads_no_path(tree: dict[str, Path],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree["root"])
    data = tree["data"]
    hub = JobSpec(model="m", dataset=DatasetSpec(path="org/chats", split="train"),
                  output=str(data / "out"))
    check_job_paths(hub, Roots((data,)))
    # A relative path that exists here is a path, and judged as one.
    (tree["root"] / "org" / "chats").mkdir(parents=True)
    with pytest.raises(JobRefused, match=r"^dataset: org/chats .*outside"):
        check_job_paths(hub, Roots((data,)))


def test_home_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("~/x") == Path(os.path.realpath(tmp_path)) / "x"
    check_path("dataset", "~/x.jsonl", [tmp_path])


def test_no_roots_means_no_restriction_and_empty_roots_allow_nothing(
    tree: dict[str, Path],
) -> None:
    spec = JobSpec(model="m", dataset="/etc/passwd", output="/anywhere")
    check_job_paths(spec, None)
    with pytest.raises(JobRefused, match=r"dataset: .*\(none\)"):
        check_job_paths(spec, Roots(()))


def test_job_checks_dataset_then_output(tree: dict[str, Path]) -> None:
    data = tree["data"]
    good = JobSpec(model="m", dataset=str(data / "sets" / "a.jsonl"), output=str(data / "out"))
    check_job_paths(good, Roots((data,)))
    with pytest.raises(JobRefused, match=r"^dataset: "):
        check_job_paths(good.model_copy(update={"dataset": "/etc/passwd"}), Roots((data,)))
    with pytest.raises(JobRefused, match=r"^output: "):
        check_job_paths(good.model_copy(update={"output": str(tree["evil"])}), Roots((data,)))


def test_a_user_writes_only_in_their_write_roots(tree: dict[str, Path]) -> None:
    """alice's own folder is hers to read and write; the shared folder she only reads;
    bob's she neither reads nor writes. Each refusal names the field and her roots."""
    data = tree["data"]
    alice, bob, shared = data / "alice", data / "bob", data / "sets"
    for folder in (alice, bob):
        folder.mkdir()
    (bob / "private.jsonl").write_text("{}\n")
    (shared / "chats.jsonl").write_text("{}\n")
    roots = Roots((alice,), (shared,), who="alice")
    good = JobSpec(model=str(shared), dataset=str(shared / "chats.jsonl"),
                   output=str(alice / "out"))
    check_job_paths(good, roots)
    check_job_paths(good.model_copy(update={"dataset": str(alice / "mine.jsonl")}), roots)
    with pytest.raises(JobRefused) as read:
        check_job_paths(good.model_copy(update={"dataset": str(bob / "private.jsonl")}), roots)
    assert str(read.value) == (f"dataset: {bob / 'private.jsonl'} is outside the roots alice "
                               f"may read ({alice}, {shared})")
    for output in (bob / "out", shared / "out", data / "out"):
        with pytest.raises(JobRefused) as wrote:
            check_job_paths(good.model_copy(update={"output": str(output)}), roots)
        assert str(wrote.value) == (f"output: {output} is outside the roots alice may write "
                                    f"({alice})")
    # vLLM's download_dir is written, its hf_config_path read.
    def tuned(**vllm: str) -> JobSpec:
        return JobSpec.model_validate({**good.model_dump(), "vllm": vllm})

    check_job_paths(tuned(hf_config_path=str(shared), download_dir=str(alice / "hub")), roots)
    with pytest.raises(JobRefused, match=r"^vllm.download_dir: .* may write"):
        check_job_paths(tuned(download_dir=str(shared)), roots)


def test_refusals_show_the_roots_as_configured(tree: dict[str, Path]) -> None:
    alias = tree["root"] / "alias"
    alias.symlink_to(tree["data"])
    message = refused(str(tree["elsewhere"] / "x"), [alias])
    assert f"({alias})" in message and str(tree["data"]) not in message


def test_a_path_that_cannot_be_looked_at_is_refused_naming_the_field(
        tree: dict[str, Path]) -> None:
    data = tree["data"]
    (data / "loop").symlink_to(data / "loop")
    for field, value in (("dataset", data / "loop"), ("output", data / "loop" / "out"),
                         ("model", data / "loop")):
        message = refused(str(value), [data], field=field)
        assert message == f"{field}: {value} cannot be read here (Too many levels of " \
                          "symbolic links)"
    # A folder dataset whose folder cannot be listed.
    with pytest.raises(JobRefused, match=r"^dataset: .* cannot be read here"):
        check_job_paths(JobSpec(model="m", dataset=str(data / "loop"), output=str(data / "o")),
                        Roots((data,)), hub_allowed=True)
