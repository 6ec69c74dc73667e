"""compat's fixes of vLLM on its CPU platform (the platform of these machines):

- sampling under capture: the installed function expands per-request values over draft
  tokens the way vLLM's kernel means to, where the CPU build's own returns uninitialized
  memory;
- the kernel-override scan at engine start: it rebinds kernels in a process that holds an
  object like llvmlite's library (imported with numba), where vLLM's own scan raises;
- the compile cache on the CPU platform: the AOT artifact its build cannot load is off,
  unless the environment names it;
- the model registry's inspection of a class at engine start: in the process that builds
  the engine, not in a new one.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sys
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
rejection_sampler = pytest.importorskip("vllm.v1.sample.rejection_sampler")


def test_expansion_over_draft_tokens_is_exact() -> None:
    from vllm.platforms import current_platform

    from hsx_workers.engines.vllm.compat import fix_cpu_sampling_constraints

    if not current_platform.is_cpu():
        pytest.skip("the fix applies to vLLM's CPU platform only")
    assert fix_cpu_sampling_constraints()
    assert fix_cpu_sampling_constraints()  # twice is once
    expand = rejection_sampler.expand_batch_to_tokens
    # Three requests with 2, 0 and 3 draft tokens; the second is greedy (-1 -> 1).
    temperature = torch.tensor([0.8, -1.0, 0.5])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = expand(temperature, cu, 5, replace_from=-1, replace_to=1)
    assert out.dtype == temperature.dtype
    assert out.tolist() == pytest.approx([0.8, 0.8, 0.5, 0.5, 0.5])
    top_k = torch.tensor([5, 7, -1], dtype=torch.int32)
    assert expand(top_k, torch.tensor([1, 3, 4]), 4).tolist() == [5, 7, 7, -1]
    # Every value is written: nothing is left of the memory it was given.
    for _ in range(20):
        assert torch.isfinite(expand(torch.rand(64), torch.arange(1, 65) * 2, 128)).all()


class _LockedLibrary:
    """As llvmlite's `binding.ffi.lib`: no instance dict, and any attribute it lacks,
    `__dict__` included, is a function of the library (wrapped, not a dict)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return _LibraryFunction()


class _LibraryFunction:
    __slots__ = ()


def test_kernel_overrides_register_beside_llvmlite(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")
    from hsx_workers.engines.vllm.compat import fix_kernel_override_scan

    def kernel(x: int) -> int:
        raise AssertionError("the original kernel ran")

    def impl(x: int) -> int:
        return x + 1

    # A module that defines a kernel, a warmup owner that holds it as its `kernel`, and
    # llvmlite's library beside them.
    module = types.ModuleType("hsx_test_kernels")
    module.kernel = kernel  # type: ignore[attr-defined]
    module.owner = types.SimpleNamespace(kernel=kernel)  # type: ignore[attr-defined]
    module.lib = _LockedLibrary()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(dispatcher, "_registry", {})
    # The builtin for the test; the fix's own `vars` is taken away after it.
    monkeypatch.setattr(dispatcher, "vars", builtins.vars, raising=False)

    assert fix_kernel_override_scan()
    assert fix_kernel_override_scan()  # twice is once
    dispatcher.register_kernels({"hsx_test_kernels.kernel": impl})
    assert isinstance(module.kernel, dispatcher.KernelOverride)
    assert module.owner.kernel is module.kernel
    assert module.kernel[1](41) == 42
    # Every other namespace reads as before: a class's (a mappingproxy), an instance's.
    namespace = dispatcher.vars
    assert namespace(dispatcher.KernelOverride) == vars(dispatcher.KernelOverride)
    assert namespace(module.owner) is vars(module.owner)
    assert namespace(module.lib) == {}


def test_the_cpu_platform_compiles_through_the_cache_it_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm.envs as envs
    from vllm.platforms import current_platform

    from hsx_workers.engines.vllm.compat import compile_through_loadable_cache

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    assert envs.use_aot_compile()  # vLLM's default with this torch: the artifact
    assert compile_through_loadable_cache()
    assert not envs.use_aot_compile()
    # What the environment says stays.
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert not compile_through_loadable_cache() and envs.use_aot_compile()
    # Elsewhere (a GPU) vLLM loads its artifact: nothing changes.
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert not compile_through_loadable_cache() and envs.use_aot_compile()


def test_model_classes_are_inspected_in_this_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """vLLM's registry asks a fresh Python process what a model class can do, unless its
    cache in VLLM_CACHE_ROOT knows; inside `models_inspected_here` it asks this one, and
    caches the answer as vLLM caches it."""
    import vllm.envs as envs
    from vllm.model_executor.models import registry

    from hsx_workers.engines.vllm.compat import models_inspected_here

    class Spawned(Exception):
        pass

    def no_process(*args: Any, **kwargs: Any) -> Any:
        raise Spawned(args)

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert str(tmp_path) == envs.VLLM_CACHE_ROOT
    monkeypatch.setattr(registry.subprocess, "run", no_process)
    entry = registry.ModelRegistry.models["LlamaForCausalLM"]
    with pytest.raises(Spawned):  # vLLM's own way, on a cold cache
        entry.inspect_model_cls()
    elsewhere = registry._run_in_subprocess
    with models_inspected_here() as here:
        assert here
        info = entry.inspect_model_cls()
    assert registry._run_in_subprocess is elsewhere
    assert info.architecture == "LlamaForCausalLM" and info.is_text_generation_model
    cached = list((tmp_path / "modelinfos").iterdir())
    assert [p.name for p in cached] == ["vllm-model_executor-models-llama-LlamaForCausalLM.json"]
    again = entry.inspect_model_cls()  # from the cache, no process
    assert json.loads(json.dumps(dataclasses.asdict(again))) == json.loads(
        json.dumps(dataclasses.asdict(info)))  # (a tuple comes back from JSON a list)
