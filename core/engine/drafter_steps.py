"""A served drafter's steady-state passes at fixed shapes, replayed as device graphs.

Eagerly, one proposal of a one-layer drafter is a few hundred kernel launches: on a host where
a launch costs ~20 µs that is milliseconds, longer than the target's whole step, and every
millisecond of it is on the engine's critical path. The passes of an `InStepSpeculator` read
device tensors only (as inside the engine's own step graphs), so a step whose rows all carry
the same number of query tokens (decode, or verification of K drafts) pads to a row bucket and
replays a graph captured at start. Each call is then one host-to-device copy of the step's plan
(rows, positions, the new tokens), one per hidden-state layer, the replay, and the drafts back.

Padding rows name the spare slot (the engine's own spare, never a request's) and sample
nothing, so they write no draft KV and their drafts are dropped. Where the platform cannot
capture graphs (the CPU) the same padded passes run eagerly, so they are tested there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from .. import log
from ..attention import AttentionBackend, AttentionMetadata, Chunk
from ..platform import DeviceGraph, Platform
from ..plugin import DeviceStates, InStepSpeculator, TargetModel
from ..runner.step_graphs import row_buckets
from ..runner.step_plan import DRAFTER, Col, HostPlan

Key = tuple[int, int, int]
"""(rows, query tokens per row, drafts proposed; 0: the sync pass)."""


@dataclass
class PaddedSteps:
    speculator: InStepSpeculator
    attention: AttentionBackend
    """The served drafter's plan backend, `max_blocks` fixed: a plan's layout depends only on
    the padded token and row counts, as graphs need."""
    tokens: torch.Tensor
    hidden: dict[int, torch.Tensor]
    """Per declared layer, [max tokens, H]: a step's hidden states are copied in before a replay."""
    target: TargetModel | None
    spare: int
    """The slot padding rows name."""
    max_rows: int
    widths: tuple[int, ...]
    """Query tokens per row of the captured steps: 1 (decode) and K + 1 (verification)."""
    graphs: dict[Key, tuple[DeviceGraph, torch.Tensor | None]] = field(default_factory=dict)
    pool: object | None = None

    @classmethod
    def build(cls, speculator: InStepSpeculator, attention: AttentionBackend, tokens: torch.Tensor,
              layers: tuple[int, ...], hidden_size: int, dtype: torch.dtype, target: TargetModel | None,
              num_slots: int, k: int) -> PaddedSteps:
        widths = tuple(sorted({1, k + 1}))
        max_rows = max(1, num_slots - 1)
        max_tokens = max_rows * widths[-1]
        attention.reserve(max_tokens, max_rows, DRAFTER.int_width, 3 * max_tokens)
        hidden = {layer: torch.zeros(max_tokens, hidden_size, dtype=dtype, device=tokens.device) for layer in layers}
        return cls(speculator, attention, tokens, hidden, target, num_slots - 1, max_rows, widths)

    def key(self, num_tokens: list[int], k: int) -> Key | None:
        """The padded shape that serves a step of rows with these query lengths, or None."""
        q = num_tokens[0]
        if q not in self.widths or any(n != q for n in num_tokens) or len(num_tokens) > self.max_rows:
            return None
        rows = next(b for b in row_buckets(self.max_rows) if b >= len(num_tokens))
        return rows, q, k

    def plan(self, key: Key, chunks: Sequence[Chunk], rows: HostPlan, tail: np.ndarray) -> AttentionMetadata:
        """rows: the real rows' plan (`DRAFTER`); padding rows follow at the spare slot."""
        r, q, _ = key
        plan = DRAFTER.empty(r)
        DRAFTER.put(plan, Col.SLOT, self.spare)
        plan.overwrite(rows)
        return self.attention.prepare(chunks, num_tokens=r * q, num_rows=r, row_extra=plan.ints,
                                      row_floats=plan.floats, tail=tail, max_query_len=q)

    def run(self, key: Key, meta: AttentionMetadata) -> torch.Tensor | None:
        """The pass at this key: replayed where captured, else eagerly on the same buffers."""
        captured = self.graphs.get(key)
        if captured is not None:
            captured[0].replay()
            return captured[1]
        return self._pass(key, meta)

    def _pass(self, key: Key, meta: AttentionMetadata) -> torch.Tensor | None:
        r, q, k = key
        extra = DRAFTER.on_device(meta)
        states = DeviceStates(
            tokens=self.tokens, slot_index=DRAFTER.of(extra, Col.SLOT).contiguous(), positions=meta.positions,
            accepted=DRAFTER.of(extra, Col.ACCEPTED).contiguous(), seq_lens=DRAFTER.of(extra, Col.SEQ_LEN).contiguous(),
            samples=DRAFTER.of(extra, Col.SAMPLES) != 0, hidden={layer: h[: r * q] for layer, h in self.hidden.items()},
            target=self.target, attention=meta)
        if not k:
            self.speculator.sync(states)
            return None
        return self.speculator.propose(states, k).token_ids

    @torch.inference_mode()
    def capture(self, platform: Platform, k: int) -> None:
        """Captures every key (largest first, smaller ones reuse its memory), with progress. A
        capture that fails leaves the rest to run eagerly, padded: slower, never wrong."""
        keys = [(rows, q, mode) for q in reversed(self.widths) for mode in (k, 0)
                for rows in reversed(row_buckets(self.max_rows))]
        try:
            for key in tqdm(keys, desc="capturing drafter graphs", unit="graph", file=sys.stderr, disable=None,
                            leave=False):
                meta = self.plan(key, [], DRAFTER.empty(0), np.zeros(0, np.int64))
                self.graphs[key] = self._record(platform, key, meta)
        except Exception as e:  # a drafter whose pass a graph cannot hold: it runs eagerly
            self.graphs.clear()
            log.get("drafter_host").warning("drafter_graphs_failed", error=f"{type(e).__name__}: {e}")
            return
        platform.synchronize()
        log.get("drafter_host").info("drafter_graphs_captured", num_graphs=len(self.graphs),
                                     row_buckets=row_buckets(self.max_rows), widths=self.widths)

    def _record(self, platform: Platform, key: Key, meta: AttentionMetadata) -> tuple[DeviceGraph, torch.Tensor | None]:
        run: Callable[[], torch.Tensor | None] = lambda: self._pass(key, meta)  # noqa: E731
        for _ in range(2):  # compiles kernels and settles the allocator outside the capture
            run()
        with platform.graph_capture(self.pool) as graph:
            out = run()
        self.pool = graph.pool()
        return graph, out
