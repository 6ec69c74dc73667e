"""Where a dataset's rows come from: folders of splits (Hugging Face layouts, DatasetDicts),
refusals that name the splits and what to write, hub ids (a monkeypatched `datasets` for
the reading; the real, unreachable hub for the refusal), and fingerprints.

Bucket datasets, on a real S3 server, are in tests/integration/test_dataset_s3.py.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from hsx.ingest import (
    DatasetAccessError,
    DatasetFormatError,
    DatasetNotFoundError,
    check_dataset,
    count_rows,
    dataset_fingerprint,
    ingest,
    is_hub_id,
    iter_rows,
    resolve_source,
)
from hsx.ingest import sources as sources_module
from hsx.output import Output
from hsx.spec import DatasetSpec, JobSpec
from hsx_service.errors import JobRefused
from hsx_service.prepare import check_dataset as preflight_dataset
from hsx_workers.tiny_models import write_rows

# UltraChat 200k's files, as `hf download --repo-type dataset` leaves them.
ULTRACHAT = {
    "train_sft": ["train_sft-00000-of-00002-a1b2.parquet",
                  "train_sft-00001-of-00002-c3d4.parquet"],
    "test_sft": ["test_sft-00000-of-00001.parquet"],
    "train_gen": ["train_gen-00000-of-00001.parquet"],
}


def ultrachat(root: Path, rows_per_file: int = 3) -> Path:
    """A folder laid out as UltraChat's: README.md, data/{split}-NNNNN-of-NNNNN.parquet,
    and a hidden .cache/ (the hub's download metadata) that must not be read."""
    for split, names in ULTRACHAT.items():
        for shard, name in enumerate(names):
            write_rows([{"text": f"{split} {shard} {i}"} for i in range(rows_per_file)],
                       root / "data" / name, "parquet")
    (root / "README.md").write_text("---\nconfigs: []\n---\n")
    write_rows([{"text": "hidden"}], root / ".cache" / "huggingface" / "x.parquet", "parquet")
    return root


def texts(dataset: Any) -> list[str]:
    return [row["text"] for row in iter_rows(dataset)]


# --------------------------------------------------------------------------- splits


def test_a_folder_of_splits_is_refused_without_one_naming_them(tmp_path: Path) -> None:
    root = ultrachat(tmp_path / "ultrachat")
    with pytest.raises(DatasetFormatError) as refused:
        resolve_source(root)
    message = str(refused.value)
    assert str(root) in message
    assert "splits ['test_sft', 'train_gen', 'train_sft']" in message
    assert f"dataset: {{path: {root}, split: test_sft}}" in message  # what to write
    # The preflight refuses it the same way, naming the field.
    spec = JobSpec(model="m", dataset=str(root), output=str(tmp_path / "o"))
    with pytest.raises(JobRefused, match=r"^dataset: .*has splits \['test_sft'"):
        preflight_dataset(spec)


def test_one_split_is_read_alone_in_file_order(tmp_path: Path) -> None:
    root = ultrachat(tmp_path / "ultrachat")
    train = DatasetSpec(path=str(root), split="train_sft")
    assert texts(train) == [f"train_sft {shard} {i}" for shard in (0, 1) for i in range(3)]
    assert count_rows(train) == 6
    assert texts(DatasetSpec(path=str(root), split="test_sft")) == [
        f"test_sft 0 {i}" for i in range(3)]
    # Pointing at data/ itself reads the same split.
    assert texts(DatasetSpec(path=str(root / "data"), split="train_sft")) == texts(train)
    source = check_dataset(train)
    assert [f.name for f in source.files] == [f"data/{n}" for n in ULTRACHAT["train_sft"]]
    with pytest.raises(DatasetFormatError, match=r"has no split 'train'; its splits are"):
        resolve_source(DatasetSpec(path=str(root), split="train"))


def test_a_job_names_its_split_and_ingests_only_that(tiny_tokenizer: Path,
                                                     tmp_path: Path) -> None:
    root = ultrachat(tmp_path / "ultrachat")
    result = ingest(DatasetSpec(path=str(root), split="train_gen"), str(tiny_tokenizer), 64,
                    tmp_path / "out")
    assert (result.num_rows, result.num_samples) == (3, 3)
    assert Output(tmp_path / "out").inputs()["sample_index"].to_pylist() == [0, 1, 2]


def test_one_split_needs_no_name(tmp_path: Path) -> None:
    for i in range(2):
        write_rows([{"text": f"r{i}"}], tmp_path / "d" / f"train-0000{i}-of-00002.parquet",
                   "parquet")
    assert texts(tmp_path / "d") == ["r0", "r1"]
    assert texts(DatasetSpec(path=str(tmp_path / "d"), split="train")) == ["r0", "r1"]


def test_split_folders(tmp_path: Path) -> None:
    write_rows([{"text": "a"}], tmp_path / "d" / "train" / "part-1.jsonl", "jsonl")
    write_rows([{"text": "b"}], tmp_path / "d" / "train" / "part-2.jsonl", "jsonl")
    write_rows([{"text": "c"}], tmp_path / "d" / "test" / "part-1.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"splits \['test', 'train'\]"):
        resolve_source(tmp_path / "d")
    assert texts(DatasetSpec(path=str(tmp_path / "d"), split="train")) == ["a", "b"]
    # One folder of files below the root (a hub repo's data/): no split to name.
    write_rows([{"text": "x"}], tmp_path / "repo" / "data" / "all.jsonl", "jsonl")
    assert texts(tmp_path / "repo") == ["x"]


def test_files_directly_in_a_folder_are_one_dataset_as_before(tmp_path: Path) -> None:
    write_rows([{"text": "a"}], tmp_path / "d" / "b.jsonl", "jsonl")
    write_rows([{"text": "b"}], tmp_path / "d" / "a.jsonl", "jsonl")
    write_rows([{"text": "old"}], tmp_path / "d" / "old" / "x.jsonl", "jsonl")  # not read
    assert texts(tmp_path / "d") == ["b", "a"]
    with pytest.raises(DatasetFormatError, match=r"has no splits .*remove `split`"):
        resolve_source(DatasetSpec(path=str(tmp_path / "d"), split="train"))
    with pytest.raises(DatasetFormatError, match="one file, which has no splits"):
        resolve_source(DatasetSpec(path=str(tmp_path / "d" / "a.jsonl"), split="train"))


def test_a_dataset_dict_is_read_one_split_at_a_time(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
                               "test": datasets.Dataset.from_dict({"text": ["c"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetFormatError, match=r"splits \['test', 'train'\]"):
        resolve_source(tmp_path / "dd")
    assert texts(DatasetSpec(path=str(tmp_path / "dd"), split="train")) == ["a", "b"]
    assert count_rows(DatasetSpec(path=str(tmp_path / "dd"), split="test")) == 1
    # The split's fingerprint is that of its folder's files, as when pointed at directly.
    assert dataset_fingerprint(DatasetSpec(path=str(tmp_path / "dd"), split="test")) != (
        dataset_fingerprint(DatasetSpec(path=str(tmp_path / "dd"), split="train")))
    with pytest.raises(DatasetFormatError, match="one saved split"):
        resolve_source(DatasetSpec(path=str(tmp_path / "dd" / "train"), split="train"))


def test_missing_and_unsupported_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match=r"nope\.jsonl does not exist"):
        check_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetFormatError, match="unsupported URI"):
        resolve_source("http://host/data.jsonl")
    write_rows([{"text": "a"}], tmp_path / "d.jsonl", "jsonl")
    assert texts(f"file://{tmp_path / 'd.jsonl'}") == ["a"]


# ------------------------------------------------------------------------------ hub


def test_what_reads_as_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for hub in ("HuggingFaceH4/ultrachat_200k", "squad", "org/name.v2"):
        assert is_hub_id(hub), hub
    for path in ("/abs/x", "./x", "~/x", "data.jsonl", "a/b/c", "s3://b/x", "org/x.parquet"):
        assert not is_hub_id(path), path
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_hub_id("org/local")  # a folder of that name exists here


class FakeHub:
    """`datasets.load_dataset` and `get_dataset_split_names` over in-memory splits."""

    def __init__(self, splits: dict[str, list[str]]) -> None:
        import datasets

        self.splits = {name: datasets.Dataset.from_dict({"text": rows})
                       for name, rows in splits.items()}
        self.loads: list[tuple[str, str | None]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import datasets

        monkeypatch.setattr(datasets, "load_dataset", self.load_dataset)
        monkeypatch.setattr(datasets, "get_dataset_split_names",
                            lambda path, **_: list(self.splits))
        monkeypatch.setattr(sources_module, "_probe_hub", lambda hub_id: None)

    def load_dataset(self, path: str, split: str | None = None, **_: Any) -> Any:
        self.loads.append((path, split))
        if split not in self.splits:
            raise ValueError(f'Unknown split "{split}". Should be one of {list(self.splits)}.')
        return self.splits[split]


def test_a_hub_dataset_is_read_with_load_dataset_one_split_at_a_time(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    hub = FakeHub({"train_sft": ["a", "b", "c"], "test_sft": ["d"]})
    hub.install(monkeypatch)
    name = "HuggingFaceH4/ultrachat_200k"
    with pytest.raises(DatasetFormatError, match=r"splits \['train_sft', 'test_sft'\]"):
        check_dataset(name)
    check_dataset(DatasetSpec(path=name, split="test_sft"))
    with pytest.raises(DatasetFormatError, match="has no split 'train'"):
        check_dataset(DatasetSpec(path=name, split="train"))
    assert hub.loads == []  # checks download nothing
    train = DatasetSpec(path=name, split="train_sft")
    assert texts(train) == ["a", "b", "c"]
    assert hub.loads == [(name, "train_sft")]
    assert count_rows(train) == 3
    fingerprint = dataset_fingerprint(train)
    assert fingerprint == dataset_fingerprint(train)
    assert fingerprint != dataset_fingerprint(DatasetSpec(path=name, split="test_sft"))
    result = ingest(train, str(tiny_tokenizer), 64, tmp_path / "out")
    assert result.num_samples == 3 and result.dataset_fingerprint == fingerprint
    # A job names it as it names any dataset; a hub id is not a path to check.
    from hsx_service.paths import Roots, check_job_paths

    check_job_paths(JobSpec(model="m", dataset=train, output=str(tmp_path / "o")),
                    Roots((tmp_path,)))


def test_a_hub_that_cannot_be_reached_is_refused_saying_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    # A hub address where nothing listens (this machine reaches no hub at all, but a
    # test should not depend on that).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(DatasetAccessError) as refused:
        check_dataset(DatasetSpec(path="HuggingFaceH4/ultrachat_200k", split="train_sft"))
    message = str(refused.value)
    assert "HuggingFaceH4/ultrachat_200k is not a local path" in message
    assert "the hub cannot be reached" in message
    assert "hf download HuggingFaceH4/ultrachat_200k --repo-type dataset" in message
    # Reading it (no preflight before) is refused the same way, without datasets' retries.
    with pytest.raises(DatasetAccessError, match="the hub cannot be reached"):
        next(iter_rows("HuggingFaceH4/ultrachat_200k"))


def test_this_machine_refuses_a_hub_job_before_any_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    try:
        socket.getaddrinfo("huggingface.co", 443)
    except OSError:
        pass
    else:
        pytest.skip("the hub's name resolves here: this is about a machine without it")
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    spec = JobSpec(model="m", output=str(tmp_path / "o"), dataset=DatasetSpec(
        path="HuggingFaceH4/ultrachat_200k", split="train_sft"))
    with pytest.raises(JobRefused, match=r"^dataset: .*the hub cannot be reached"):
        preflight_dataset(spec)


# ---------------------------------------------------------------------- fingerprints


def test_a_local_fingerprint_is_what_it_always_was(tmp_path: Path) -> None:
    # Outputs made before keep resuming: names, sizes and mtimes, hashed as before.
    data = write_rows([{"text": "a"}], tmp_path / "d.jsonl", "jsonl")
    st = data.stat()
    expected = hashlib.sha256(f"d.jsonl\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    assert dataset_fingerprint(data) == expected.hexdigest()[:16]
    assert dataset_fingerprint(str(data)) == dataset_fingerprint(DatasetSpec(path=str(data)))


def test_a_split_fingerprint_follows_its_own_files_only(tmp_path: Path) -> None:
    root = ultrachat(tmp_path / "ultrachat")
    train = DatasetSpec(path=str(root), split="train_sft")
    test = DatasetSpec(path=str(root), split="test_sft")
    before = dataset_fingerprint(train), dataset_fingerprint(test)
    assert before[0] != before[1]
    os.utime(root / "data" / ULTRACHAT["test_sft"][0], ns=(1, 1))
    assert dataset_fingerprint(train) == before[0]
    assert dataset_fingerprint(test) != before[1]
    os.utime(root / "data" / ULTRACHAT["train_sft"][1], ns=(1, 1))
    assert dataset_fingerprint(train) != before[0]

