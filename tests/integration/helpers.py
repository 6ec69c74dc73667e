"""Reading outputs back for comparisons between runs."""

from __future__ import annotations

import contextlib
import hashlib
import signal
from pathlib import Path

import psutil
import torch

from hsx.dataset import HiddenStatesDataset


def by_sample(output: Path) -> dict[int, dict[str, torch.Tensor]]:
    """sample_index -> its tensors (hidden states as float32), asserting no duplicate."""
    ds = HiddenStatesDataset(output, backend="torch")
    samples: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(len(ds)):
        item = ds[i]
        index = int(item["sample_index"])
        if index in samples:
            raise AssertionError(f"sample {index} appears twice in {output}")
        samples[index] = {
            "input_ids": item["input_ids"].clone(),
            "loss_mask": item["loss_mask"].clone(),
            "hidden_states": item["hidden_states"].float(),
        }
    return samples


def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per layer: ||a - b|| / ||b|| over tokens and hidden units ([T, L, H] -> [L])."""
    diff = (a.float() - b.float()).pow(2).sum(dim=(0, 2)).sqrt()
    ref = b.float().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-12)
    return diff / ref


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under root: size, mtime and content hash (to prove nothing changed)."""
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            stat = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            state[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns, digest)
    return state


def worker_processes(pid: int, actor: str = "ExtractionWorker") -> list[psutil.Process]:
    """The processes of Ray actors of class `actor` started under process `pid`."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if actor in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def kill_tree(pid: int) -> None:
    """kill -9 a process and everything it started (Ray, engines), then reap them."""
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(family, timeout=30)
