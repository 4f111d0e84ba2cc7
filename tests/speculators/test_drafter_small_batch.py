"""A learned drafter's decoder block on the target's small-batch kernels (Triton; the interpreter
on the CPU): a drafting step of a few tokens runs norm + QKV + rope, o + residual, norm + gate_up
+ SwiGLU and down + residual as four launches, and gives the torch block's output (float32)."""

from __future__ import annotations

import pytest
import torch

from speckernel.speculators.learned import DecoderBlock, DrafterConfig, TargetShape, use_fused_kernels

pytest.importorskip("triton")

SHAPE = TargetShape(vocab_size=64, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12)
CFG = DrafterConfig(method="dflash", target=SHAPE, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2,
                    head_dim=12)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the block's tokens ([B, T, heads, D]), kv heads shared."""
    k, v = (t.repeat_interleave(q.shape[-2] // t.shape[-2], dim=-2) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_the_small_batch_block_equals_the_torch_block(tokens: int) -> None:
    torch.manual_seed(0)
    block = DecoderBlock(CFG).eval()
    for p in block.parameters():  # weights of a trained drafter's scale, norms away from one
        torch.nn.init.normal_(p, std=0.2 if p.dim() > 1 else 1.0)
    x = torch.randn(1, tokens, CFG.hidden_size)
    angles = torch.rand(1, tokens, CFG.head_dim // 2) * 3.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    with torch.no_grad():
        want = block(x, cos, sin, attend)
        use_fused_kernels(block)
        assert block._small(x), "the block should take the small-batch kernels here"
        launched: list[str] = []
        forward = block._forward_small
        block._forward_small = lambda *a: launched.append("small") or forward(*a)  # type: ignore[method-assign]
        got = block(x, cos, sin, attend)
    assert launched == ["small"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
