"""Reading outputs back for comparisons between runs; the learnable target's fixture type."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from hsx.dataset import HiddenStatesDataset
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR
from hsx_workers.learnable import TaskLanguage

LEARNABLE_SAMPLES = 3000  # ~75k tokens of the learnable language


@dataclass
class Learnable:
    """tests/integration/conftest.py's `learnable`: the target and its language's rows."""

    target: Path
    language: TaskLanguage
    dataset: Path


def published_step(output: Path) -> int:
    """The checkpoint whose weights draft/ holds (hard links: the same inode)."""
    ino = os.stat(output / DRAFT_DIR / "model.safetensors").st_ino
    for ckpt in (output / DRAFT_CHECKPOINTS).iterdir():
        if os.stat(ckpt / "model.safetensors").st_ino == ino:
            return int(ckpt.name.split("-")[1])
    raise AssertionError("draft/ holds no checkpoint's weights")


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


def error_per_layer(got: dict[int, torch.Tensor], ref: dict[int, torch.Tensor],
                    layers: list[int]) -> tuple[dict[int, float], dict[int, float]]:
    """Median and worst sample of `relative_error`, per layer id, over the samples of ref."""
    errors = torch.stack([relative_error(got[i], ref[i]) for i in ref])  # [samples, layers]
    median = dict(zip(layers, errors.median(dim=0).values.tolist(), strict=True))
    worst = dict(zip(layers, errors.max(dim=0).values.tolist(), strict=True))
    return median, worst


def wrapper_text_states(model: Path, samples: dict[int, dict[str, torch.Tensor]],
                        layers: list[int], device: str = "cpu") -> dict[int, torch.Tensor]:
    """A multimodal wrapper's text path through transformers (bf16): [T, L, H] per sample.

    Ids k < N are `output_hidden_states[k]`, id N the input of the final norm (as hsx
    stores it). The hf engine loads causal LMs only; a wrapper's class comes from
    transformers' image-text-to-text auto class, and with input_ids alone it runs the
    language model.
    """
    import transformers

    from hsx_workers.engines.hf_engine import _final_norm

    loaded: Any = transformers.AutoModelForImageTextToText.from_pretrained(
        str(model), dtype=torch.bfloat16, output_loading_info=True)
    hf, loading = loaded[0].to(device).eval(), loaded[1]
    # A text weight transformers did not find would be random: the comparison would fail
    # for a reason that is not capture's. (Vision weights do not touch the text path.)
    text_missing = [k for k in loading["missing_keys"] if "vision" not in k
                    and "visual" not in k and "projector" not in k]
    if text_missing:
        raise RuntimeError(f"transformers did not find these weights of {model}: "
                           f"{sorted(text_missing)[:8]}")
    num_layers = hf.config.get_text_config().num_hidden_layers
    pre_norm: list[torch.Tensor] = []
    _final_norm(hf).register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    out: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for index, sample in samples.items():
            pre_norm.clear()
            ids = sample["input_ids"].long()[None].to(device)
            result = hf(input_ids=ids, output_hidden_states=True)
            states = [pre_norm[-1][0] if k == num_layers else result.hidden_states[k][0]
                      for k in layers]
            out[index] = torch.stack(states, dim=1).float().cpu()
    return out


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


def size_of(path: Path) -> int:
    """A file's size; 0 once it is gone (a staging file renamed into place between a
    listing and this look)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
