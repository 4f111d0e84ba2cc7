"""The small-batch kernels (`speckernel.ops.small_batch`) against the torch ops they fuse, and the
model on them against the fused and the plain torch paths.

Without a GPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes stay
small and odd (K and N not multiples of the tiles, half a head of 8 or 18 rows): the point is the
indexing and the epilogues, which the interpreter runs as the GPU would. float32 is compared
tightly; bfloat16 to rounding (the kernels round x * norm_weight where torch rounds x * rstd, and
the interpreter truncates to bf16 where the GPU rounds to nearest).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.nn.functional as F

from speckernel.model_config import ModelConfig
from speckernel.models.llama import LlamaModel
from speckernel.models.paged import new_kv_cache
from speckernel.ops import fused_ops, small_batch
from speckernel.ops.jit_watch import JitWatch
from speckernel.ops.paged_attention import TorchPagedAttention, TritonPagedAttention
from speckernel.ops.small_batch import Tile

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
TOL: dict[torch.dtype, dict[str, float]] = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                                            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
ROWS = (1, 3, 16)
SMALL_TILE = Tile(16, 16, 2, 1)
"""Many K steps, K and N tails masked: the indexing the table's tiles may skip at these shapes."""
WIDE_TILE = Tile(32, 128, 4, 2)
"""One K step longer than K (masked), wider column blocks."""


def tiles_tried(m: int, dtype: torch.dtype) -> list[Tile | None]:
    """The table's tile (None) always; the others once per kernel (float32, 3 rows)."""
    return [None, SMALL_TILE, WIDE_TILE] if dtype == torch.float32 and m == 3 else [None]


def rand(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (shift + scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, exact: torch.Tensor | None = None) -> None:
    """float32: tight. Half precision, to rounding: no further from `exact` (the definition run in
    float32 on the same inputs) than twice the torch path's own error, plus one ulp of the scale.
    The interpreter truncates where the GPU rounds to nearest, each rounding erring up to twice as
    far, always toward zero: the bound doubles there."""
    assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    if dtype == torch.float32 or exact is None:
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])  # type: ignore[arg-type]
        return
    err, torch_err = ((t.float() - exact).abs().max().item() for t in (got, want))
    assert err <= (2 if ON_GPU else 4) * torch_err + 2**-8 * exact.abs().max().item(), (err, torch_err)


# ---- the definitions: the model's unfused torch ops -----------------------------------------


def qkv_reference(x: torch.Tensor, g: torch.Tensor, eps: float, w: torch.Tensor, b: torch.Tensor | None,
                  pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int, int],
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None) -> tuple[torch.Tensor, ...]:
    nh, nkv, hd = heads
    qkv = F.linear(fused_ops.rms_norm_torch(x, g, eps), w, b)
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    q, k, v = q.reshape(-1, nh, hd), k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    if qk_norm is not None:
        q, k = fused_ops.rms_norm_torch(q, qk_norm[0], qk_norm[2]), fused_ops.rms_norm_torch(k, qk_norm[1], qk_norm[2])
    q, k = fused_ops.rope_torch(q, k, cos[pos], sin[pos])
    return q, k, v


# ---- each kernel ------------------------------------------------------------------------------

