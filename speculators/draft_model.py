"""An independent small model with the target's tokenizer drafts K tokens autoregressively.

Option `num_layers=N` keeps only the draft checkpoint's first N layers (with its final norm and
head): a cheap self-speculative drafter from the target's own weights when no smaller
checkpoint with the same tokenizer exists.

Its KV lives in the draft-KV memory the kernel allocates (`draft_kv_bytes_per_token`), indexed
by the target's block tables, and it needs one lookahead slot per draft: after a step it
writes draft KV up to K - 1 positions past the confirmed tokens. It sees every row of every
step, prefill chunks included, and reads every token from the kernel's token buffer. Per slot
it keeps only how many leading positions of its KV hold confirmed tokens; rejected drafts roll
that count back. Fixed width: the host needs only the count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import torch

from speckernel.kit import load_model, read_config, resolve_model, target_noise
from speckernel.plugin import (
    DeviceStates,
    Drafts,
    HostRows,
    InvalidInputError,
    ModelConfig,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
)


class DraftModelOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_layers: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Keep only the draft checkpoint's first N layers (0: all)."""


@dataclass
class SlotKV:
    generation: int
    valid: int = 0
    """Leading positions whose draft KV holds confirmed tokens."""
    drafted_end: int = 0
    """End of the positions written with draft tokens by the last proposal."""


class DraftModelSpeculator(SpeculatorBase):
    name = "draft_model"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=16,
                                          k0_pass="draft prefill: the draft model takes in the confirmed tokens",
                                          lookahead_slots_per_draft=1)
    Options = DraftModelOptions

    def __init__(self, ctx: SpeculatorContext[DraftModelOptions]) -> None:
        cfg = self._draft_config(ctx)
        self.model = load_model(self._path(ctx), ctx.dtype, ctx.device, ctx.max_model_len + self.capabilities.max_k + 1)
        del self.model.layers[cfg.num_layers:]
        if ctx.packed_weights:
            self.model.use_packed_weights()
        assert ctx.draft_kv is not None and ctx.attention is not None, "the kernel allocates the draft KV"
        slots = ctx.num_kv_blocks * ctx.block_size
        self.kv = ctx.draft_kv.view(ctx.dtype).view(cfg.num_layers, 2, slots, cfg.num_kv_heads, cfg.head_dim)
        self.attention = ctx.attention
        self.device = ctx.device
        self.slots: dict[int, SlotKV] = {}

    @staticmethod
    def _path(ctx: SpeculatorContext[DraftModelOptions]) -> Path:
        return resolve_model(ctx.draft_model or str(ctx.target_path))

    @classmethod
    def _draft_config(cls, ctx: SpeculatorContext[DraftModelOptions]) -> ModelConfig:
        draft = read_config(cls._path(ctx))
        n = ctx.options.num_layers or draft.num_layers
        return msgspec.structs.replace(draft, num_layers=n)

    @classmethod
    def check(cls, ctx: SpeculatorContext[DraftModelOptions]) -> None:
        draft = read_config(cls._path(ctx))
        if ctx.options.num_layers > draft.num_layers:
            raise InvalidInputError(f"draft_model option num_layers: expected an integer in [1, {draft.num_layers}], "
                                    f"got {ctx.options.num_layers}")
        if draft.vocab_size != ctx.target.vocab_size:
            raise InvalidInputError(
                f"draft model vocabulary ({draft.vocab_size}) differs from the target's "
                f"({ctx.target.vocab_size}); draft_model needs the target's tokenizer")

    @classmethod
    def draft_kv_bytes_per_token(cls, ctx: SpeculatorContext[DraftModelOptions]) -> int:
        cfg = cls._draft_config(ctx)
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=ctx.dtype).element_size()

    def _catch_up(self, states: DeviceStates, rows: HostRows) -> torch.Tensor:
        """Feeds each row's confirmed tokens not yet in the draft KV; returns the logits at
        each row's last confirmed position."""
        chunks: list[tuple[int, int, list[int]]] = []
        slot_of: list[int] = []
        pos_of: list[int] = []
        accepted = states.accepted.tolist()
        for i in range(states.num_rows):
            slot, gen, end = rows.slots[i], rows.generations[i], rows.seq_lens[i]
            kv = self.slots.get(slot)
            if kv is None or kv.generation != gen:
                kv = self.slots[slot] = SlotKV(gen)
            # Accepted drafts that were fed as drafts keep their KV; rejected ones roll back.
            # (Nothing is stored before the forward runs, so a step that fails and runs again
            # computes the same.)
            start = min(kv.valid + accepted[i], kv.drafted_end, end - 1)
            chunks.append((start, end - start, rows.block_tables[i]))
            slot_of += [slot] * (end - start)
            pos_of += range(start, end)
        ids = states.tokens[torch.tensor(slot_of, device=self.device), torch.tensor(pos_of, device=self.device)]
        hidden = self.model(ids, self.kv, self.attention.prepare(chunks))
        for slot, end in zip(rows.slots, rows.seq_lens, strict=True):  # only once the KV is written
            self.slots[slot].valid = self.slots[slot].drafted_end = end
        last = torch.tensor([c[1] for c in chunks], device=self.device).cumsum(0) - 1
        return self.model.logits(hidden[last])

    @torch.inference_mode()
    def propose(self, states: DeviceStates, host: HostRows, k: int) -> Drafts:
        logits = self._catch_up(states, host)
        rows = [i for i in range(states.num_rows) if host.samples[i]]
        drafts = torch.zeros(states.num_rows, k, dtype=torch.int64, device=self.device)
        idx = torch.tensor(rows, device=self.device)
        logits = logits[idx]
        # A sampled row's draft j is drawn with the target's own noise for the output token it
        # will be verified against, so the drafts are a function of (seed, position): verification
        # keeps each one exactly when the target samples the same token (no q needed, and tokens
        # are the same with or without this speculator).
        accepted = states.accepted.tolist()
        for j in range(k):
            step = logits.argmax(-1)  # greedy rows
            for n, i in enumerate(rows):
                s = host.sampling[i]
                if s is not None and s.temperature != 0.0:
                    q = (logits[n].float() / s.temperature).softmax(-1)
                    noise = target_noise(s.seed, s.position + accepted[i] + 1 + j, q.shape[-1], self.device)
                    step[n] = (q / noise).argmax()
            drafts[idx, j] = step
            if j + 1 < k:
                meta = self.attention.prepare([(host.seq_lens[i] + j, 1, host.block_tables[i]) for i in rows])
                logits = self.model.logits(self.model(step, self.kv, meta))
        for i in rows:
            self.slots[host.slots[i]].drafted_end = host.seq_lens[i] + k - 1
        return Drafts(drafts)

    @torch.inference_mode()
    def sync(self, states: DeviceStates, rows: HostRows) -> None:
        self._catch_up(states, rows)
