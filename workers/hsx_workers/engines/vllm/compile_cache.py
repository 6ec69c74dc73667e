"""vLLM's compile cache, when it is what keeps an engine from starting.

vLLM keeps the code it compiles for a model (inductor's shared objects) under
`$VLLM_CACHE_ROOT/torch_compile_cache`, keyed by a hash of the model and its
configuration, and loads it at every later start of that configuration. It writes those
files in place: an engine killed while it compiles (a job cancelled during its start, a
node lost) can leave one cut short, and every later start of that configuration then fails
in the dynamic loader (`ImportError: ...main.so: file too short`). With the engine core
in its own process (vLLM's default) the engine's actor sees only "Engine core
initialization failed. See root cause above"; the cause is in a log the user of a job
does not read.

`explain_start_failure` names the broken file and the folder to remove; the engine's
start raises `EngineStartError` with that message, which the job's status shows.

A cache folder is never removed here: another engine on the node may be compiling the
same configuration into it this moment, and its files, half written, look the same.
"""

from __future__ import annotations

import struct
from pathlib import Path

COMPILE_CACHE = "torch_compile_cache"
SHOWN = 3  # broken files named in a message


class EngineStartError(RuntimeError):
    """The engine could not start, for a reason hsx can name."""


def compile_cache_root() -> Path:
    """The folder vLLM compiles into ($VLLM_CACHE_ROOT, ~/.cache/vllm by default)."""
    import vllm.envs

    return Path(vllm.envs.VLLM_CACHE_ROOT) / COMPILE_CACHE


def is_truncated_elf(path: Path) -> bool:
    """True if the shared object at `path` ends before its own headers say it does."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(64)
    except OSError:
        return False
    if len(head) < 16 or head[:4] != b"\x7fELF":
        return True  # a compiled object that is not even an ELF header: cut short
    wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
    # (program header table offset, section header table offset) and their entry sizes
    # and counts, where the ELF class puts them.
    if wide:
        if len(head) < 64:
            return True
        phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
    else:
        if len(head) < 52:
            return True
        phoff, shoff = struct.unpack_from(order + "II", head, 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x2A)
    return phoff + phentsize * phnum > size or shoff + shentsize * shnum > size


def truncated_objects(root: Path) -> list[Path]:
    """The compiled shared objects under `root` that were cut short, oldest first."""
    if not root.is_dir():
        return []
    broken = [p for p in root.rglob("*.so") if p.is_file() and is_truncated_elf(p)]
    return sorted(broken, key=lambda p: (p.stat().st_mtime, str(p)))


def entry_of(path: Path, root: Path) -> Path:
    """The cache entry (one configuration's folder) that holds `path`."""
    parts = path.relative_to(root).parts
    # torch_aot_compile/<hash>/... (vLLM's AOT cache) or <hash>/... (its compile cache)
    depth = 2 if parts[0] == "torch_aot_compile" and len(parts) > 2 else 1
    return root.joinpath(*parts[:depth])


def explain_start_failure(err: BaseException, root: Path) -> str | None:
    """What to do about an engine that could not start, when its compile cache is the
    cause: None if the cache holds no broken file."""
    broken = truncated_objects(root)
    if not broken:
        return None
    entries = sorted({entry_of(p, root) for p in broken}, key=str)
    files = ", ".join(str(p) for p in broken[:SHOWN])
    if len(broken) > SHOWN:
        files += f" and {len(broken) - SHOWN} more"
    remove = " ".join(str(e) for e in entries)
    cause = (str(err).strip().splitlines() or [type(err).__name__])[-1]
    return (f"vLLM's compile cache holds {len(broken)} truncated compiled file(s), left by "
            f"an engine stopped while it compiled: {files}. Every start of this model's "
            f"configuration loads them and fails. Remove {remove} (once no other engine "
            f"on this node is starting; vLLM compiles it again) and resubmit. "
            f"vLLM said: {cause}")


def raise_explained(err: BaseException, root: Path | None = None) -> None:
    """Raise EngineStartError from `err` if the compile cache explains it; else return."""
    message = explain_start_failure(err, compile_cache_root() if root is None else root)
    if message is not None:
        raise EngineStartError(message) from err