QKV_CASES = {
    # name: (K, (q heads, kv heads, head_dim), bias, qk norm). Half a head of 8 rows pads the
    # 16-row dot; 18 rows make two programs per head, the second masked past row 18.
    "half_head_of_8_bias": (72, (3, 1, 16), True, False),
    "half_head_of_18": (100, (2, 1, 36), False, False),
    "qk_norm_bias": (45, (4, 2, 16), True, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(QKV_CASES))
def test_norm_qkv_rope_matches_torch(name: str, m: int, dtype: torch.dtype) -> None:
    k_dim, heads, has_bias, has_qk_norm = QKV_CASES[name]
    nh, nkv, hd = heads
    n = (nh + 2 * nkv) * hd
    gen = torch.Generator().manual_seed(m)
    x = rand(m, k_dim, gen=gen, dtype=dtype, scale=3.0)  # rms 3: a skipped norm shows
    g = rand(k_dim, gen=gen, dtype=dtype, scale=0.5, shift=1.0)
    w = rand(n, k_dim, gen=gen, dtype=dtype, scale=k_dim**-0.5)
    b = rand(n, gen=gen, dtype=dtype, scale=0.5) if has_bias else None
    qk = (rand(hd, gen=gen, dtype=dtype, scale=0.5, shift=1.0), rand(hd, gen=gen, dtype=dtype, scale=0.5, shift=1.0),
          1e-6) if has_qk_norm else None
    max_len = 40
    cos, sin = rand(max_len, hd, gen=gen, dtype=torch.float32), rand(max_len, hd, gen=gen, dtype=torch.float32)
    pos = torch.randint(0, max_len, (m,), generator=gen).to(DEVICE)
    slots = 20
    kv = torch.full((2, slots, nkv, hd), 7.0, dtype=dtype, device=DEVICE)
    slot_mapping = torch.randperm(slots, generator=gen)[:m].to(DEVICE)
    if m > 1:
        slot_mapping[1] = -1  # a padding token: writes nothing
    want = qkv_reference(x, g, 1e-5, w, b, pos, cos, sin, heads, qk)
    exact = qkv_reference(*(t.float() if isinstance(t, torch.Tensor) else t for t in (x, g, 1e-5, w, b)),
                          pos, cos, sin, heads, None if qk is None else (qk[0].float(), qk[1].float(), qk[2]))
    for tile in tiles_tried(m, dtype):
        cache = kv.clone()
        got = small_batch.norm_qkv_rope(x, g, 1e-5, w, b, pos, cos, sin, heads, qk_norm=qk,
                                        cache=(cache, slot_mapping), tile=tile)
        for got_t, want_t, exact_t in zip(got, want, exact, strict=True):
            close(got_t, want_t, dtype, exact_t)
        live = slot_mapping >= 0
        assert torch.equal(cache[0, slot_mapping[live]], got[1][live]), "k into the cache as returned"
        assert torch.equal(cache[1, slot_mapping[live]], got[2][live]), "v into the cache as returned"
        untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
        untouched[slot_mapping[live]] = False
        assert (cache[:, untouched] == 7.0).all(), "no other slot written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_linear_residual_matches_torch(m: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10 + m)
    k_dim, n = 45, 77
    x = rand(m, k_dim, gen=gen, dtype=dtype)
    w = rand(n, k_dim, gen=gen, dtype=dtype, scale=k_dim**-0.5)
    residual = rand(m, n, gen=gen, dtype=dtype, scale=2.0)
    want = residual + F.linear(x, w)
    exact = residual.float() + F.linear(x.float(), w.float())
    for tile in tiles_tried(m, dtype):
        close(small_batch.linear_residual(x, w, residual, tile=tile), want, dtype, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_norm_gate_up_matches_torch(m: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(20 + m)
    k_dim, inter = 72, 75
    x = rand(m, k_dim, gen=gen, dtype=dtype, scale=3.0)
    g = rand(k_dim, gen=gen, dtype=dtype, scale=0.5, shift=1.0)
    w = rand(2 * inter, k_dim, gen=gen, dtype=dtype, scale=2 * k_dim**-0.5)
    want = fused_ops.silu_mul_torch(F.linear(fused_ops.rms_norm_torch(x, g, 1e-5), w))
    exact = fused_ops.silu_mul_torch(F.linear(fused_ops.rms_norm_torch(x.float(), g.float(), 1e-5), w.float()))
    for tile in tiles_tried(m, dtype):
        got = small_batch.norm_gate_up(x, g, 1e-5, w, tile=tile)
        assert got.shape == (m, inter)
        close(got, want, dtype, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
def test_linear_matches_the_models_logits(m: int, dtype: torch.dtype) -> None:
    """float32 logits of the head rounded to the weights' dtype, as F.linear(...).float() is."""
    gen = torch.Generator().manual_seed(30 + m)
    k_dim, n = 72, 100
    x = rand(m, k_dim, gen=gen, dtype=dtype)
    w = rand(n, k_dim, gen=gen, dtype=dtype, scale=k_dim**-0.5)
    want = F.linear(x, w).float()
    for tile in tiles_tried(m, dtype):
        got = small_batch.linear(x, w, torch.float32, tile=tile)
        close(got, want, dtype, F.linear(x.float(), w.float()))
        if dtype == torch.bfloat16:
            assert torch.equal(got, got.to(dtype).float()), "values of the weights' dtype"


def test_every_table_tile_launches() -> None:
    """Each configured tile runs (its block sizes are legal for its kernel) and gives the result."""
    gen = torch.Generator().manual_seed(3)
    x = rand(2, 40, gen=gen, dtype=torch.float32)
    g = rand(40, gen=gen, dtype=torch.float32, shift=1.0)
    for kind, _, _, tile in small_batch.TILES:
        if kind == "rope":
            heads = (2, 1, 32)
            w = rand(4 * 32, 40, gen=gen, dtype=torch.float32)
            cos, sin = rand(8, 32, gen=gen, dtype=torch.float32), rand(8, 32, gen=gen, dtype=torch.float32)
            pos = torch.tensor([3, 5], device=DEVICE)
            got = small_batch.norm_qkv_rope(x, g, 1e-5, w, None, pos, cos, sin, heads, tile=tile)
            for a, b in zip(got, qkv_reference(x, g, 1e-5, w, None, pos, cos, sin, heads, None), strict=True):
                close(a, b, torch.float32)
        elif kind == "silu":
            w = rand(2 * 24, 40, gen=gen, dtype=torch.float32)
            close(small_batch.norm_gate_up(x, g, 1e-5, w, tile=tile),
                  fused_ops.silu_mul_torch(F.linear(fused_ops.rms_norm_torch(x, g, 1e-5), w)), torch.float32)
        else:
            w = rand(70, 40, gen=gen, dtype=torch.float32)
            res = rand(2, 70, gen=gen, dtype=torch.float32)
            got = small_batch.linear_residual(x, w, res, tile=tile) if kind == "residual" else \
                small_batch.linear(x, w, tile=tile)
            close(got, F.linear(x, w) + (res if kind == "residual" else 0), torch.float32)


def test_row_count_builds_no_new_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """M is a runtime argument, never specialised: 1, 3 and 16 rows launch one variant (the
    constexprs and launch options recorded here; on a GPU also no build after the first)."""
    kernel = small_batch._kernels().fused_linear
    seen: set[tuple[Any, ...]] = set()
    run = kernel.run

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.add(tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("grid", "warmup"))))
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", recorded)
    runtime = getattr(importlib.import_module("triton").knobs, "runtime", None)
    before = getattr(runtime, "jit_post_compile_hook", None)
    gen = torch.Generator().manual_seed(4)
    w = rand(33, 48, gen=gen, dtype=torch.bfloat16)
    watch = JitWatch()
    try:
        for i, m in enumerate(ROWS):
            x = rand(m, 48, gen=gen, dtype=torch.bfloat16)
            small_batch.linear_residual(x, w, x.new_zeros(m, 33))
            if i == 0 and watch.install():
                watch.seal()
    finally:
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            runtime.jit_post_compile_hook = before
    assert len(seen) == 1
    assert watch.num_after_seal == 0


def test_runs_on_what_triton_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(16, 8, device=DEVICE)
    assert small_batch.runs_on(x) and not small_batch.runs_on(torch.zeros(17, 8, device=DEVICE))
    assert not small_batch.runs_on(torch.zeros(2, 8, dtype=torch.int64, device=DEVICE))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not small_batch.runs_on(torch.zeros(2, 8)), "a CPU tensor without the interpreter: the torch path"


# ---- what the GPU compiles ---------------------------------------------------------------------

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32,
                        num_kv_heads=8, head_dim=128)
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64)
HOPPER_SHARED_BYTES = 232448
"""The most shared memory one block of an H100 or H200 may take (227 KB)."""


