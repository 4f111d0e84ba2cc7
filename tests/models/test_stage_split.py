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
from speckernel.ops.small_batch import MAX_ROWS
from tests.platforms.test_platform_contract import BLOCK, CPU, TINY

SMALL = [(0, 5, [3, 0]), (0, 2, [1])]
"""7 tokens: the small-batch path where Triton runs (here under its interpreter), else plain."""
LARGE = [(0, 12, [3, 0, 5]), (0, 8, [1, 4])]
"""20 tokens, past small_batch.MAX_ROWS: the fused path, which carries h and residual apart."""
assert sum(n for _, n, _ in LARGE) > MAX_ROWS


def cache() -> torch.Tensor:
    return new_kv_cache(TINY, 8, BLOCK, torch.float32, CPU)


def split_forward(model: LlamaModel, ids: torch.Tensor, chunks: list, cut: int,
                  fused_after: bool) -> tuple[torch.Tensor, dict]:
    """Layers [0, cut) then [cut, L) on two caches, the stream handed over as a stage hands it."""
    meta = TorchPagedAttention(BLOCK, 8, CPU).prepare(chunks)
    caches = cache()
    h, residual, first = model.forward_layers(model.embed(ids), caches[:cut], meta, 0, (1, 2))
    sent = torch.zeros_like(h) if residual is None else residual
    model.use_triton_ops(fused_after)
    carried = sent if model.splits_residual(h) else None
    x = h if carried is not None else h + sent
    h, residual, second = model.forward_layers(x, caches[cut:], meta, cut, (1, 2), carried)
    return model.final_norm(h, residual), first | second


@pytest.mark.parametrize("chunks", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("cut", [1, 2, 3])
@torch.inference_mode()
def test_a_split_target_computes_what_the_whole_one_does(chunks: list, fused: bool, cut: int) -> None:
    torch.manual_seed(0)
    model = LlamaModel(TINY, 64).eval().use_triton_ops(fused)
    ids = torch.randint(0, TINY.vocab_size, (sum(n for _, n, _ in chunks),))
    meta = TorchPagedAttention(BLOCK, 8, CPU).prepare(chunks)
    want, want_hidden = model.forward_with_hidden(ids, cache(), meta, (1, 2))
    got, hidden = split_forward(model, ids, chunks, cut, fused)
    assert torch.equal(got, want)
    assert hidden.keys() == want_hidden.keys() and all(torch.equal(hidden[i], want_hidden[i]) for i in hidden)


@torch.inference_mode()
def test_a_stage_on_the_other_path_reads_the_split_stream() -> None:
    torch.manual_seed(0)
    model = LlamaModel(TINY, 64).eval().use_triton_ops(True)
    ids = torch.randint(0, TINY.vocab_size, (20,))
    meta = TorchPagedAttention(BLOCK, 8, CPU).prepare(LARGE)
    want, _ = model.forward_with_hidden(ids, cache(), meta, ())
    got, _ = split_forward(model, ids, LARGE, 2, fused_after=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
