"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2/3 shapes) over a paged KV cache.

Weights use fused projections (qkv, gate_up) so a layer is few kernels. Attention itself (the
cache write and the paged read) is the job of the backend that made the step's metadata
(`speckernel.ops.paged_attention`): the model does not know which one runs.

`LlamaModel.use_triton_ops(True)` switches the layers to fused kernels (`speckernel.ops.fused_ops`):
add+RMSNorm with the residual stream carried between layers (vLLM-style), q+k rope in one
launch, and silu*up. Off by default, so the CPU path is the plain torch code. Steps of at most
`small_batch.MAX_ROWS` tokens (decode, verification) then run each projection fused with its
neighbours instead (`speckernel.ops.small_batch`, `LlamaModel.use_small_batch_ops`): four launches
and attention per layer, the LM head one more.

`LlamaModel.use_batch_invariant_ops(True)` makes every matmul (the LM head too), norm and
activation batch-invariant (`speckernel.ops.invariant`): a token's results are bit for bit the
same whatever else is in the batch and however many query tokens its row has. The attention
backend is made invariant by the platform (`batch_invariant`), not here.

`LlamaModel.use_packed_weights(True)` runs every projection and the LM head on weights packed once
for oneDNN (`speckernel.ops.packed_linear`): the CPU platform's choice, where torch's BLAS call is
slow at decoding's few rows.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata
from ..model_config import ModelConfig
from ..ops import fused_ops, invariant, packed_linear, small_batch
from ..ops.rope import cos_sin_table