def planned_launches(cfg: ModelConfig, dtype: torch.dtype, qk_norm: bool = False) -> dict[str, small_batch.Launch]:
    """The model's five launches at 16 rows, planned on meta tensors (no memory)."""
    def t(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt, device="meta")

    h, hd, nh, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    qkv = (nh + 2 * nkv) * hd
    return {
        "qkv": small_batch.plan("rope", t(16, h), t(qkv, h), t(16, qkv), None, norm=(t(h), 1e-5),
                                bias=t(qkv) if qk_norm else None, heads=(nh, nkv, hd),
                                rope=(t(16, dt=torch.int64), t(4096, hd, dt=torch.float32),
                                      t(4096, hd, dt=torch.float32)),
                                qk_norm=(t(hd), t(hd), 1e-6) if qk_norm else None,
                                cache=(t(2, 4096, nkv, hd), t(16, dt=torch.int64))),
        "o": small_batch.plan("residual", t(16, nh * hd), t(h, nh * hd), t(16, h), None, residual=t(16, h)),
        "gate_up": small_batch.plan("silu", t(16, h), t(2 * inter, h), t(16, inter), None, norm=(t(h), 1e-5)),
        "down": small_batch.plan("residual", t(16, inter), t(h, inter), t(16, h), None, residual=t(16, h)),
        "head": small_batch.plan("plain", t(16, h), t(cfg.vocab_size, h), t(16, cfg.vocab_size, dt=torch.float32),
                                 None),
    }


