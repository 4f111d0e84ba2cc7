"""What the learned drafters (mtp, eagle3, dflash, dspark, causal_cascade) share.

- A checkpoint is a folder: `config.json` (a `DrafterConfig`) and `model.safetensors` (bf16,
  tensor names of the public layouts). The shipped ones live in `weights/<method>/` and are
  found by name when the target has the shape they were trained for; `--draft-model FOLDER`
  loads any other.
- A checkpoint is checked before it is served: the shipped ones against the sha256 pinned here
  (`SHIPPED_SHA256`, whatever their config.json says), any other against the digest its
  config.json records (`save` writes it; one that records none loads with a warning naming
  the missing digest), each once in full and then by a size + mtime stamp, as the model's
  file is; `train-drafter --init` checks the file it starts from the same way. Then every
  tensor for its name, shape, dtype and finite values, and the module's own index tensors for
  their ranges (`DrafterModule.check_state`). A bad file fails the load with one line naming it.
- Their layers are small Llama decoder blocks (`DecoderBlock`) whose attention is a callable:
  the kernel's paged attention over the drafter's own KV at serving time, a dense mask in
  training. So one module serves both, and training computes what serving computes.
- `LearnedSpeculator` derives the kernel contract from the checkpoint: the target layers it
  reads, its draft-KV bytes per token, and its loading. It also has the training protocol
  (`speckernel.plugin.TrainableSpeculator`) that `speckernel train-drafter` drives, and each
  learned speculator declares `trainable=True` in its capabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from speckernel.kit import (
    RMSNorm,
    apply_rope,
    cache_stamp,
    cos_sin_table,
    fused_ops,
    logger,
    sha256_of,
    small_batch,
    verified,
)
from speckernel.plugin import (
    InvalidInputError,
    ModelConfig,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
    TrainableDrafter,
    TrainBatch,
)

WEIGHTS = Path(__file__).parent / "weights"
"""Shipped checkpoints, one folder per method."""

log = logger("learned")

SHIPPED_SHA256 = {
    "causal_cascade": "c91416ecc9f3a9a59f32d0538cda326712d0fdd2a0e8d61a42c5d581602b3749",
    "dflash": "b250a759eaa23ff084c168c92ba4c8c4ded8e1bcddb7ff1baeaa10123c6ecf62",
    "dspark": "0552985d4d320252b1bef467d4f642d8168003a8c765da4fd669577987f64093",
    "eagle3": "20f992bc7135dc38193d758ea6ead4a8248d1e73b039b404f043b16487b69655",
    "mtp": "9e1fc9a74fed95b2241427da9627b420ad7476952b507893c97f4efea9f41ba7",
}
"""sha256 of each shipped `weights/<method>/model.safetensors` (a retrained one updates its line)."""

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q [N, heads, D], k [N, kv_heads, D], v [N, kv_heads, D]), roped -> [N, heads, D]."""


