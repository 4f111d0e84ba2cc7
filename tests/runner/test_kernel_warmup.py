"""No Triton kernel variant is first built while serving: the engine's start-up launches every
variant (kernel and constexpr specialization) that prompts of every length bucket, at every
batch size up to max_num_seqs, chunked and speculative, go on to launch. Triton's interpreter
builds nothing, so the variants are recorded at launch; on a GPU the engine's own count of real
builds after warm-up (stats: num_kernel_builds_after_warmup) is checked by the GPU benchmark."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from speckernel.config import EngineConfig
from speckernel.platforms.cpu import CpuPlatform
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU counts real builds (bench decode)")


def record_variants(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, tuple[Any, ...]]]:
    """Every (kernel, constexprs and launch options) launched from now on."""
    from speckernel.ops import fused_ops, small_batch, triton_attention
    from speckernel.runner import sampler, verify

    seen: set[tuple[str, tuple[Any, ...]]] = set()
    kernels = [*vars(triton_attention._kernels()).values(), *vars(fused_ops._kernels()).values(),
               *vars(small_batch._kernels()).values(), sampler._race_kernel(), verify._triton_kernel()]
    for kernel in kernels:
        run = kernel.run

        def recorded(*args: Any, _run: Any = run, _name: str = kernel.fn.__name__, **kwargs: Any) -> Any:
            meta = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("grid", "warmup")))
            seen.add((_name, meta))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", recorded)
    return seen


@pytest.mark.parametrize("spec", [{}, {"speculator": "ngram", "num_speculative_tokens": 3}])
def test_serving_launches_only_variants_built_at_start(spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from speckernel.engine.core import EngineCore

    monkeypatch.setattr(CpuPlatform, "capabilities", msgspec.structs.replace(CpuPlatform.capabilities, triton=True))
    # Greedy requests only: the warm-up's sampled dummy rows are NaN (padding has no context),
    # which the GPU ignores and Triton's interpreter refuses in an argmax.
    monkeypatch.setattr("speckernel.runner.step_graphs.SAMPLING_KINDS", ((True, False),))
    seen = record_variants(monkeypatch)
    # One layer: the layers share their shapes, so two launch no variant that one does not (the
    # first layer's input norm adds no residual, the final norm adds one either way); each
    # interpreted layer costs as much again.
    core = EngineCore(EngineConfig(model="random:tiny,num_layers=1", platform="cpu", dtype="float32",
                                   max_model_len=160, max_num_seqs=6, num_kv_blocks=96, max_num_batched_tokens=48,
                                   **spec))
    built = set(seen)
    assert built, "the warm-up launched nothing"
    assert any(name == "fused_linear_kernel" for name, _ in built), "decode steps run the small-batch kernels"
    rng = np.random.default_rng(0)
    # Every query-length class (1 to past the long-query tiles), alone and several at once, and
    # prompts longer than the token budget (chunked beside decode rows).
    waves = [[12], [40], [1, 3, 9, 17, 70, 130]]
    for wave in waves:
        for key, n in enumerate(wave):
            prompt = (rng.integers(0, 40, 6).tolist() * 30)[:n]
            assert core.add_request(AddRequest(key, prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                           ignore_eos=True))) is None
        while core.scheduler.requests:
            for delta in core.step():
                assert delta.error is None, delta.error
    served = seen - built
    assert not served, f"variants first built while serving: {sorted(served)}"


@pytest.mark.parametrize(("mask_widths", "widths"), [((), 4), ((0,), 4), ((0, 6), 7)])
def test_eager_warm_up_covers_every_verify_width_on_any_stage(monkeypatch: pytest.MonkeyPatch,
                                                              mask_widths: tuple[int, ...], widths: int) -> None:
    """A pipeline stage before the last samples nothing, so it has no mask widths: its warm-up
    still covers K + 1 verify widths (a stage once failed to start on a GPU there)."""
    from types import SimpleNamespace

    from speckernel.engine import fast_path

    seen: list[list[int]] = []
    monkeypatch.setattr(fast_path, "warm_eager", lambda runner, verify, max_tokens: seen.append(list(verify)) or 0)
    monkeypatch.setattr(fast_path.JIT_WATCH, "seal", lambda: None)  # the process's watch stays as it was
    runner = SimpleNamespace(attention=SimpleNamespace(warm_up=lambda kv, heads: 0), mask_widths=mask_widths)
    platform = SimpleNamespace(capabilities=SimpleNamespace(triton=True), synchronize=lambda: None)
    fast_path.warm_kernels(runner, torch.zeros(1), platform, 4, 3, 64)  # type: ignore[arg-type]
    assert seen == [list(range(widths))]
