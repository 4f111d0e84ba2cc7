"""One pipeline stage's runner: the ModelRunner over a contiguous slice of the target's layers.

A stage is the single-stage runner on fewer layers (the same plan copy, kernels and captured
step graphs), never a second, slower one. Every stage plans each step from the same StepFrame
and keeps its own token buffer and the KV of its own layers. The first stage gathers the input
ids and embeds them; each stage runs its layers and hands the residual stream on; the last
stage applies the final norm, then samples, verifies and drafts exactly as a single stage does.

A step's two edges sit outside its captured graph, in stream order around the replay:
- in: the residual stream of the stage before (`receive`, `TensorLink.recv_tensor`) is copied
  into a persistent buffer the graph reads (`stream_in`);
- out: the graph leaves its stream in a persistent buffer (`stream_out`), sent on with
  `send_tensor` right after the replay.
On the fused path the stream travels as its two parts (h, residual), so a split model rounds
exactly as the whole one does; elsewhere residual is zero. The path follows the step's padded
token count, the same on every stage while they replay the same graph shapes; where they do not
(one stage's capture failed), a receiver on the other path still reads the stream h + residual.
The captured layers a speculator reads travel with it.

The last stage sends the first, device to device, what the step wrote into its token buffer (a
window of each sampling row from its output position: confirmed tokens, then the drafts behind
them), with the slot and position to write it at (`TOKEN_COLUMNS`). The first stage writes
that window into its own buffer before a step that reads it (`_take_tokens`), so no token ever
crosses the host on its way to the next step's input.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import msgspec
import torch

from ..attention import AttentionMetadata
from ..kernel.frame import RowResult, StepFrame, StepResult
from .model_runner import ModelRunner, PendingStep
from .step_plan import STEP, Col
from .step_shape import DeviceOutputs, StepShape

TOKEN_COLUMNS = 2
"""Columns before a token window: the row's slot, then where the window goes (the spare column
for a row that sampled nothing)."""


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


class TensorLink(Protocol):
    """A device tensor edge between two stages, in the stream order of both ends: the send is
    issued after the work that wrote the tensor, the received tensor is ready for the work
    issued after `recv_tensor` returns. Neither end waits on the host for the device."""

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None: ...

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor: ...


class StageLinks(NamedTuple):
    prev: TensorLink | None = None
    """The residual stream from the stage before (every stage but the first)."""
    next: TensorLink | None = None
    """The residual stream to the stage after (every stage but the last)."""
    tokens: TensorLink | None = None
    """Token windows: the last stage sends them to the first, which receives them."""


class StageRunner(ModelRunner):
    def __init__(self, *args: Any, stage: StageSlice, links: StageLinks, hidden_layers: tuple[int, ...] = (),
                 **kwargs: Any) -> None:
        super().__init__(*args, kv_layers=stage.end - stage.start, **kwargs)  # type: ignore[misc]  # args never hold kv_layers
        self.stage, self.links = stage, links
        if not stage.last:
            self.mask_widths = ()
        if not stage.last:  # the last stage's are its speculator's; the others carry them there
            self.hidden_layers = tuple(hidden_layers)
        self.dtype = self.model.norm.weight.dtype
        self.before = sorted(layer for layer in self.hidden_layers if layer < stage.start)
        """Captured layers that earlier stages ran: they arrive with the residual stream."""
        self.after = sorted(layer for layer in self.hidden_layers if layer < stage.end)
        """Captured layers that leave with the residual stream (a stage that is not the last)."""
        width = self.model.cfg.hidden_size
        self.stream_in = None if stage.first else torch.zeros(
            2 + len(self.before), self.max_tokens, width, dtype=self.dtype, device=self.device)
        """[h, residual, captured layers..., tokens, H]: what the step's graph reads."""
        self.stream_out = None if stage.last else torch.zeros(
            2 + len(self.after), self.max_tokens, width, dtype=self.dtype, device=self.device)
        """[h, residual, captured layers..., tokens, H]: what the step's graph leaves."""
        k = int(kwargs.get("num_speculative_tokens", 0))
        self.window = torch.arange(1 + 2 * k, device=self.device)
        """Token buffer positions a step may write per row from its output position: up to K + 1
        confirmed tokens, then up to K drafts."""
        self.no_output = torch.zeros(0, 3, dtype=torch.int64, device=self.device)
        self.unapplied: dict[int, tuple[int, frozenset[int]]] = {}
        """First stage: steps it launched whose token window it has not written yet, in step
        order: their rows and the slots of the rows that sample."""
        self.last_meta: AttentionMetadata | None = None

    # --- the step's device work --------------------------------------------------------------

    def plan(self, frame: StepFrame, padded: StepShape | None) -> AttentionMetadata:
        self.last_meta = super().plan(frame, padded)
        return self.last_meta

    def forward(self, meta: AttentionMetadata) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """This stage's layers over the stream (embedded here, or as the stage before left it);
        the last stage's final-norm hidden states, another stage's stream (left in `stream_out`)."""
        tokens = meta.positions.shape[0]
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        if self.stream_in is None:
            x = self.model.embed(self.input_ids(meta))
        else:
            # The stream is h + residual as sent (residual zero where the sender's path carries
            # none): split it goes on as it came; a path that carries one tensor adds the two.
            x = self.stream_in[0, :tokens]
            if self.model.splits_residual(x):
                residual = self.stream_in[1, :tokens]
            else:
                x = x + self.stream_in[1, :tokens]
            captured = {layer: self.stream_in[2 + j, :tokens] for j, layer in enumerate(self.before)}
        h, residual, mine = self.model.forward_layers(x, self.kv_cache, meta, self.stage.start, self.hidden_layers,
                                                      residual)
        captured |= mine
        if self.stream_out is None:
            return self.model.final_norm(h, residual), captured
        self.stream_out[0, :tokens].copy_(h)
        if residual is not None:
            self.stream_out[1, :tokens].copy_(residual)
        else:
            self.stream_out[1, :tokens].zero_()
        for j, layer in enumerate(self.after):
            self.stream_out[2 + j, :tokens].copy_(captured[layer])
        return h, captured

    def device_step(self, meta: AttentionMetadata, shape: StepShape,
                    logprob_rows: torch.Tensor | None = None) -> DeviceOutputs:
        """The last stage's is the single stage's; another stage's only runs its layers."""
        if self.stage.last:
            return super().device_step(meta, shape, logprob_rows)
        hidden, _ = self.forward(meta)
        return DeviceOutputs(self.no_output, hidden, {})

    def receive(self, frame: StepFrame) -> None:
        """The step's in-edge: the stage before's stream, into the buffer the step reads."""
        if self.stream_in is None:
            return
        assert self.links.prev is not None
        n = frame.num_tokens
        got = self.links.prev.recv_tensor(frame.step_id, (self.stream_in.shape[0], n, self.stream_in.shape[2]),
                                          self.dtype)
        self.stream_in[:, :n].copy_(got)

    # --- launching -----------------------------------------------------------------------------

    def _run(self, frame: StepFrame, idx: list[int],
             results: list[RowResult | None]) -> list[tuple[list[int], PendingStep]]:
        """All rows at once: every stage runs the same rows in the same steps, so a row cannot be
        retried on one stage alone; a failure here ends the stage (and the engine says so)."""
        if not idx:
            return []
        return [(idx, self._launch(msgspec.structs.replace(frame, rows=[frame.rows[i] for i in idx])))]

    @torch.inference_mode()
    def launch(self, frame: StepFrame) -> PendingStep:
        if self.stage.last:
            return super().launch(frame)
        if self.stage.first:
            self._take_tokens(frame)
        if frame.rows:
            self._launch_layers(frame)
        return PendingStep(lambda: StepResult(frame.step_id, []))

    def _launch(self, frame: StepFrame) -> PendingStep:
        """The last stage: the single stage's step, then its token window to the first stage."""
        pending = super()._launch(frame)
        self._send_tokens(frame)
        return pending

    def _launch_layers(self, frame: StepFrame) -> None:
        """A stage before the last: plan, in-edge, the step (replayed or eager), out-edge."""
        shape = self.step_shape(frame)
        padded = self.padded(frame, shape)
        meta = self.plan(frame, padded)
        self.write_host_tokens(meta)
        self.receive(frame)
        if padded is not None:
            assert self.graphs is not None
            self.graphs.replay(padded)
        else:
            self.device_step(meta, shape)
        assert self.stream_out is not None and self.links.next is not None
        self.links.next.send_tensor(frame.step_id, self.stream_out[:, : frame.num_tokens].contiguous())
        for r in frame.rows:
            self.pool.completed(r.slot, r.generation, frame.step_id)
        if self.stage.first:
            self.unapplied[frame.step_id] = (len(frame.rows),
                                             frozenset(r.slot for r in frame.rows if r.sampling is not None))

    # --- the token windows ---------------------------------------------------------------------

    def _send_tokens(self, frame: StepFrame) -> None:
        """[rows, TOKEN_COLUMNS + window] to the first stage, read from this stage's token buffer
        after the step and its drafting pass wrote it (stream order: no host sync)."""
        if self.stage.first:
            return
        meta = self.last_meta
        assert meta is not None and self.links.tokens is not None
        plan, n = STEP.on_device(meta), len(frame.rows)
        slot = STEP.of(plan, Col.SLOT)[:n].to(torch.int64)
        out_pos = STEP.of(plan, Col.OUT_POS)[:n].to(torch.int64)
        samples = STEP.of(plan, Col.SAMPLES)[:n] > 0
        spare = self.pool.width - 1
        window = self.pool.tokens[slot[:, None], (out_pos[:, None] + self.window[None, :]).clamp(max=spare)]
        start = torch.where(samples, out_pos, spare)
        self.links.tokens.send_tensor(frame.step_id, torch.cat([slot[:, None], start[:, None], window], dim=1))

    def _take_tokens(self, frame: StepFrame) -> None:
        """Writes, in step order, the token windows of the steps this frame depends on: those whose
        output its rows read, those that sampled into a slot it now uses (a window written late
        would land on the slot's new owner), and every step `count` or more before it (the
        engine core applied those before it scheduled this one, so their windows were sent)."""
        slots = {r.slot for r in frame.rows}
        need = max([frame.step_id - self.stage.count, *(r.prev_step_id for r in frame.rows)])
        for step_id, (_, sampled) in self.unapplied.items():
            if sampled & slots:
                need = max(need, step_id)
        assert self.links.tokens is not None
        while self.unapplied and (step_id := next(iter(self.unapplied))) <= need:
            rows, _ = self.unapplied.pop(step_id)
            got = self.links.tokens.recv_tensor(step_id, (rows, TOKEN_COLUMNS + len(self.window)), torch.int64)
            self.pool.write(got[:, 0], got[:, 1], got[:, TOKEN_COLUMNS:])