class TargetShape(msgspec.Struct, frozen=True, kw_only=True):
    """The target a checkpoint was trained for: a drafter loads only on a target of this shape."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> TargetShape:
        return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


class DrafterConfig(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    target: TargetShape
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    target_layers: tuple[int, ...] = ()
    """Target layers whose output (residual stream) the drafter reads."""
    kv_layers: tuple[int, ...] = ()
    """Target layers whose KV rows the drafter reads (causal_cascade)."""
    block_size: int = 0
    """Block drafters: anchor plus block_size - 1 drafted positions."""
    draft_vocab_size: int = 0
    """eagle3: the draft vocabulary (0: the target's)."""
    rank: int = 0
    """dspark: rank of the Markov head."""
    num_steps: int = 1
    """Chained drafters: steps unrolled in training (training-time test)."""
    sha256: str = ""
    """Digest of model.safetensors, written by `save` and checked at load ("": not checked)."""


def read_config(folder: Path) -> DrafterConfig:
    try:
        return msgspec.json.decode((folder / "config.json").read_bytes(), type=DrafterConfig)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InvalidInputError(f"{folder / 'config.json'}: not a drafter config ({e})") from None


def save(folder: Path, cfg: DrafterConfig, module: nn.Module) -> None:
    """config.json plus bf16 model.safetensors (buffers that are not parameters included)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in module.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = msgspec.structs.replace(cfg, sha256=sha256_of(folder / "model.safetensors"))
    (folder / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg), indent=2) + b"\n")


def checkpoint(method: str, ctx: SpeculatorContext) -> tuple[Path, DrafterConfig]:
    """The drafter's folder (`--draft-model`, else the shipped one) and its config, checked
    against the target. `--draft-model` names a checkpoint, or a folder of them by method (what
    `train-drafter` writes for several methods), so one flag serves a whole set of drafters."""
    folder = Path(ctx.draft_model).expanduser() if ctx.draft_model else WEIGHTS / method
    if ctx.draft_model and not (folder / "config.json").is_file() and (folder / method / "config.json").is_file():
        folder = folder / method
    if not (folder / "config.json").is_file():
        if ctx.draft_model:
            raise InvalidInputError(f"{method}: {folder} holds no config.json, nor a {method}/ folder with one; "
                                    "pass a folder written by `speckernel train-drafter`")
        raise InvalidInputError(f"{method}: no shipped drafter; train one with `speckernel train-drafter "
                                f"--method {method}` and pass its folder with --draft-model")
    return folder, read_checked(folder, method, ctx.target, "this" if ctx.draft_model else "the shipped")


def read_checked(folder: Path, method: str, target: ModelConfig, source: str = "this") -> DrafterConfig:
    """A checkpoint's config, refused when it is another method's or was trained for another
    target shape (what serving and `train-drafter --init` both load)."""
    cfg = read_config(folder)
    if cfg.method != method:
        raise InvalidInputError(f"{folder} holds a {cfg.method} drafter, not {method}")
    want = TargetShape.of(target)
    if cfg.target != want:
        raise InvalidInputError(
            f"{method}: {source} drafter was trained for a target with {msgspec.to_builtins(cfg.target)}, "
            f"not {msgspec.to_builtins(want)}; train one for this target with `speckernel train-drafter`")
    return cfg


ModuleT = TypeVar("ModuleT", bound=nn.Module)
OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


def load_weights(module: ModuleT, folder: Path, device: torch.device, dtype: torch.dtype,
                 sha256: str = "") -> ModuleT:
    """The checkpoint's tensors in `module`, once `check_weights` found nothing wrong."""
    module.load_state_dict(check_weights(module, folder, sha256), strict=True)
    floats = {k for k, v in module.state_dict().items() if v.is_floating_point()}
    module.to(device)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if name in floats or t.is_floating_point():
            t.data = t.data.to(dtype)
    return module.eval().requires_grad_(False)


def is_shipped(folder: Path) -> bool:
    """Whether folder is one of the shipped checkpoints (however it is named: a link, a relative path)."""
    return folder.resolve() == (WEIGHTS / folder.name).resolve()


def expected_sha256(folder: Path, method: str, cfg: DrafterConfig) -> str:
    """The digest folder's model.safetensors must have: the pinned one for a shipped checkpoint
    (a config.json without its digest does not turn the check off), else the one its
    config.json records. None recorded: "" (not checked), with a warning naming what is missing,
    since damaged weights then load without a word and only drafting worse shows it."""
    if is_shipped(folder) and method in SHIPPED_SHA256:
        return SHIPPED_SHA256[method]
    if not cfg.sha256:
        log.warning("drafter_weights_unverified", path=str(folder / "model.safetensors"),
                    reason="config.json records no sha256 digest, so damaged weights would load unnoticed",
                    fix="write it again with `speckernel train-drafter` (which records the digest)")
    return cfg.sha256


def check_digest(path: Path, sha256: str) -> None:
    """Refuses (one line naming the file) a model.safetensors without the digest `sha256`
    ("": nothing to check); a shipped file's stamp goes to the cache, never into the package."""
    shipped = is_shipped(path.parent)
    if sha256 and not verified(path, sha256, cache_stamp(path) if shipped else None):
        fix = "reinstall speckernel" if shipped else "copy or train it again"
        raise InvalidInputError(f"{path}: corrupt, its sha256 is not the {'shipped' if shipped else 'recorded'} "
                                f"one ({sha256[:12]}...); {fix}")


def check_weights(module: nn.Module, folder: Path, sha256: str = "") -> dict[str, torch.Tensor]:
    """The tensors of folder's model.safetensors, refused (InvalidInputError, one line naming
    the file) when the file does not have the digest `sha256` (when given), does not parse, or a
    tensor is missing, extra, of another shape or kind of dtype than `module` holds, not finite,
    or out of the range its module allows (`DrafterModule.check_state`)."""
    path = folder / "model.safetensors"
    try:
        check_digest(path, sha256)
        state = load_file(str(path), device="cpu")
    except InvalidInputError:
        raise
    except Exception as e:  # a damaged header, a truncated file, an unreadable one
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InvalidInputError(f"{path}: not a readable safetensors file ({reason})") from None
    want = module.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise InvalidInputError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        w = want[name]
        if t.shape != w.shape:
            raise InvalidInputError(f"{path}: tensor {name} has shape {list(t.shape)}, its config.json "
                                    f"makes it {list(w.shape)}")
        if (t.dtype not in FLOAT_DTYPES) if w.is_floating_point() else (t.dtype != w.dtype):
            kinds = "bfloat16, float16 or float32" if w.is_floating_point() else str(w.dtype).removeprefix("torch.")
            raise InvalidInputError(f"{path}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, not {kinds}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise InvalidInputError(f"{path}: tensor {name} holds {bad} values that are NaN or infinite")
    check = getattr(module, "check_state", None)
    if callable(check):
        try:
            check(state)
        except ValueError as e:
            raise InvalidInputError(f"{path}: {e}") from None
    return state


# --- layers --------------------------------------------------------------------------------


class Rope(nn.Module):
    """The target's rotary table (drafters place their tokens at the target's positions)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, target: ModelConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        cos, sin = cos_sin_table(msgspec.structs.replace(target, head_dim=head_dim), max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] with cos/sin [..., D], rotate-half, fp32 math."""
    shape = x.shape
    out = apply_rope(x.reshape(-1, shape[-2], shape[-1]), cos.reshape(-1, shape[-1]), sin.reshape(-1, shape[-1]))
    return out.to(x.dtype).reshape(shape)


def fused(module: Norm | SelfAttention | MLP | DecoderBlock) -> bool:
    """Whether a layer runs the kernel's fused kernels now: switched on for serving on a platform
    that has them (`use_fused_kernels`), and never under autograd (they have no backward)."""
    return module.fused and not torch.is_grad_enabled()


def use_fused_kernels(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Switches every `Norm`, `SelfAttention`, `MLP` and `DecoderBlock` of a loaded drafter to
    the fused kernels of `speckernel.kit.fused_ops`: at batch 1 a drafter's pass is bound by
    kernel launches, and these make a layer about half as many."""
    for m in module.modules():
        if isinstance(m, Norm | SelfAttention | MLP | DecoderBlock):
            m.fused = enabled
            if enabled and isinstance(m, SelfAttention | MLP):
                m.fuse_weights()
    return module


class Norm(RMSNorm):
    """The target's RMSNorm, one fused kernel when serving on a platform that has it."""

    fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused(self):
            return super().forward(x)
        return fused_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class SelfAttention(nn.Module):
    """Llama attention over an input of `in_dim` (eagle3 feeds 2H); HF tensor names."""

    fused = False

    def __init__(self, cfg: DrafterConfig, in_dim: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.scale = self.hd**-0.5
        self.qkv_weight: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lead = x.shape[:-1]
        if fused(self) and self.qkv_weight is not None:
            nq, nk = self.nh * self.hd, self.nkv * self.hd
            qkv = F.linear(x.reshape(-1, x.shape[-1]), self.qkv_weight)
            q, k = fused_ops.rope(qkv[:, :nq].view(-1, self.nh, self.hd),
                                  qkv[:, nq:nq + nk].view(-1, self.nkv, self.hd),
                                  cos.reshape(-1, self.hd), sin.reshape(-1, self.hd))
            v = qkv[:, nq + nk:].view(*lead, self.nkv, self.hd)
            return q.view(*lead, self.nh, self.hd), k.view(*lead, self.nkv, self.hd), v
        q = self.q_proj(x).view(*lead, self.nh, self.hd)
        k = self.k_proj(x).view(*lead, self.nkv, self.hd)
        v = self.v_proj(x).view(*lead, self.nkv, self.hd)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        out = attend(q, k, v)
        return self.o_proj(out.reshape(*x.shape[:-1], self.nh * self.hd))


class MLP(nn.Module):
    fused = False

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None

    def fuse_weights(self) -> None:
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused(self) and self.gate_up_weight is not None:
            gate_up = F.linear(x.reshape(-1, x.shape[-1]), self.gate_up_weight)
            return self.down_proj(fused_ops.silu_mul(gate_up)).view(x.shape)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """One Llama decoder block; `in_dim` > hidden_size when the attention takes a wider input
    (the residual is then the caller's `residual`)."""

    fused = False

    def __init__(self, cfg: DrafterConfig, in_dim: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, in_dim or cfg.hidden_size)
        self.post_attention_layernorm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                attn_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: the residual stream [..., H]; attn_input: the (already normalised) attention input
        when it is not input_layernorm(x)."""
        if attn_input is None and self._small(x):
            return self._forward_small(x, cos, sin, attend)
        a = self.input_layernorm(x) if attn_input is None else attn_input
        attended = self.self_attn(a, cos, sin, attend)
        if fused(self):  # the residual add inside the norm's kernel
            post = self.post_attention_layernorm
            h = x.shape[-1]
            normed, x = fused_ops.rms_norm(attended.reshape(-1, h), post.weight, post.eps, x.reshape(-1, h))
            return (x + self.mlp(normed)).view(attended.shape)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def _small(self, x: torch.Tensor) -> bool:
        """A drafting step of a few tokens, served with fused weights: the target's small-batch
        kernels run the block in four launches besides attention (a drafting step at batch 1 is
        bound by launches, not by its work)."""
        return (fused(self) and self.self_attn.qkv_weight is not None and self.mlp.gate_up_weight is not None
                and small_batch.runs_on(x.reshape(-1, x.shape[-1])))

    def _forward_small(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The block on `small_batch`: norm + QKV + rope, attention, o + residual, norm + gate_up +
        SwiGLU, down + residual. cos/sin hold one row per token, the rotary table the kernel indexes
        by each token's row."""
        attn, lead, h = self.self_attn, x.shape[:-1], x.shape[-1]
        assert attn.qkv_weight is not None and self.mlp.gate_up_weight is not None
        flat = x.reshape(-1, h)
        t = flat.shape[0]
        rows = torch.arange(t, device=x.device)
        norm = self.input_layernorm
        q, k, v = small_batch.norm_qkv_rope(flat, norm.weight, norm.eps, attn.qkv_weight, None, rows,
                                            cos.reshape(t, attn.hd).float().contiguous(),
                                            sin.reshape(t, attn.hd).float().contiguous(), (attn.nh, attn.nkv, attn.hd))
        out = attend(q.view(*lead, attn.nh, attn.hd), k.view(*lead, attn.nkv, attn.hd),
                     v.view(*lead, attn.nkv, attn.hd))
        flat = small_batch.linear_residual(out.reshape(t, attn.nh * attn.hd), attn.o_proj.weight, flat)
        post = self.post_attention_layernorm
        gated = small_batch.norm_gate_up(flat, post.weight, post.eps, self.mlp.gate_up_weight)
        return small_batch.linear_residual(gated, self.mlp.down_proj.weight, flat).view(x.shape)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Training attention: q [B, Q, heads, D], k/v [B, L, kv_heads, D], mask [Q, L] or [B, Q, L]
    (True: may attend) -> [B, Q, heads, D]."""
    m = mask if mask.dim() == 3 else mask[None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=m[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


GATHER_ROUND = 64
"""Gather sizes are rounded up to a multiple of this, so the shapes of training steps recur."""


def counted_positions(valid: torch.Tensor, bound: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `x[valid]` selects, without reading the device back to size it (a host sync each
    training step): the flat indices of valid's True entries in order, padded to a size the host
    knows, and a float weight per index (1 for a True entry, 0 for padding). `bound` is at least
    the number of True entries (`TrainBatch.counted`; None: every entry)."""
    flat = valid.reshape(-1)
    size = flat.numel() if bound is None else min(flat.numel(), -(-bound // GATHER_ROUND) * GATHER_ROUND)
    index = torch.sort(flat.logical_not().to(torch.uint8), stable=True).indices[:size]
    return index, flat.index_select(0, index).to(torch.float32)


# --- the speculator side ---------------------------------------------------------------------


def cache_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [R, N] (or [R]) of the rows with block tables [R, MB], on the device."""
    flat = positions.reshape(positions.shape[0], -1)
    blocks = (flat // block_size).clamp(max=tables.shape[1] - 1)
    return (tables.gather(1, blocks) * block_size + flat % block_size).view(positions.shape)


def draft_probability(logits: torch.Tensor) -> torch.Tensor:
    """The drafter's probability of its greedy draft, from logits [..., V]."""
    return (logits.amax(-1) - logits.logsumexp(-1)).exp()


def trim(drafts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """drafts [R, K] with -1 from each row's first position whose keep is False on."""
    return torch.where(keep.to(torch.int64).cumprod(dim=1).bool(), drafts, -1)


class DrafterModule(nn.Module):
    """The module a learned speculator runs and `speckernel train-drafter` trains (a
    `speckernel.plugin.TrainableDrafter`), built as Module(config, target_config, max_len)."""

    config: DrafterConfig

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training loss on one batch, and named figures (0-dim tensors, left on the device) for
        the progress bar and the log."""
        raise NotImplementedError

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        """ValueError (one line, naming the tensor) when a checkpoint's integer tensors index
        outside what they index: shapes, dtypes and finite floats are checked before this."""


DrafterT = TypeVar("DrafterT", bound=DrafterModule)
"""The module class a learned speculator runs: `self.module` has its own type, not DrafterModule's."""


class LearnedSpeculator(SpeculatorBase, Generic[DrafterT, OptionsT]):
    """Contract plumbing from a checkpoint: subclasses give `Module`, `defaults(target)` and
    the per-row passes."""

    Module: type[DrafterT]
    """Built as Module(config, target_config, max_len); set on the class."""
    module: DrafterT
    """The loaded drafter."""
    capabilities: ClassVar[SpeculatorCapabilities]

    @classmethod
    def defaults(cls, target: ModelConfig) -> DrafterConfig:
        """The architecture trained for this target when none is given."""
        raise NotImplementedError

    @classmethod
    def new_drafter(cls, target: ModelConfig, max_len: int, **overrides: Any) -> DrafterModule:
        """An untrained drafter for this target (what `train-drafter` starts from)."""
        cfg = msgspec.structs.replace(cls.defaults(target), **overrides)
        return cls.Module(cfg, target, max_len)

    @classmethod
    def read_checkpoint(cls, folder: Path, target: ModelConfig) -> DrafterConfig:
        """The architecture `train-drafter --init` starts from, checked like a served checkpoint
        (its weights' digest included)."""
        cfg = read_checked(folder, cls.name, target)
        check_digest(folder / "model.safetensors", expected_sha256(folder, cls.name, cfg))
        return cfg

    @classmethod
    def shipped_checkpoint(cls) -> Path | None:
        """The checkpoint shipped for the default model (`train-drafter --init METHOD`), if any."""
        folder = WEIGHTS / cls.name
        return folder if (folder / "config.json").is_file() else None

    @classmethod
    def save(cls, folder: Path, drafter: TrainableDrafter) -> None:
        """Writes a checkpoint that `--draft-model folder` loads."""
        assert isinstance(drafter, cls.Module), f"{cls.name} saves the drafters its new_drafter builds"
        save(folder, drafter.config, drafter)

    @classmethod
    def draft_kv_layers(cls, cfg: DrafterConfig) -> int:
        """Layers of draft KV the drafter keeps (0: none)."""
        return cfg.num_layers

    @classmethod
    def check(cls, ctx: SpeculatorContext) -> None:
        checkpoint(cls.name, ctx)

    @classmethod
    def capabilities_for(cls, ctx: SpeculatorContext) -> SpeculatorCapabilities:
        _, cfg = checkpoint(cls.name, ctx)
        return msgspec.structs.replace(cls.capabilities, target_hidden_layers=cfg.target_layers)

    @classmethod
    def draft_kv_bytes_per_token(cls, ctx: SpeculatorContext) -> int:
        _, cfg = checkpoint(cls.name, ctx)
        size = torch.empty((), dtype=ctx.dtype).element_size()
        return cls.draft_kv_layers(cfg) * 2 * cfg.num_kv_heads * cfg.head_dim * size

    def __init__(self, ctx: SpeculatorContext[OptionsT]) -> None:
        folder, cfg = checkpoint(self.name, ctx)
        self.options: OptionsT = ctx.options
        self.cfg = cfg
        self.capabilities = self.capabilities_for(ctx)  # type: ignore[misc]
        self.module = load_weights(self.Module(cfg, ctx.target, ctx.max_model_len + self.capabilities.max_k + 2),
                                   folder, ctx.device, ctx.dtype, expected_sha256(folder, self.name, cfg))
        self.device = ctx.device
        self.dtype = ctx.dtype
        self.block_size = ctx.block_size
        assert ctx.attention is not None, "the kernel gives each speculator an attention backend"
        self.attention = ctx.attention
        self.kv: torch.Tensor | None = None
        layers = self.draft_kv_layers(cfg)
        if layers:
            assert ctx.draft_kv is not None, "the kernel allocates the draft KV"
            slots = ctx.num_kv_blocks * ctx.block_size
            self.kv = ctx.draft_kv.view(ctx.dtype).view(layers, 2, slots, cfg.num_kv_heads, cfg.head_dim)
        if ctx.fused_kernels:
            use_fused_kernels(self.module)
