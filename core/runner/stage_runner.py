"""One pipeline stage's runner: the ModelRunner over a contiguous slice of the target's layers.

Every stage plans each step from the same StepFrame and keeps its own token buffer and the KV of
its own layers. The first stage gathers the input ids and embeds them; each stage runs its
layers and sends the residual stream (with the layers a speculator reads, captured so far) to
the next with a p2p send on the platform's backend; the last stage applies the final norm, then
samples, verifies and drafts exactly as a single-stage runner does.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch

from ..attention import AttentionMetadata
from ..kernel.frame import RowResult, StepFrame, StepResult
from ..transport import SAMPLED, TokenFrame
from .model_runner import ModelRunner, PendingStep


class StageSlice(NamedTuple):
    """Stage `index` of `count` runs the target's layers [start, end)."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index
    count: int  # type: ignore[assignment]  # a field named like tuple.count
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def split_layers(num_layers: int, count: int) -> list[tuple[int, int]]:
    """Contiguous slices as even as they go, the earlier stages one layer longer."""
    if not 1 <= count <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {count} stages")
    base, extra = divmod(num_layers, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


class HiddenLink:
    """Stage-to-stage p2p of the residual stream on a torch.distributed process group (the
    default one in a stage process). Sends do not wait for the next stage, so a stage moves on
    to the next frame while the one after it still runs this one; a few sends stay in flight.
    `host_staged` (stages sharing a device, on gloo): the stream crosses through host memory."""

    MAX_PENDING = 4

    def __init__(self, group: Any, prev_rank: int | None, next_rank: int | None, host_staged: bool = False) -> None:
        self.group, self.prev_rank, self.next_rank = group, prev_rank, next_rank
        self.host_staged = host_staged
        self.pending: deque[tuple[Any, torch.Tensor]] = deque()

    def send(self, tensor: torch.Tensor) -> None:
        assert self.next_rank is not None
        tensor = tensor.contiguous().to("cpu") if self.host_staged else tensor.contiguous()
        self.pending.append((self.group.send([tensor], self.next_rank, 0), tensor))
        while len(self.pending) > self.MAX_PENDING:
            self.pending.popleft()[0].wait()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert self.prev_rank is not None
        out = torch.empty(shape, dtype=dtype, device="cpu" if self.host_staged else device)
        self.group.recv([out], self.prev_rank, 0).wait()
        return out.to(device, non_blocking=True) if self.host_staged else out

    def flush(self) -> None:
        while self.pending:
            self.pending.popleft()[0].wait()


class StageRunner(ModelRunner):
    def __init__(self, *args: Any, stage: StageSlice, link: HiddenLink, **kwargs: Any) -> None:
        super().__init__(*args, kv_layers=stage.end - stage.start, **kwargs)  # type: ignore[misc]  # args never hold kv_layers
        self.stage, self.link = stage, link
        self.dtype = self.model.norm.weight.dtype
        self.before = sorted(layer for layer in self.hidden_layers if layer < stage.start)
        """Captured layers that earlier stages ran: they travel with the residual stream."""

    def _through(self, meta: AttentionMetadata) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This stage's layers over the stream: embedded here, or received from the stage before."""
        stage, tokens = self.stage, meta.positions.shape[0]
        captured: dict[int, torch.Tensor] = {}
        if stage.first:
            x = self.model.embed(self.input_ids(meta))
        else:
            got = self.link.recv((1 + len(self.before), tokens, self.model.cfg.hidden_size), self.dtype, self.device)
            x = got[0]
            captured = {layer: got[1 + j] for j, layer in enumerate(self.before)}
        x, mine = self.model.forward_layers(x, self.kv_cache, meta, stage.start, self.hidden_layers)
        return x, captured | mine

    def forward(self, meta: AttentionMetadata) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        x, captured = self._through(meta)
        return self.model.norm(x), captured

    def _run(self, frame: StepFrame, idx: list[int],
             results: list[RowResult | None]) -> list[tuple[list[int], PendingStep]]:
        """All rows at once: every stage runs the same rows in the same steps, so a row cannot be
        retried on one stage alone; a failure here ends the stage (and the engine says so)."""
        if not idx:
            return []
        return [(idx, self._launch(msgspec.structs.replace(frame, rows=[frame.rows[i] for i in idx])))]

    def write_frame(self, step: StepFrame, frame: TokenFrame) -> None:
        """The first stage builds the next inputs from the last stage's frame: each sampling row's
        confirmed tokens, then the drafts proposed after them, into the token buffer."""
        for i, row in enumerate(step.rows):
            if row.sampling is None or frame.kinds[i] != SAMPLED:
                continue
            n = int(frame.lengths[i])
            out_pos = row.start_pos + row.num_tokens - row.num_drafts
            drafts = frame.drafts[i][frame.drafts[i] >= 0]
            values = torch.from_numpy(np.concatenate([frame.tokens[i, :n], drafts])).to(self.device)
            end = min(out_pos + len(values), self.pool.width - 1)
            self.pool.tokens[row.slot, out_pos:end] = values[: end - out_pos]

    @torch.inference_mode()
    def launch(self, frame: StepFrame) -> PendingStep:
        if self.stage.last:
            return super().launch(frame)
        meta = self.plan(frame, None)
        self.write_host_tokens(meta)
        if frame.rows:
            x, captured = self._through(meta)
            after = [layer for layer in self.hidden_layers if layer < self.stage.end]
            self.link.send(torch.stack([x, *(captured[layer] for layer in sorted(after))]))
        for r in frame.rows:
            self.pool.completed(r.slot, r.generation, frame.step_id)
        return PendingStep(lambda: StepResult(frame.step_id, []))
