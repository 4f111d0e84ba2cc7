"""The Triton kernels (paged attention, KV write, fused norm/rope/silu) against plain torch.

Without a GPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes stay
tiny: the point is the indexing (block tables, GQA packing, causal offsets, padding rows), which
the interpreter checks exactly as the GPU would run it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speckernel.model_config import ModelConfig
from speckernel.models.llama import LlamaModel
from speckernel.models.paged import new_kv_cache
from speckernel.ops import fused_ops, triton_attention
from speckernel.ops.paged_attention import TorchPagedAttention
from speckernel.ops.rope import apply_rope, cos_sin_table
from speckernel.ops.triton_attention import paged_attention, write_kv

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
ON_GPU = DEVICE.type == "cuda"
"""Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even), so bf16
results are compared bit for bit on a GPU and within one bf16 ulp in the interpreter."""
BF16_ULP = dict(atol=0.0, rtol=2**-7)


def paged_attention_reference(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Per row: gather its context slots, SDPA with the causal offset, in float32."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for r in range(block_tables.shape[0]):
        lo, hi, ctx = int(query_start[r]), int(query_start[r + 1]), int(seq_lens[r])
        if hi == lo:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[r, pos // block_size] * block_size + pos % block_size
        k, v = kv[0, slots].float(), kv[1, slots].float()  # [ctx, KVH, D]
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        mask = pos[None, :] <= q_pos[:, None]
        attended = F.scaled_dot_product_attention(q[lo:hi].float().transpose(0, 1), k.transpose(0, 1),
                                                  v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = attended.transpose(0, 1)
    return out


def make_case(rows: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, pad_tokens: int = 0, seed: int = 0):  # type: ignore[no-untyped-def]
    """rows: (context length after the step, new queries). Blocks are handed out shuffled, so
    a row's table is not contiguous, and the table has spare columns and a padded row stride."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-ctx // block_size) for ctx, _ in rows) + 1
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in rows) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    wide = torch.full((len(rows), max_blocks + 3), -7, dtype=torch.int64)
    used = 0
    for r, (ctx, _) in enumerate(rows):
        n = -(-ctx // block_size)
        wide[r, :n] = perm[used:used + n]
        used += n
    block_tables = wide[:, :max_blocks]  # row stride max_blocks + 3
    kv = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    t = sum(n for _, n in rows)
    q = torch.randn(t + pad_tokens, heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([ctx for ctx, _ in rows], dtype=torch.int64)
    query_start = torch.tensor([0] + [n for _, n in rows], dtype=torch.int64).cumsum(0)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return to(q), to(kv), to(block_tables), to(seq_lens), to(query_start)


CASES = {
    # name: (rows (ctx, new queries), heads, kv_heads, head_dim, block_size, dtype)
    "decode": ([(1, 1), (15, 1), (16, 1), (17, 1), (40, 1), (129, 1), (300, 1)], 4, 2, 64, 16, torch.float32),
    "decode_bf16_bs32": ([(3, 1), (33, 1), (64, 1), (70, 1), (200, 1)], 4, 2, 64, 32, torch.bfloat16),
    "verify_gqa3": ([(20, 5), (37, 16), (16, 16), (150, 9)], 3, 1, 64, 16, torch.float32),
    # with splits of one 128-key tile (MIN_SPLIT_KEYS 1), the first queries see no key of the second split
    "verify_split_edge": ([(140, 16), (129, 16), (260, 4)], 2, 2, 64, 16, torch.float32),
    "prefill_chunk_after_start": ([(150, 70)], 2, 1, 64, 16, torch.float32),
    "mixed_with_padding_row": ([(33, 1), (10, 0), (48, 9), (5, 5)], 2, 2, 128, 16, torch.float32),
    "mixed_fp16_bs32": ([(70, 1), (66, 4), (90, 35)], 4, 1, 64, 32, torch.float16),
    "prefill_bf16_gqa4": ([(80, 80), (19, 3)], 8, 2, 64, 16, torch.bfloat16),
}


def _is_short(name: str) -> bool:
    rows, heads, kv_heads, *_ = CASES[name]
    return max(n for _, n in rows) * heads // kv_heads <= 64


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """torch.empty fills floating tensors with NaN, so a split partial that the combine reads but
    no program wrote (or an output the kernels skip) shows as NaN instead of leftover memory.
    Returns the list of those tensors, in the order they were made."""
    real = torch.empty
    made: list[torch.Tensor] = []

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = real(*args, **kwargs)
        if t.is_floating_point():
            made.append(t.fill_(float("nan")))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return made


def _check_paged_attention(case: tuple, splits: int | None, seed: int = 0) -> torch.Tensor:  # type: ignore[type-arg]
    rows, heads, kv_heads, head_dim, block_size, dtype = case
    q, kv, bt, seq_lens, qs = make_case(rows, heads, kv_heads, head_dim, block_size, dtype, pad_tokens=2, seed=seed)
    scale = head_dim**-0.5
    sentinel = 123.0
    out = torch.full_like(q, sentinel)
    max_q = max(n for _, n in rows)
    got = paged_attention(q, kv, bt, seq_lens, qs, max_q + 3, scale, block_size, out=out,  # grid larger than needed
                          num_kv_splits=splits)
    assert got is out and got.dtype == q.dtype
    want = paged_attention_reference(q, kv, bt, seq_lens, qs, scale, block_size)
    t = int(qs[-1])
    assert not got[:t].isnan().any()
    tol = TOL[dtype]
    torch.testing.assert_close(got[:t].float(), want[:t], atol=tol, rtol=tol)
    assert (got[t:] == sentinel).all(), "tokens past the last row are left untouched"
    return got


@pytest.mark.parametrize(("name", "splits", "min_keys"),
                         [(name, s, m) for name in CASES
                          for s, m in (((None, None), (2, None), (3, None), (2, 1), (3, 1)) if _is_short(name)
                                       else ((None, None),))])
@pytest.mark.usefixtures("poisoned_empty")
def test_paged_attention_matches_reference(name: str, splits: int | None, min_keys: int | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """splits: KV splits for short-query steps (None: the default, 1 off the GPU); long ones ignore it.
    min_keys: MIN_SPLIT_KEYS (None: the module's; 1 rounds up to one KV tile, so short contexts split too)."""
    if min_keys is not None:
        monkeypatch.setattr(triton_attention, "MIN_SPLIT_KEYS", min_keys)
    _check_paged_attention(CASES[name], splits)


SPLIT_CASES = {
    # Default MIN_SPLIT_KEYS (256) with BLOCK_N 128 (M <= 16) or 64 (M <= 64): every used split holds
    # >= 256 keys, so a row uses ceil(ctx / 256) splits when its share of the splits is smaller.
    # 700 keys: 3 used splits (256 + 256 + 188) of the 4 or 16 allowed; the rest return at once.
    "long_decode": ([(700, 1)], 2, 1, 64, 16, torch.float32),
    # <= 256 keys: one used split, which writes the output itself; the combine returns at once.
    "short_decode_many_splits": ([(200, 1), (1, 1), (256, 2)], 4, 2, 64, 16, torch.float32),
    # rows of 1, 1, 2, 3 used splits and a padding row (no queries); 257 puts one key in split 2
    "mixed_short_long_padding": ([(700, 1), (30, 1), (10, 0), (256, 1), (257, 1), (513, 1)], 4, 2, 64, 16,
                                 torch.bfloat16),
    # 16 queries at 244..259 straddle the split boundary at 256: the first 12 see no key of split 2
    "verify_across_splits": ([(260, 16), (600, 4), (40, 3)], 2, 2, 64, 16, torch.float32),
    # GQA 4 x 8 queries (M 32, BLOCK_N 64): 520 keys make 3 splits, the last holds only the queries' own keys
    "verify_gqa_across_splits": ([(520, 8), (300, 5), (12, 8)], 8, 2, 64, 32, torch.float32),
}


@pytest.mark.parametrize("splits", [4, 16])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
@pytest.mark.usefixtures("poisoned_empty")
def test_paged_attention_splits_use_only_filled_splits(name: str, splits: int) -> None:
    """Rows use only the splits their context fills at MIN_SPLIT_KEYS keys or more: a short row
    takes the single-split direct write, a long one merges exactly its used partials (any partial
    the combine reads unwritten is NaN here), padding rows and unused splits do nothing."""
    assert triton_attention.MIN_SPLIT_KEYS == 256, "the cases' comments count splits of 256 keys"
    _check_paged_attention(SPLIT_CASES[name], splits, seed=7)


def test_paged_attention_unused_splits_write_nothing(poisoned_empty: list[torch.Tensor]) -> None:
    """Which split programs write a partial: only the used ones of rows that need several (the
    partials' layout is [row, kv head, split, BLOCK_M] rows of (m, l)); a row in one split writes
    its output directly, a padding row nothing."""
    rows = [(700, 1), (200, 1), (0, 0), (1000, 1), (256, 1), (257, 1)]
    splits = 16
    q, kv, bt, seq_lens, qs = make_case(rows, 2, 1, 64, 16, torch.float32, seed=2)
    got = paged_attention(q, kv, bt, seq_lens, qs, 1, 64**-0.5, 16, out=torch.zeros_like(q), num_kv_splits=splits)
    want = paged_attention_reference(q, kv, bt, seq_lens, qs, 64**-0.5, 16)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    (part_ml,) = [t for t in poisoned_empty if t.dim() == 2 and t.shape[1] == 2]
    written = ~part_ml[:, 1].view(len(rows), 1, splits, -1).isnan()  # l of each (row, kv head, split, m)
    assert (written.all(-1) == written.any(-1)).all(), "a split writes all its M rows or none"
    used = written.all(-1)[:, 0].sum(1).tolist()
    # 256 keys or more per split: ceil(700 / 256) = 3, ceil(1000 / 256) = 4, ceil(257 / 256) = 2
    assert used == [3, 0, 0, 4, 0, 2]
    assert (written.all(-1)[:, 0].cpu() == (torch.arange(splits) < torch.tensor(used)[:, None])).all()


@pytest.mark.usefixtures("poisoned_empty")
def test_paged_attention_all_splits_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one tile per split (MIN_SPLIT_KEYS 1), 2048 keys fill all MAX_SPLITS splits, and
    300 keys three of them, next to a single-split row and a padding row in the same launch."""
    monkeypatch.setattr(triton_attention, "MIN_SPLIT_KEYS", 1)
    n = triton_attention.MAX_SPLITS
    rows = [(128 * n, 1), (300, 1), (0, 0), (100, 1)]
    _check_paged_attention((rows, 2, 1, 64, 16, torch.float32), n, seed=11)
    with pytest.raises(AssertionError, match="num_kv_splits"):
        _check_paged_attention((rows, 2, 1, 64, 16, torch.float32), n + 1)


def test_paged_attention_defaults_and_noncontiguous_q() -> None:
    """q as the model makes it: a strided view into a fused qkv projection; out allocated."""
    rows = [(18, 2), (33, 1)]
    q, kv, bt, seq_lens, qs = make_case(rows, 4, 2, 64, 16, torch.float32, seed=3)
    qkv = torch.cat([q.reshape(q.shape[0], -1), torch.randn(q.shape[0], 2 * 2 * 64, device=q.device)], dim=1)
    q_view = qkv[:, : 4 * 64].view(-1, 4, 64)
    assert not q_view.is_contiguous()
    got = paged_attention(q_view, kv, bt, seq_lens, qs, 2, 64**-0.5, 16)
    want = paged_attention_reference(q, kv, bt, seq_lens, qs, 64**-0.5, 16)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_paged_attention_after_write_kv_matches_torch_backend() -> None:
    """Two steps (prefill then decode + a 3-draft verify row) through write_kv + paged_attention
    against TorchPagedAttention, the engine's reference backend, on one shared cache layout."""
    bs, kvh, hd, heads = 16, 1, 64, 2
    gen = torch.Generator().manual_seed(5)
    tables = [[4, 1], [0, 3, 2]]
    steps = [[(0, 14, tables[0]), (0, 20, tables[1])], [(14, 1, tables[0]), (20, 4, tables[1])]]
    mine = torch.zeros(2, 5 * bs, kvh, hd, device=DEVICE)
    ref = mine.clone()
    for chunks in steps:
        t = sum(n for _, n, _ in chunks)
        q = torch.randn(t, heads, hd, generator=gen).to(DEVICE)
        k, v = torch.randn(2, t, kvh, hd, generator=gen).to(DEVICE)
        backend = TorchPagedAttention(bs, t, DEVICE)
        meta = backend.prepare(chunks)
        want = backend.forward(q, k, v, ref, meta, hd**-0.5)
        write_kv(k, v, mine, meta.slot_mapping)
        bt = torch.tensor([tb + [0] * (3 - len(tb)) for _, _, tb in chunks], device=DEVICE)
        seq_lens = torch.tensor([s + n for s, n, _ in chunks], device=DEVICE)
        qs = torch.tensor([0] + [n for _, n, _ in chunks], device=DEVICE).cumsum(0)
        got = paged_attention(q, mine, bt, seq_lens, qs, max(n for _, n, _ in chunks), hd**-0.5, bs)
        torch.testing.assert_close(mine, ref, atol=0, rtol=0)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_negative_slots(dtype: torch.dtype) -> None:
    t, kvh, hd, slots = 5, 3, 64, 12
    k, v = torch.randn(2, t, kvh, hd).to(dtype).to(DEVICE)
    kv = torch.full((2, slots, kvh, hd), -5.0, dtype=dtype, device=DEVICE)
    slot_mapping = torch.tensor([7, -1, 0, 11, -1], device=DEVICE)
    write_kv(k, v, kv, slot_mapping)
    want = torch.full_like(kv, -5.0)
    live = slot_mapping >= 0
    want[0, slot_mapping[live]] = k[live]
    want[1, slot_mapping[live]] = v[live]
    assert torch.equal(kv, want)


def test_write_kv_from_strided_views() -> None:
    """k and v as the model makes them: views into one fused qkv row."""
    t, kvh, hd = 4, 2, 64
    qkv = torch.randn(t, (2 + 2 * kvh) * hd, device=DEVICE)
    k = qkv[:, 2 * hd: (2 + kvh) * hd].view(t, kvh, hd)
    v = qkv[:, (2 + kvh) * hd:].view(t, kvh, hd)
    kv = torch.zeros(2, 8, kvh, hd, device=DEVICE)
    slot_mapping = torch.tensor([3, 1, 6, 0], device=DEVICE)
    write_kv(k, v, kv, slot_mapping)
    assert torch.equal(kv[0, slot_mapping], k) and torch.equal(kv[1, slot_mapping], v)


# ---- fused elementwise ops ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_torch(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, hidden, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(8, hidden, generator=gen).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)  # two roundings
    got = fused_ops.rms_norm_triton(x, w, 1e-5)
    want = fused_ops.rms_norm_torch(x, w, 1e-5)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **tol)  # type: ignore[arg-type]
    got_h, got_s = fused_ops.rms_norm_triton(x, w, 1e-5, residual=res)
    want_h, want_s = fused_ops.rms_norm_torch(x, w, 1e-5, residual=res)
    exact = dtype != torch.bfloat16 or ON_GPU  # the interpreter rounds fp16 as the GPU does, bf16 not
    if exact:
        assert torch.equal(got_s, want_s), "the residual sum is rounded to the input dtype exactly as torch does"
    else:
        torch.testing.assert_close(got_s, want_s, **BF16_ULP)  # type: ignore[arg-type]
    torch.testing.assert_close(got_h, want_h, **tol)  # type: ignore[arg-type]
    if dtype != torch.float32 and exact:  # to rounding: nearly always the same half-precision value
        assert (got_h != want_h).float().mean() < 0.02


def test_rms_norm_torch_is_the_models_norm() -> None:
    from speckernel.models.llama import RMSNorm

    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 32)
    assert torch.equal(fused_ops.rms_norm_torch(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_apply_rope(dtype: torch.dtype) -> None:
    cfg = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=3,
                      num_kv_heads=1, head_dim=64)
    cos, sin = cos_sin_table(cfg, 64)
    pos = torch.tensor([0, 5, 17, 63, 2, 40])
    cos, sin = cos[pos].to(DEVICE), sin[pos].to(DEVICE)
    qkv = torch.randn(6, 5 * 64).to(dtype).to(DEVICE)
    q, k = qkv[:, : 3 * 64].view(6, 3, 64), qkv[:, 3 * 64: 4 * 64].view(6, 1, 64)  # strided, as in the model
    got_q, got_k = fused_ops.rope_triton(q, k, cos, sin)
    want_q, want_k = fused_ops.rope_torch(q, k, cos, sin)
    assert torch.equal(want_q, apply_rope(q, cos, sin).to(dtype))
    assert got_q.dtype == got_k.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_q, want_q, **tol)  # type: ignore[arg-type]
    torch.testing.assert_close(got_k, want_k, **tol)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    x = (3 * torch.randn(4, 2 * 80)).to(dtype).to(DEVICE)
    got, want = fused_ops.silu_mul_triton(x), fused_ops.silu_mul_torch(x)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(want, F.silu(gate) * up)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)  # type: ignore[arg-type]


