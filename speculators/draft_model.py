"""An independent small model with the target's tokenizer drafts K tokens autoregressively.

Option `num_layers=N` keeps only the draft checkpoint's first N layers (with its final norm and
head): a cheap self-speculative drafter from the target's own weights when no smaller
checkpoint with the same tokenizer exists.

It keeps its own paged KV cache, indexed by the target's block tables (so the kernel's block
accounting covers it), and needs one lookahead slot per draft: after a step it writes draft
KV up to K - 1 positions past the confirmed tokens. Fixed width: the host needs only the count.
"""

from __future__ import annotations

import msgspec
import torch

from speckernel.errors import InvalidInputError
from speckernel.models.builtin import resolve
from speckernel.models.loader import load_model, read_config
from speckernel.models.paged import build_metadata, new_kv_cache
from speckernel.sampler import draw_seed
from speckernel.speculator import Drafts, ProposeRow, SpeculatorCapabilities, SpeculatorContext

from .history import TokenHistory

DRAFT_SALT = 0xD4AF7


class DraftModelSpeculator:
    name = "draft_model"
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=16,
                                          lookahead_slots_per_draft=1, sampled_drafts=True)

    def __init__(self, ctx: SpeculatorContext) -> None:
        self.check(ctx)
        path = resolve(ctx.options.draft_model or str(ctx.target_path))
        self.model = load_model(path, ctx.dtype, ctx.device, ctx.max_model_len + self.capabilities.max_k + 1)
        num_layers = int(ctx.options.extra.get("num_layers", 0))
        if num_layers:
            del self.model.layers[num_layers:]
        self.block_size = ctx.block_size
        self.device = ctx.device
        cfg = msgspec.structs.replace(self.model.cfg, num_layers=len(self.model.layers))
        self.kv = new_kv_cache(cfg, ctx.num_kv_blocks, ctx.block_size, ctx.dtype, ctx.device)
        self.history = TokenHistory()
        self.computed: dict[str, int] = {}
        """Positions whose draft KV holds confirmed tokens."""

    def check(self, ctx: SpeculatorContext) -> None:
        unknown = set(ctx.options.extra) - {"num_layers"}
        if unknown:
            raise InvalidInputError(f"draft_model options: unknown {sorted(unknown)}; known: ['num_layers']")
        draft = read_config(resolve(ctx.options.draft_model or str(ctx.target_path)))
        num_layers = ctx.options.extra.get("num_layers", "0")
        if not num_layers.isdigit() or not 0 <= int(num_layers) <= draft.num_layers:
            raise InvalidInputError(f"draft_model option num_layers: expected an integer in [1, {draft.num_layers}], "
                                    f"got {num_layers!r}")
        if ctx.options.draft_model is None:
            return  # the target drafts for itself: same tokenizer by construction
        if draft.vocab_size != ctx.target.vocab_size:
            raise InvalidInputError(
                f"draft model vocabulary ({draft.vocab_size}) differs from the target's "
                f"({ctx.target.vocab_size}); draft_model needs the target's tokenizer")

    def _catch_up(self, rows: list[ProposeRow]) -> torch.Tensor:
        """Feeds each row's confirmed tokens not yet in the draft KV; returns last-position logits."""
        chunks, ids = [], []
        for row in rows:
            tokens = self.history.update(row)
            start = min(self.computed.get(row.req_id, 0), row.start_pos + len(row.input_token_ids))
            start = min(start, len(tokens) - 1)
            chunks.append((start, len(tokens) - start, row.block_ids))
            ids.extend(tokens[start:])
            self.computed[row.req_id] = len(tokens)
        meta = build_metadata(chunks, self.block_size, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), self.kv, meta)
        last = torch.tensor([0] + [c[1] for c in chunks], device=self.device).cumsum(0)[1:] - 1
        return self.model.logits(hidden[last])

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow], k: int) -> Drafts:
        logits = self._catch_up(rows)
        drafts = torch.empty(len(rows), k, dtype=torch.int64, device=self.device)
        probs = torch.zeros(len(rows), k, logits.shape[-1], device=self.device)
        lengths = [row.num_tokens for row in rows]
        for j in range(k):
            drafts[:, j] = logits.argmax(-1)  # greedy rows; verification ignores q for them
            for i, row in enumerate(rows):
                if row.temperature != 0.0:
                    q = (logits[i] / row.temperature).softmax(-1)
                    gen = torch.Generator(device=self.device).manual_seed(
                        draw_seed(row.seed ^ DRAFT_SALT, lengths[i] + j))
                    drafts[i, j] = (q / torch.empty_like(q).exponential_(generator=gen)).argmax()
                    probs[i, j] = q
            if j + 1 < k:
                meta = build_metadata([(lengths[i] + j, 1, row.block_ids) for i, row in enumerate(rows)],
                                      self.block_size, self.device)
                logits = self.model.logits(self.model(drafts[:, j], self.kv, meta))
        return Drafts(drafts, probs)

    @torch.inference_mode()
    def sync(self, rows: list[ProposeRow]) -> None:
        self._catch_up(rows)

    def release(self, req_id: str) -> None:
        self.history.release(req_id)
        self.computed.pop(req_id, None)