class RMSNorm(nn.Module):
    invariant = False
    """Batch-invariant norm (`LlamaModel.use_batch_invariant_ops`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return invariant.rms_norm(x, self.weight, self.eps)
        return cast(torch.Tensor, fused_ops.rms_norm_torch(x, self.weight, self.eps))  # no residual: one tensor


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) that can run batch-invariant, or on its weight packed
    for oneDNN."""

    invariant = False
    packed: torch.Tensor | None = None
    """The weight packed for oneDNN (`LlamaModel.use_packed_weights`), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = packed_linear.usable(self.packed, x)
        if self.invariant:
            return invariant.linear(x, self.weight, self.bias, packed)
        if packed is not None:
            return packed_linear.linear(x, packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.attention_bias)
        self.o = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, k, v = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd), v.view(t, self.nkv, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (fused_ops.rope if fused else fused_ops.rope_torch)(q, k, cos, sin)
        out = meta.backend.forward(q, k, v, kv, meta, self.scale)
        return self.o(out.reshape(t, self.nh * self.hd))


class MLP(nn.Module):
    invariant = False
    """Batch-invariant activation (`LlamaModel.use_batch_invariant_ops`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        act = invariant.silu_mul if self.invariant else fused_ops.silu_mul if fused else fused_ops.silu_mul_torch
        return self.down(act(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv, meta):  # type: ignore[no-untyped-def]
        x = x + self.attn(self.input_norm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_norm(x))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      kv: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over a carried residual: the residual stream before this layer is h + residual
        (h alone for the first layer), after it the returned h + residual. Each add rides in the
        next norm's kernel, so a layer is two fused add+norms instead of two adds and two norms."""
        if residual is None:
            residual, h = h, fused_ops.rms_norm(h, self.input_norm.weight, self.input_norm.eps)
        else:
            h, residual = fused_ops.rms_norm(h, self.input_norm.weight, self.input_norm.eps, residual)
        h = self.attn(h, cos, sin, kv, meta, fused=True)
        h, residual = fused_ops.rms_norm(h, self.post_norm.weight, self.post_norm.eps, residual)
        return self.mlp(h, fused=True), residual

    def forward_small(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer on `small_batch`'s kernels: x [T <= MAX_ROWS, H] is the residual stream, and so
        is the result. norm + QKV + rope + the K/V cache write, attention, o + residual, norm +
        gate_up + SwiGLU, down + residual. cos/sin are the whole rotary tables, indexed by positions."""
        attn, t = self.attn, x.shape[0]
        qk_norm = None
        if attn.q_norm is not None and attn.k_norm is not None:
            qk_norm = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        q, k, v = small_batch.norm_qkv_rope(x, self.input_norm.weight, self.input_norm.eps, attn.qkv.weight,
                                            attn.qkv.bias, positions, cos, sin, (attn.nh, attn.nkv, attn.hd),
                                            qk_norm=qk_norm, cache=(kv, meta.slot_mapping))
        out = meta.backend.forward(q, k, v, kv, meta, attn.scale, written=True)
        x = small_batch.linear_residual(out.reshape(t, attn.nh * attn.hd), attn.o.weight, x)
        h = small_batch.norm_gate_up(x, self.post_norm.weight, self.post_norm.eps, self.mlp.gate_up.weight)
        return small_batch.linear_residual(h, self.mlp.down.weight, x)


class LlamaModel(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor
    """Rotary tables [max_len, head_dim], float32 whatever the weights' dtype (buffers)."""
    layers: nn.ModuleList

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = cos_sin_table(cfg, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.triton_ops = False
        self.small_batch = True
        """With triton_ops: steps of at most small_batch.MAX_ROWS tokens take the small-batch kernels."""
        self.batch_invariant = False
        self.packed_head: torch.Tensor | None = None
        """The LM head's weight packed for oneDNN (`use_packed_weights`), or None."""

    def use_triton_ops(self, enabled: bool = True) -> LlamaModel:
        """Run the layers on the fused kernels of `speckernel.ops.fused_ops` (Triton on CUDA, their
        torch paths elsewhere). Same outputs to rounding; off by default."""
        self.triton_ops = enabled
        return self

    def use_small_batch_ops(self, enabled: bool = True) -> LlamaModel:
        """With the fused kernels on, run steps of at most `small_batch.MAX_ROWS` tokens (and LM heads
        of that many rows) on `speckernel.ops.small_batch` (on by default; off: the fused path's
        library GEMMs, which benchmarks compare). The choice depends on the step's token count
        alone, so each captured graph shape holds one path."""
        self.small_batch = enabled
        return self

    def runs_small(self, x: torch.Tensor) -> bool:
        """Whether a step (or LM head input) x [T, H] runs on the small-batch kernels. Not in the
        batch-invariant mode: there a token's results may not depend on the step's size."""
        return self.triton_ops and self.small_batch and not self.batch_invariant and small_batch.runs_on(x)

    def splits_residual(self, x: torch.Tensor) -> bool:
        """Whether `forward_layers` carries a step x [T, H] as (h, residual), the fused path."""
        return self.triton_ops and not self.runs_small(x)

    def use_batch_invariant_ops(self, enabled: bool = True) -> LlamaModel:
        """Run every linear (the LM head too), norm and activation batch-invariant
        (`speckernel.ops.invariant`); off by default. The fused path's add+norm, rope and
        silu*up kernels are one program per row already, so they stay."""
        self.batch_invariant = enabled
        for module in self.modules():
            if isinstance(module, Linear | RMSNorm | MLP):
                module.invariant = enabled
        return self

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight: the embedding's where the two are tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def _projections(self) -> list[Linear]:
        """Every layer's projections (the LM head runs apart, in `logits`)."""
        return [m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]

    def linear_weights(self, head: bool = True) -> list[torch.Tensor]:
        """The weights of every projection, and of the LM head with `head`: what `use_packed_weights`
        packs."""
        return [m.weight for m in self._projections()] + ([self.head_weight] if head else [])

    def use_packed_weights(self, enabled: bool = True, head: bool = True) -> LlamaModel:
        """Run the projections and the LM head on weights packed once for oneDNN
        (`speckernel.ops.packed_linear`, the CPU platform's choice); off: torch's linear. In the
        batch-invariant mode each row is its own call on them. head=False leaves the LM head on
        torch's path (a pipeline stage before the last never runs it). Weights changed later are
        not seen: pack after loading."""
        for module in self._projections():
            module.packed = packed_linear.pack(module.weight) if enabled else None
        self.packed_head = packed_linear.pack(self.head_weight) if enabled and head else None
        return self

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final-norm hidden states [T, H]; kv_cache is [layers, 2, slots, kv_heads, head_dim]."""
        return self.forward_with_hidden(input_ids, kv_cache, meta, ())[0]

    def forward_with_hidden(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The final-norm hidden states [T, H] and, for each index in `layers`, the residual stream
        [T, H] right after that layer (before the final norm). Only those layers are kept, so a
        speculator that reads two layers costs two tensors, not one per layer."""
        bad = [i for i in layers if not 0 <= i < len(self.layers)]
        if bad:
            raise IndexError(f"layers {bad} out of range: the model has {len(self.layers)}")
        h, residual, captured = self.forward_layers(self.embed(input_ids), kv_cache, meta, 0, layers)
        return self.final_norm(h, residual), captured

    def forward_layers(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, start: int,
                       layers: tuple[int, ...], residual: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
        """The residual stream through layers [start, start + len(kv_cache)) (kv_cache holds those
        layers' caches), with the stream after each of `layers` that falls in it. Returns
        (h, residual, captured): the stream is h + residual on the fused path, which carries the
        two apart (a pipeline stage hands both on, so a split model rounds as the whole one
        does), h alone where residual is None. The path depends on the step's token count only,
        so every stage of a step takes the one the whole model would."""
        captured: dict[int, torch.Tensor] = {}
        count = kv_cache.shape[0]
        if count and self.runs_small(x):
            for j in range(count):
                layer = self.layers[start + j]
                assert isinstance(layer, DecoderLayer)
                x = layer.forward_small(x, meta.positions, self.cos, self.sin, kv_cache[j], meta)
                if start + j in layers:
                    captured[start + j] = x
            return x, None, captured
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]
        if count and self.splits_residual(x):
            h = x
            for j in range(count):
                layer = self.layers[start + j]
                assert isinstance(layer, DecoderLayer)
                h, residual = layer.forward_fused(h, residual, cos, sin, kv_cache[j], meta)
                if start + j in layers:
                    captured[start + j] = residual + h  # the stream after the layer, as x + mlp(...) below
            return h, residual, captured
        for j in range(count):
            x = self.layers[start + j](x, cos, sin, kv_cache[j], meta)
            if start + j in layers:
                captured[start + j] = x
        return x, None, captured

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final norm of the stream `forward_layers` left, on the kernels of its path."""
        if residual is not None:
            return fused_ops.rms_norm(h, self.norm.weight, self.norm.eps, residual)[0]
        if self.runs_small(h):
            return fused_ops.rms_norm(h, self.norm.weight, self.norm.eps)
        return self.norm(h)

    def keep_layers(self, start: int, end: int, embed: bool) -> LlamaModel:
        """Frees the weights a pipeline stage does not run: layers outside [start, end), and the
        embedding unless `embed` (the first stage embeds, the last one's head may be tied to it)."""
        for i in range(len(self.layers)):
            if not start <= i < end:
                self.layers[i] = nn.Identity()
        if not embed:
            self.embed = nn.Embedding(1, self.cfg.hidden_size, device=self.embed.weight.device,
                                      dtype=self.embed.weight.dtype)
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-norm hidden states [..., H] (the head's output rounded to the
        weights' dtype first)."""
        weight = self.head_weight
        packed = packed_linear.usable(self.packed_head, hidden)
        if self.batch_invariant:
            return invariant.linear(hidden, weight, packed=packed).float()
        rows = hidden.reshape(-1, hidden.shape[-1])
        if self.runs_small(rows):
            return small_batch.linear(rows, weight, torch.float32).view(*hidden.shape[:-1], weight.shape[0])
        if packed is not None:
            return packed_linear.linear(hidden, packed).float()
        return F.linear(hidden, weight).float()