def test_fused_ops_dispatch_to_torch_off_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU tensor with no interpreter, the public ops are the torch paths."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 16)
    assert not fused_ops.use_triton(x) or x.is_cuda
    torch.testing.assert_close(fused_ops.silu_mul(torch.cat([x, x], 1)), fused_ops.silu_mul_torch(torch.cat([x, x], 1)))


# ---- the model with the fused ops ---------------------------------------------------------

TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position=64)


@torch.inference_mode()
def test_model_with_triton_ops_matches_default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for op in ("rms_norm_triton", "rope_triton", "silu_mul_triton"):
        real = getattr(fused_ops, op)
        monkeypatch.setattr(fused_ops, op, lambda *a, _real=real, _op=op, **kw: (calls.append(_op), _real(*a, **kw))[1])
    torch.manual_seed(0)
    model = LlamaModel(TINY, 64).eval().to(DEVICE)
    for p in model.parameters():  # norms too, so a dropped norm weight would show
        p.normal_(0, 0.2)
    chunks = [[(0, 9, [3, 0]), (0, 3, [1])], [(9, 1, [3, 0]), (3, 4, [1])]]  # prefill, then decode + verify
    caches = {flag: new_kv_cache(TINY, 4, 8, torch.float32, DEVICE) for flag in (False, True)}
    gen = torch.Generator().manual_seed(1)
    for step in chunks:
        ids = torch.randint(0, TINY.vocab_size, (sum(n for _, n, _ in step),), generator=gen).to(DEVICE)
        results = {}
        for flag in (False, True):
            # The fused path itself: steps this small take the small-batch kernels by default
            # (tests/ops/test_small_batch.py).
            model.use_triton_ops(flag).use_small_batch_ops(False)
            meta = TorchPagedAttention(8, 16, DEVICE).prepare(step)
            results[flag] = model.forward_with_hidden(ids, caches[flag], meta, (0, 2))
        (base, base_h), (fused, fused_h) = results[False], results[True]
        torch.testing.assert_close(fused, base, atol=1e-5, rtol=1e-5)
        assert set(fused_h) == {0, 2}
        for i in (0, 2):
            torch.testing.assert_close(fused_h[i], base_h[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[True], caches[False], atol=1e-5, rtol=1e-5)
    assert set(calls) == {"rms_norm_triton", "rope_triton", "silu_mul_triton"}, "the fused path ran the kernels"
    assert calls.count("rms_norm_triton") == 2 * (2 * TINY.num_layers + 1), "two steps, one launch per norm"
    model.use_triton_ops(False)
    assert not model.triton_ops