def compile_for_hopper(kernel: Any, launch: small_batch.Launch) -> Any:
    """Triton's whole GPU pipeline, ptxas included, for sm_90, specialised as the JIT specialises
    a launch: pointers and the integers that are multiples of 16 marked divisible by 16 (M never)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64"}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, launch.args, strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name] = types[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name != "M" and value and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {k: v for k, v in launch.meta.items() if k not in ("num_warps", "num_stages")}
    signature |= dict.fromkeys(constexprs, "constexpr")
    options = dict(num_warps=launch.meta["num_warps"], num_stages=launch.meta["num_stages"])
    import triton  # in hopper_builds' own process, without the interpreter

    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def hopper_builds() -> list[tuple[str, int, bool]]:
    """(what, shared bytes, weight loads pipelined) of each kernel of SmolLM2-135M's and Llama-3-8B's
    shapes, and of a q/k-norm head of 128 with bias, compiled for sm_90 as the table tiles them. Run
    in a process without the interpreter (Triton reads TRITON_INTERPRET once, at import)."""
    kernel = small_batch._kernels().fused_linear
    builds = []
    qwen_like = msgspec.structs.replace(LLAMA3_8B, num_heads=16)
    for cfg, qk_norm in [(SMOLLM2, False), (LLAMA3_8B, False), (qwen_like, True)]:
        for name, launch in planned_launches(cfg, torch.bfloat16, qk_norm).items():
            if not qk_norm or name == "qkv":
                compiled = compile_for_hopper(kernel, launch)
                where = f"{name} of hidden {cfg.hidden_size}{' with q/k norm' if qk_norm else ''}"
                builds.append((where, compiled.metadata.shared, "async_copy_global_to_local" in compiled.asm["ttgir"]))
    return builds


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests build the kernels for it")
def test_table_tiles_lower_for_hopper_within_its_shared_memory() -> None:
    """Without a GPU: each kernel of the two shapes, as the table tiles it, goes through Triton's
    sm_90 pipeline (ptxas included), streams its weight through pipelined asynchronous copies and
    fits an H200 block's shared memory: what the interpreter cannot check."""
    if "nvidia" not in getattr(importlib.import_module("triton.backends"), "backends", {}):
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from tests.ops.test_small_batch import hopper_builds; print(json.dumps(hopper_builds()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = json.loads(done.stdout.splitlines()[-1])
    assert len(builds) == 11
    for where, shared, pipelined in builds:
        assert shared <= HOPPER_SHARED_BYTES, (where, shared)
        assert pipelined, f"{where}: weight loads not pipelined"


# ---- the model on them ----------------------------------------------------------------------

TINY = ModelConfig(vocab_size=96, hidden_size=72, intermediate_size=100, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position=128)
QWEN_LIKE = msgspec.structs.replace(TINY, qk_norm=True, attention_bias=True, num_heads=6, num_kv_heads=2)


def random_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(cfg, cfg.max_position).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms too, so a dropped norm weight shows
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.15)
    model.cos, model.sin = model.cos.to(DEVICE), model.sin.to(DEVICE)
    return model.to(device=DEVICE, dtype=dtype).eval().requires_grad_(False)


def count_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = small_batch._launch
    monkeypatch.setattr(small_batch, "_launch", lambda kind, *a, **kw: (calls.append(kind), real(kind, *a, **kw))[1])
    return calls


MODES = {"torch": (False, False), "fused": (True, False), "small": (True, True)}
STEPS = [
    [(0, 14, [3, 0]), (0, 6, [1])],  # 20 tokens: a prefill on the fused path
    [(14, 1, [3, 0]), (6, 5, [1, 5])],  # decode + a 4-draft verification: 6 tokens
    [(15, 16, [3, 0, 4, 2])],  # 16 tokens: the largest small step
    [(31, 17, [3, 0, 4, 2, 6, 7])],  # 17: the fused path again
]


@pytest.mark.parametrize(("cfg", "dtype", "backend", "modes"), [
    (TINY, torch.float32, TritonPagedAttention, ("torch", "fused", "small")),
    (TINY, torch.float32, TorchPagedAttention, ("torch", "small")),
    (QWEN_LIKE, torch.float32, TritonPagedAttention, ("torch", "small")),
    (TINY, torch.bfloat16, TritonPagedAttention, ("torch", "small"))],
    ids=["triton-attention", "torch-attention", "qk-norm-bias", "bf16"])
@torch.inference_mode()
def test_model_on_small_batch_kernels_matches_fused_and_torch_paths(
        cfg: ModelConfig, dtype: torch.dtype, backend: type, modes: tuple[str, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four steps around the 16-token boundary, each mode on its own cache: the final hidden
    states, the captured residual streams (layers 0 and 2), the KV written and the logits agree;
    the layers run on the small-batch kernels exactly in the steps of at most 16 tokens (four
    launches a layer), the head of 3 rows always, and the cache they write equals the backend's."""
    calls = count_launches(monkeypatch)
    model = random_model(cfg, dtype)
    models = dict.fromkeys(modes, model)
    backends = dict.fromkeys(modes, backend)
    if dtype != torch.float32:  # the definition in float32 on the same weights: what rounding is measured against
        models["exact"] = random_model(cfg, dtype).float()
        backends["exact"] = TorchPagedAttention  # torch's ops throughout (the interpreter's would only cost)
    caches = {mode: new_kv_cache(cfg, 8, 8, m.embed.weight.dtype, DEVICE) for mode, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    for step in STEPS:
        t = sum(n for _, n, _ in step)
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=gen).to(DEVICE)
        out = {}
        for mode, m in models.items():
            fused, small = MODES.get(mode, (False, False))
            m.use_triton_ops(fused).use_small_batch_ops(small)
            meta = backends[mode](8, 32, DEVICE).prepare(step)
            before = len(calls)
            hidden, captured = m.forward_with_hidden(ids, caches[mode], meta, (0, 2))
            assert set(captured) == {0, 2}
            out[mode] = [hidden, captured[0], captured[2], m.logits(hidden[-3:]), caches[mode]]
            layer_kernels = ["rope", "residual", "silu", "residual"] * cfg.num_layers
            if mode == "small":  # the head of 3 rows runs on them whatever the step's size
                assert calls[before:] == (layer_kernels if t <= small_batch.MAX_ROWS else []) + ["plain"]
            else:
                assert calls[before:] == []
        for mode in modes[1:]:
            for got, want, exact in zip(out[mode], out["torch"], out.get("exact", out["torch"]), strict=True):
                if dtype == torch.float32:  # layers deep: a few float32 roundings more than one op
                    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)
                else:
                    close(got, want, dtype, exact.float())
    assert (caches["small"] != 0).any(dim=-1).sum() == (caches["torch"] != 0).any(dim=-1).sum(), "the same slots"


@torch.inference_mode()
def test_small_batch_is_off_where_it_must_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-invariant (a token's results may not depend on the step's size), switched off, or on
    the CPU without Triton's interpreter: the model runs the paths it ran before."""
    calls = count_launches(monkeypatch)
    model = random_model(TINY, torch.float32)
    kv = new_kv_cache(TINY, 2, 8, torch.float32, DEVICE)
    ids = torch.tensor([1, 2, 3], device=DEVICE)

    def run() -> None:
        meta = TorchPagedAttention(8, 8, DEVICE).prepare([(0, 3, [0])])
        model.logits(model(ids, kv, meta))

    model.use_triton_ops(True)
    run()
    assert len(calls) == 4 * TINY.num_layers + 1
    for switch in (lambda: model.use_batch_invariant_ops(True), lambda: model.use_small_batch_ops(False)):
        calls.clear()
        model.use_batch_invariant_ops(False).use_small_batch_ops(True)
        switch()
        run()
        assert calls == []
    model.use_batch_invariant_ops(False).use_small_batch_ops(True)
    calls.clear()
    if not ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET")
        run()
        assert calls == []


def test_engine_config_switches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from speckernel.config import EngineConfig
    from speckernel.engine.core import EngineCore

    for enabled in (True, False):
        core = EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=64,
                                       max_num_seqs=2, num_kv_blocks=8, small_batch_kernels=enabled))
        assert core.runner.model.small_batch is enabled  # type: ignore[union-attr]


