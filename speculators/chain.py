"""Chained drafters (mtp, eagle3): one decoder layer run K times, each run taking the previous
run's output as its feature, over one layer of draft KV kept at the target's cache slots.

The layer's input at position p is the token at p and a feature of position p - 1: the
target's (its hidden states) for confirmed positions, the layer's own output for drafted ones.

Serving (device only, fixed shapes, inside the target's step):
1. Catch-up: the layer runs over the step's tokens at their positions, each with the target's
   feature of the token before it (the previous query token's, or for a row's first token the
   one carried from its previous step; zeros at position 0). That writes the draft KV of every
   query position; those past the accepted drafts hold rejected tokens, and the next step's
   catch-up rewrites them before anything reads them.
2. Chain (propose only): from each row's newest token, at position seq_len - 1, with the feature
   of its last accepted query token, K runs of one token each, each on the previous draft and
   the previous run's output. They write draft KV up to K - 1 positions past the confirmed ones
   (one lookahead slot per draft).

Training unrolls the chain over every position of a sequence at once (EAGLE-3's training-time
test): run j at base position q sits at q + j - 1, reads the target-feature KV of positions <= q
and the KV of runs 2..j at base q (a diagonal mask), and learns the target's greedy token there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speckernel.plugin import (
    DeviceStates,
    Drafts,
    ModelConfig,
    NoOptions,
    SpeculatorCapabilities,
    SpeculatorContext,
    TargetModel,
    TrainBatch,
)
from speckernel.speculators.learned import (
    Attend,
    DrafterConfig,
    DrafterModule,
    LearnedSpeculator,
    Rope,
    cache_slots,
    counted_positions,
    masked_attention,
)

STEP_DECAY = 0.8
"""Loss weight of chain run j is STEP_DECAY ** (j - 1): later drafts matter only if earlier ones hold."""


class ChainModule(DrafterModule):
    """What a chained drafter's module gives: its feature of the target's hidden states, one run
    of its layer, and its draft tokens. `loss` is shared."""

    def __init__(self, cfg: DrafterConfig, target: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = cfg
        self.rope = Rope(target, cfg.head_dim, max_len)
        self.scale = cfg.head_dim**-0.5

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's feature of each position ([..., H]) from its captured hidden states."""
        raise NotImplementedError

    def run(self, embedded: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attend: Attend) -> torch.Tensor:
        """One run of the layer: token embeddings and features [..., H] -> output hidden [..., H]."""
        raise NotImplementedError

    def logits(self, out: torch.Tensor, target: TargetModel) -> torch.Tensor:
        """Float logits over the drafter's vocabulary."""
        raise NotImplementedError

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Drafter vocabulary index -> target token id."""
        return index

    def to_draft_index(self, labels: torch.Tensor) -> torch.Tensor:
        """Target token id -> drafter vocabulary index (-1: not in it)."""
        return labels

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each run's cross-entropy over the positions whose label counts, weighted by STEP_DECAY,
        and its top-1 accuracy. The head runs on those positions only, gathered to a size the
        host knows (`batch.counted`), so nothing in the step waits for the device."""
        tokens, labels, mask = batch.tokens, batch.labels, batch.mask
        b, t = tokens.shape
        device = tokens.device
        target_feature = self.feature(batch.hidden)
        feature = torch.cat([torch.zeros_like(target_feature[:, :1]), target_feature[:, :-1]], dim=1)
        embedded = batch.target.embed(tokens) if batch.target.embed is not None else None
        assert embedded is not None, "chained drafters read the target's embedding"
        base = torch.arange(t, device=device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        total = torch.zeros((), device=device)
        weight_sum = 0.0
        metrics: dict[str, torch.Tensor] = {}
        steps = self.config.num_steps
        for j in range(steps):
            where = (base + j).clamp(max=t - 1)
            valid = mask[:, where] & (base + j < t)[None]  # its count is at most the mask's
            cos, sin = self.rope(base + j)
            mask_j = self._ttt_mask(t, j, device)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask_j: torch.Tensor = mask_j) -> torch.Tensor:
                keys.append(k)
                values.append(v)
                return masked_attention(q, torch.cat(keys, 1), torch.cat(values, 1), mask_j, self.scale)

            out = self.run(embedded[:, where], feature, cos.expand(b, -1, -1), sin.expand(b, -1, -1), attend)
            lab = self.to_draft_index(labels[:, where])
            index, weight = counted_positions(valid & (lab >= 0), batch.counted)
            want = lab.reshape(-1).index_select(0, index).clamp(min=0)  # padding: any id, weight 0
            logits = self.logits(out.reshape(b * t, -1).index_select(0, index), batch.target)
            counted = weight.sum().clamp(min=1)
            step_loss = (F.cross_entropy(logits, want, reduction="none") * weight).sum() / counted
            total = total + STEP_DECAY**j * step_loss
            weight_sum += STEP_DECAY**j
            with torch.no_grad():
                metrics[f"acc{j + 1}"] = ((logits.argmax(-1) == want).float() * weight).sum() / counted
            feature = out
        return total / weight_sum, metrics

    @staticmethod
    def _ttt_mask(t: int, j: int, device: torch.device) -> torch.Tensor:
        """[T, T * (j + 1)]: run j at base q reads run-0 keys at positions <= q and the keys of
        runs 1..j at base q."""
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        eye = torch.eye(t, dtype=torch.bool, device=device)
        return torch.cat([causal, *([eye] * j)], dim=1)


