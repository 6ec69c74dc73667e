"""An engine that cannot start because vLLM's compile cache holds a file cut short (an
engine killed while it compiled) says so, naming the file and the folder to remove;
one whose cache is sound keeps vLLM's own error."""

from __future__ import annotations

import _bisect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hsx_service.dispatch import _first_line
from hsx_workers.engines.vllm.compile_cache import (
    EngineStartError,
    explain_start_failure,
    is_truncated_elf,
    raise_explained,
    truncated_objects,
)

SHARED_OBJECT = Path(_bisect.__file__)  # a real ELF shared object, in every Python


def _cache(root: Path, entry: str, name: str, cut: int | None = None) -> Path:
    """A compiled object in vLLM's AOT cache layout, cut to `cut` bytes if given."""
    path = root / "torch_aot_compile" / entry / "inductor_cache" / "ab" / name
    path.parent.mkdir(parents=True)
    shutil.copyfile(SHARED_OBJECT, path)
    if cut is not None:
        with path.open("r+b") as f:
            f.truncate(cut)
    return path


def test_every_cut_of_a_shared_object_is_found_and_the_whole_one_is_not(tmp_path: Path) -> None:
    size = SHARED_OBJECT.stat().st_size
    whole = tmp_path / "whole.so"
    shutil.copyfile(SHARED_OBJECT, whole)
    assert not is_truncated_elf(whole)
    for cut in (0, 10, 40, 63, 64, 200, size // 3, size // 2, size - 1):
        part = tmp_path / f"cut-{cut}.so"
        shutil.copyfile(SHARED_OBJECT, part)
        with part.open("r+b") as f:
            f.truncate(cut)
        assert is_truncated_elf(part), cut


def test_the_loader_refuses_what_is_found(tmp_path: Path) -> None:
    # The failure seen when a killed start left the cache behind: the dynamic loader
    # refuses the object that the check finds (in a process of its own: an object cut
    # inside its segments can take the loading process down with SIGBUS).
    part = _cache(tmp_path, "h1", "c.main.so", cut=100)
    assert truncated_objects(tmp_path) == [part]
    loaded = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(part)!r})"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.returncode != 0
    assert re.search("file too short|cannot read file data", loaded.stderr), loaded.stderr


def test_the_message_names_the_file_and_the_entry_to_remove(tmp_path: Path) -> None:
    _cache(tmp_path, "good", "a.main.so")
    broken = _cache(tmp_path, "h1", "b.main.so", cut=100)
    err = RuntimeError("Engine core initialization failed. See root cause above. "
                       "Failed core proc(s): {'EngineCore_DP0': 1}")
    message = explain_start_failure(err, tmp_path)
    assert message is not None
    assert str(broken) in message
    assert f"Remove {tmp_path / 'torch_aot_compile' / 'h1'} " in message
    assert str(tmp_path / "torch_aot_compile" / "good") not in message
    assert "Engine core initialization failed" in message  # vLLM's own words kept


def test_a_sound_cache_leaves_vllms_error_alone(tmp_path: Path) -> None:
    _cache(tmp_path, "good", "a.main.so")
    err = ValueError("the model does not fit")
    raise_explained(err, tmp_path)  # returns: the caller raises vLLM's error
    assert explain_start_failure(err, tmp_path / "missing") is None


def test_the_job_status_shows_the_explanation(tmp_path: Path) -> None:
    # The engine's actor dies in its constructor; the job's error is the line Ray's
    # message carries for it (dispatch's _first_line), which must be this one.
    _cache(tmp_path, "h1", "b.main.so", cut=100)
    with pytest.raises(EngineStartError) as caught:
        raise_explained(ImportError("b.main.so: file too short"), tmp_path)
    ray_text = (
        "The actor died because of an error raised in its creation task, "
        "ray::ExtractionWorker.__init__() (pid=1, ip=127.0.0.1)\n"
        '  File "vllm_engine.py", line 160, in __init__\n'
        "ImportError: b.main.so: file too short\n\n"
        "The above exception was the direct cause of the following exception:\n\n"
        f"hsx_workers.engines.vllm.compile_cache.EngineStartError: {caught.value}\n"
    )
    assert _first_line(Exception(ray_text)) == (
        f"hsx_workers.engines.vllm.compile_cache.EngineStartError: {caught.value}")