# ---- the real model ---------------------------------------------------------------------------


@pytest.mark.slow
@torch.inference_mode()
def test_real_model_greedy_tokens_equal_without_small_batch(model_path: Any, tokenizer: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M's weights, three prompts decoded together, greedy: the same tokens (and logits
    to float32 rounding) with the small-batch kernels as with the torch path. On a GPU the whole
    model decodes 8 tokens; in the interpreter (about a second for the LM head alone per step) its
    first 3 layers decode 4, with the tiles that make the fewest programs (INTERPRETER_TILES)."""
    from speckernel.models.loader import load_model

    model = load_model(model_path, torch.float32, DEVICE, 256)
    layers, new_tokens = (model.cfg.num_layers, 8) if ON_GPU else (3, 4)
    model.layers = model.layers[:layers]
    cfg = msgspec.structs.replace(model.cfg, num_layers=layers)
    calls = count_launches(monkeypatch)
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "The sun rises in the")]
    assert sum(map(len, prompts)) <= small_batch.MAX_ROWS
    tokens = {}
    for small in (False, True):
        model.use_triton_ops(small)
        kv = new_kv_cache(cfg, len(prompts) * 2, 16, torch.float32, DEVICE)
        backend = TorchPagedAttention(16, 32, DEVICE)
        seqs = [list(p) for p in prompts]
        step = [(0, len(p), [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
        ids = [t for p in prompts for t in p]
        logits_seen = []
        for _ in range(new_tokens):
            meta = backend.prepare(step)
            hidden = model(torch.tensor(ids, device=DEVICE), kv, meta)
            logits = model.logits(hidden[meta.query_start[1:] - 1])
            logits_seen.append(logits)
            ids = logits.argmax(-1).tolist()
            for seq, t in zip(seqs, ids, strict=True):
                seq.append(t)
            step = [(len(seq) - 1, 1, blocks) for seq, (_, _, blocks) in zip(seqs, step, strict=True)]
        tokens[small] = (seqs, logits_seen)
    assert calls, "the small-batch kernels ran"
    assert tokens[True][0] == tokens[False][0]
    for got, want in zip(tokens[True][1], tokens[False][1], strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