class ChainSpeculator(LearnedSpeculator[ChainModule, NoOptions]):
    capabilities = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=16,
                                          k0_pass="draft prefill: its layer writes the draft KV of the step's tokens",
                                          lookahead_slots_per_draft=1, uses_target_weights=True,
                                          trainable=True)

    def __init__(self, ctx: SpeculatorContext) -> None:
        super().__init__(ctx)
        assert ctx.num_slots > 0, "the kernel says how many slots the token buffer has"
        self.carry = torch.zeros(ctx.num_slots, self.cfg.hidden_size, dtype=ctx.dtype, device=ctx.device)
        """Per slot: the target's feature of the row's last accepted query token."""

    def _catch_up(self, states: DeviceStates) -> torch.Tensor:
        """Runs the layer over the step's tokens (writing their draft KV); returns each row's
        feature of its last confirmed input token, which the chain and the next step start from."""
        meta, target = states.attention, states.target
        assert meta is not None and target is not None and target.embed is not None and self.kv is not None
        m = self.module
        positions = meta.positions
        t = positions.shape[0]
        slot_t = states.slot_index[meta.token_rows]
        feature = m.feature(states.hidden).to(self.dtype)
        index = torch.arange(t, device=self.device)
        first = index == meta.query_start[meta.token_rows]
        prev = torch.cat([torch.zeros_like(feature[:1]), feature[:-1]])
        prev = torch.where(first[:, None], self.carry[slot_t], prev)
        prev = torch.where((positions == 0)[:, None], 0.0, prev)
        ids = states.tokens[slot_t, positions].clamp(min=0)
        cos, sin = m.rope(positions)
        kv = self.kv[0]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return meta.backend.forward(q, k, v, kv, meta, m.scale)

        m.run(target.embed(ids), prev, cos, sin, attend)
        rows = states.slot_index.shape[0]
        starts = meta.query_start[:rows]
        start_pos = positions[starts.clamp(max=t - 1)]
        offset = states.seq_lens - 1 - states.samples.long() - start_pos
        last = (starts + offset).clamp(0, t - 1)
        carried = feature[last]
        self.carry.index_copy_(0, states.slot_index, carried)
        return carried

    @torch.inference_mode()
    def sync(self, states: DeviceStates) -> None:
        self._catch_up(states)

    @torch.inference_mode()
    def propose(self, states: DeviceStates, k: int) -> Drafts:
        feature = self._catch_up(states)
        meta, target = states.attention, states.target
        assert meta is not None and target is not None and target.embed is not None and self.kv is not None
        m = self.module
        kv = self.kv[0]
        tables = meta.block_tables[: states.slot_index.shape[0]]
        pos = (states.seq_lens - 1).clamp(min=0)
        token = states.tokens[states.slot_index, pos]
        bs = self.block_size
        drafts = []
        for _ in range(k):
            slots = torch.where(states.samples, cache_slots(tables, pos, bs), -1)
            lens = pos + 1

            def attend(q: torch.Tensor, key: torch.Tensor, v: torch.Tensor,
                       slots: torch.Tensor = slots, lens: torch.Tensor = lens) -> torch.Tensor:
                self.attention.write(key, v, kv, slots)
                return self.attention.attend(q, kv, tables, lens, m.scale)

            cos, sin = m.rope(pos)
            out = m.run(target.embed(token), feature, cos, sin, attend)
            token = m.to_target_ids(m.logits(out, target).argmax(-1))
            drafts.append(token)
            feature, pos = out, pos + 1
        return Drafts(torch.stack(drafts, 1))
