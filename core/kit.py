"""The drafter kit: the target's own building blocks, for speculators that run layers of their own.

`speckernel.plugin` is the contract every speculator imports; this module is what the learned
drafters (and `draft_model`) build on besides it, so that a drafter computes exactly what the
target computes:

- layers: `RMSNorm`, and `LlamaModel` (what `load_model` returns: embed, layers, norm, logits);
- rope: `cos_sin_table` (the target's rotary table for a config) and `apply_rope`;
- KV: `new_kv_cache`, a paged KV cache laid out like the target's;
- target access: `resolve_model` (a name, GGUF file or folder to a checkpoint path),
  `read_config` (its `ModelConfig`), `load_model` (its weights on a device);
- sampling: `target_noise`, the noise the target samples a position with, so a drafter can
  draw the token the target will draw;
- `fused_ops`: the kernel's fused Triton ops (rms_norm with residual add, q/k rope, silu_mul),
  and `small_batch`, its kernels for steps of a few tokens (norm + QKV + rope, projection +
  residual, norm + gate_up + SwiGLU), for a platform where `SpeculatorContext.fused_kernels`
  says they run;
- a drafter served elsewhere: `drafter_wire` (the messages of `speckernel serve-drafter`'s RPC)
  and the zero-copy codec (`Encoder`, `Decoder`) they travel with;
- `logger(name)`: the engine's structured key-value log, for a plugin's own events;
- `to_device(array, device)`: a host array on the device in a copy the host does not wait for;
- checksums: `verified(path, sha256, stamp)` (one full sha256, then a size + mtime stamp, as the
  model's file is checked), `cache_stamp(path)` (a stamp for a file in a read-only folder) and
  `sha256_of(path)`.

The kit is versioned with the kernel, not with the contract: its names and signatures follow
the kernel's models and ops. A plugin that uses it is tied to the speckernel version it was
written for; a plugin that needs only the contract imports `speckernel.plugin` alone.
"""

from __future__ import annotations

from .log import get as logger
from .models.builtin import cache_stamp, sha256_of, verified
from .models.checkpoint import read_config
from .models.checkpoint import resolve as resolve_model
from .models.llama import LlamaModel, RMSNorm
from .models.loader import load_model
from .models.paged import new_kv_cache
from .ops import fused_ops, small_batch
from .ops.rope import apply_rope, cos_sin_table
from .runner.host_copy import to_device
from .runner.sampler import target_noise
from .wire import drafter as drafter_wire
from .wire.codec import Decoder, Encoder

__all__ = [
    "Decoder",
    "Encoder",
    "LlamaModel",
    "RMSNorm",
    "apply_rope",
    "cache_stamp",
    "cos_sin_table",
    "drafter_wire",
    "fused_ops",
    "load_model",
    "logger",
    "new_kv_cache",
    "read_config",
    "resolve_model",
    "sha256_of",
    "small_batch",
    "target_noise",
    "to_device",
    "verified",
]
