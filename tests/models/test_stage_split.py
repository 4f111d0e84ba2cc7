"""A target split at a stage boundary computes what the whole one does, bit for bit: the stream
crosses as `forward_layers` left it (h and residual apart on the fused path), and the next
stage goes on from there on the same kernels. Also across paths: a stage on a path that carries
one tensor reads a split stream as h + residual."""

from __future__ import annotations

import pytest
import torch

from speckernel.models.llama import LlamaModel
from speckernel.models.paged import new_kv_cache
from speckernel.ops.paged_attention import TorchPagedAttention
from tests.platforms.test_platform_contract import BLOCK, CHUNKS, CPU, TINY


def split_forward(model: LlamaModel, ids: torch.Tensor, cut: int, fused_after: bool) -> tuple[torch.Tensor, dict]:
    """Layers [0, cut) then [cut, L) on two caches, the stream handed over as a stage hands it."""
    meta = TorchPagedAttention(BLOCK, 8, CPU).prepare(CHUNKS)
    caches = new_kv_cache(TINY, 4, BLOCK, torch.float32, CPU)
    h, residual, first = model.forward_layers(model.embed(ids), caches[:cut], meta, 0, (1, 2))
    sent = torch.zeros_like(h) if residual is None else residual
    model.use_triton_ops(fused_after)
    carried = sent if model.splits_residual(h) else None
    x = h if carried is not None else h + sent
    h, residual, second = model.forward_layers(x, caches[cut:], meta, cut, (1, 2), carried)
    return model.final_norm(h, residual), first | second


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("cut", [1, 2, 3])
@torch.inference_mode()
def test_a_split_target_computes_what_the_whole_one_does(fused: bool, cut: int) -> None:
    torch.manual_seed(0)
    model = LlamaModel(TINY, 64).eval().use_triton_ops(fused)
    ids = torch.randint(0, TINY.vocab_size, (7,))
    meta = TorchPagedAttention(BLOCK, 8, CPU).prepare(CHUNKS)
    want, want_hidden = model.forward_with_hidden(ids, new_kv_cache(TINY, 4, BLOCK, torch.float32, CPU), meta, (1, 2))
    got, hidden = split_forward(model, ids, cut, fused)
    assert torch.equal(got, want)
    assert hidden.keys() == want_hidden.keys() and all(torch.equal(hidden[i], want_hidden[i]) for i in hidden)


@torch.inference_mode()
def test_a_stage_on_the_other_path_reads_the_split_stream() -> None:
    torch.manual_seed(0)
    model = LlamaModel(TINY, 64).eval().use_triton_ops(True)
    ids = torch.randint(0, TINY.vocab_size, (7,))
    meta = TorchPagedAttention(BLOCK, 8, CPU).prepare(CHUNKS)
    want, _ = model.forward_with_hidden(ids, new_kv_cache(TINY, 4, BLOCK, torch.float32, CPU), meta, ())
    got, _ = split_forward(model, ids, 2, fused_after=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
