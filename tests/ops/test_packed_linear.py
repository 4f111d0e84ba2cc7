"""The CPU's packed linear: torch's linear to float32 rounding, refused where it would not pay or
fit, and the real model's greedy tokens unchanged by it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.ops import packed_linear
from speckernel.sampling_params import SamplingParams
from tests.conftest import PROMPTS, run_to_completion

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 20, 80])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_torch_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 192, generator=gen)
    b = torch.randn(320, generator=gen) if bias else None
    x = torch.randn(2, rows, 192, generator=gen)  # leading dims kept, as a model's [..., K]
    got = packed_linear.linear(x, packed_linear.pack(weight), b)
    assert got.shape == (2, rows, 320)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_a_gradient_through_a_packed_linear_is_torch_s() -> None:
    """oneDNN's packed linear has no backward: where autograd records the input, the layer takes
    torch's linear, so a gradient through a packed model (a drafter trained through the target's
    head) is the one the plain weights give."""
    from speckernel.models.llama import Linear

    layer = Linear(16, 8, bias=True).requires_grad_(False)
    layer.packed = packed_linear.pack(layer.weight)
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).square().sum().backward()
    expected = 2 * F.linear(x.detach(), layer.weight, layer.bias) @ layer.weight
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_packing_is_refused_where_it_would_not_fit_or_not_pay() -> None:
    w = torch.zeros(64, 64)  # 16 KiB
    assert packed_linear.worth_packing([w], free_bytes=64 << 10)
    assert not packed_linear.worth_packing([w], free_bytes=(64 << 10) - 1), "a second copy within a quarter"
    assert not packed_linear.worth_packing([w.half()], free_bytes=1 << 30), "float32, and bf16 where native"
    assert packed_linear.worth_packing([w.bfloat16()], free_bytes=1 << 30) == packed_linear.packs(torch.bfloat16)
    assert not packed_linear.worth_packing([], free_bytes=1 << 30)


def test_a_probe_that_fails_or_miscomputes_keeps_torch_s_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the ops exist but do not work for this CPU, packing is refused up front."""
    real = packed_linear.linear

    def broken(*args, **kw):  # type: ignore[no-untyped-def]
        raise RuntimeError("could not create a primitive")

    for stand_in in (broken, lambda *a, **kw: real(*a, **kw) + 1):
        monkeypatch.setattr(packed_linear, "linear", stand_in)
        packed_linear.packs.cache_clear()
        assert not packed_linear.packs(torch.float32)
        assert not packed_linear.worth_packing([torch.zeros(4, 4)], free_bytes=1 << 30)
    monkeypatch.setattr(packed_linear, "linear", real)
    packed_linear.packs.cache_clear()
    assert packed_linear.packs(torch.float32)


@pytest.mark.slow
def test_the_cpu_engine_packs_and_its_greedy_tokens_stay_what_torch_s_linear_gives(tokenizer) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(EngineConfig(platform="cpu", max_model_len=256))
    model = core.runner.model
    assert model.packed_head is not None and model.layers[0].mlp.down.packed is not None, "the CPU packs"
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    packed = run_to_completion(core, prompts, greedy)
    model.use_packed_weights(False)
    assert model.packed_head is None and model.layers[0].mlp.down.packed is None
    assert run_to_completion(core, prompts, greedy) == packed


def test_the_batch_invariant_mode_runs_its_rows_on_the_packed_weights() -> None:
    """Each row its own call on the packed weight (tests/ops/test_batch_invariant.py checks that rows
    stay invariant that way)."""
    core = EngineCore(EngineConfig(platform="cpu", model="random:tiny", max_model_len=128, batch_invariant=True))
    model = core.runner.model
    assert model.packed_head is not None and model.layers[0].attn.qkv.invariant


@pytest.mark.slow
def test_a_draft_model_packs_its_own_weights_as_the_target_does() -> None:
    core = EngineCore(EngineConfig(platform="cpu", model="random:tiny", max_model_len=128, speculator="draft_model",
                                   num_speculative_tokens=2))
    assert core.speculator is not None and core.speculator.model.packed_head is not None  # type: ignore[attr-defined]


def test_a_stage_without_the_head_packs_its_layers_only() -> None:
    """A pipeline stage before the last never runs the LM head: its weight stays unpacked (on a
    tied model it is the whole embedding) and out of the bytes weighed against free memory."""
    from speckernel.models.checkpoint import resolve
    from speckernel.models.loader import load_model

    model = load_model(resolve("random:tiny"), torch.float32, torch.device("cpu"), 64)
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    assert not any(w is head for w in model.linear_weights(head=False))
    assert any(w is head for w in model.linear_weights())
    model.use_packed_weights(head=False)
    assert model.packed_head is None and model.layers[0].attn.o.packed is not None
