"""The speculator as the engine checks and builds it: shared by the engine core and the last
pipeline stage, the one place a drafter lives when the target is split."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..config import EngineConfig
from ..errors import InvalidInputError
from ..model_config import ModelConfig
from ..platform import Platform
from ..plugin import Speculator, SpeculatorCapabilities, SpeculatorContext
from .check import Checked


class Speculation(NamedTuple):
    """The speculator as checked at start: its class, the context it is built with, and what it
    declares for this target."""

    cls: type[Speculator]
    ctx: SpeculatorContext
    caps: SpeculatorCapabilities


def check_speculator(checked: Checked, model_cfg: ModelConfig, platform: Platform,
                     dtype: torch.dtype) -> Speculation | None:
    """The named speculator's own checks against this target, and its capabilities for it."""
    cls, options = checked.speculator, checked.options
    if cls is None:
        return None
    assert options is not None, "check parses a named speculator's options"
    config = checked.config
    name = config.speculator
    ctx = SpeculatorContext(
        target=model_cfg, target_path=checked.path, device=platform.device, dtype=dtype,
        block_size=config.block_size, max_model_len=checked.max_model_len,
        num_speculative_tokens=config.num_speculative_tokens, options=options,
        draft_model=config.draft_model)
    cls.check(ctx)
    # SpeculatorBase (every built-in) has capabilities_for; a plugin written to the protocol
    # before it gained the classmethod declares only `capabilities`.
    caps: SpeculatorCapabilities = cls.capabilities_for(ctx) if hasattr(cls, "capabilities_for") \
        else cls.capabilities
    num_layers = model_cfg.num_layers
    bad_layers = [layer for layer in caps.target_hidden_layers if not 0 <= layer < num_layers]
    if bad_layers:
        raise InvalidInputError(f"speculator {name!r} needs hidden states of layers {bad_layers}; "
                                f"the target has {num_layers}")
    return Speculation(cls, ctx, caps)


def build_speculator(config: EngineConfig, spec: Speculation, platform: Platform, max_model_len: int,
                     num_blocks: int, draft_kv_bytes: int) -> Speculator:
    """The speculator, built with the cache it shares: the context held, the block count, its
    draft-KV memory and an attention backend of its own."""
    draft_kv = None
    if draft_kv_bytes:
        draft_kv = torch.zeros(draft_kv_bytes, dtype=torch.uint8, device=platform.device)
    ctx = dataclasses.replace(
        spec.ctx, max_model_len=max_model_len, num_kv_blocks=num_blocks, draft_kv=draft_kv,
        attention=platform.attention_backend(config.block_size, config.max_num_batched_tokens),
        num_slots=config.max_num_seqs + 1, fused_kernels=platform.capabilities.triton,
        host_gate=platform.host_gate, pin_memory=platform.device.type != "cpu",
        packed_weights=platform.capabilities.packed_weights)
    return spec.cls(ctx)


def held_bytes(speculator: Speculator | None) -> int:
    """Bytes of the tensors a built speculator holds as attributes (its modules' weights and
    buffers, its draft KV), each storage once: what a stage reports of its drafter."""
    storages: dict[int, int] = {}
    for value in getattr(speculator, "__dict__", {}).values():
        if isinstance(value, torch.nn.Module):
            tensors = [*value.parameters(), *value.buffers()]
        else:
            tensors = [value] if isinstance(value, torch.Tensor) else []
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
