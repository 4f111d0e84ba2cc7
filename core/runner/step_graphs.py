"""Device graphs of decode, verification and lone-prompt steps, captured at start, one per
step shape.

A step of R rows, each with one input token and up to K drafts to verify, pads to the next
captured row bucket and verify width (0 or K): its device work (input gather, forward,
logits, sampling or verification, the token-buffer write, an in-step speculator's pass) is
one graph replay instead of hundreds of kernel launches. A step of one row's prompt (or a
chunk of it) pads to the next captured token bucket, and a step of several prompts (a burst
of arrivals) to the next captured (rows, tokens) prompt bucket, each row's chunk at most the
largest one-row bucket: eagerly, their launches cost the host tens of milliseconds, all of it
time to the first token. The graphs read the runner's persistent
buffers, which the host refills before each replay; padding rows write only to the token
buffer's spare row, padding tokens to no KV slot.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

import torch
from tqdm import tqdm

from .. import log as logmod
from ..attention import AttentionMetadata
from ..kernel.frame import StepFrame
from ..ops.small_batch import MAX_ROWS
from ..platform import DeviceGraph, Platform
from ..sampling_params import MAX_LOGPROBS
from .step_shape import DeviceOutputs, StepDevice, StepShape

log = logmod.get("graphs")

SAMPLING_KINDS = ((True, False), (False, False), (False, True))
"""(all_greedy, any_filter): greedy rows only; sampling without top-k/top-p; with them."""


PREFILL_BUCKETS = (32, 64, 128, 256, 512)
"""Token counts of the captured one-row prompt steps: a longer prompt (or chunk) runs eagerly,
where its launches weigh less next to its compute."""


PROMPT_BATCH_BUCKETS = ((4, 1024), (16, 2048))
"""(rows, tokens) of the captured several-prompt steps: a burst's prompts share a step, each
row's chunk at most the largest one-row bucket, instead of one graph step per prompt."""


def prefill_buckets(max_tokens: int) -> list[int]:
    """The prompt-step buckets a step of at most `max_tokens` tokens can use."""
    return [b for b in PREFILL_BUCKETS if b <= max_tokens]


def prompt_batch_buckets(max_rows: int, max_tokens: int) -> list[tuple[int, int]]:
    """The several-prompt buckets that fit `max_rows` rows and `max_tokens` tokens a step (a
    bucket's tokens are cut to the budget), each over the largest one-row bucket."""
    buckets = {(min(rows, max_rows), min(tokens, max_tokens)) for rows, tokens in PROMPT_BATCH_BUCKETS}
    return sorted(b for b in buckets if b[0] > 1 and b[1] > max(prefill_buckets(max_tokens), default=0))


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 32 beyond: padding never wastes more
    than a few rows where batches are common."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_rows:
        last = sizes[-1]
        sizes.append(last + (4 if last < 8 else 8 if last < 64 else 32))
    return sorted({min(s, max_rows) for s in sizes})


@torch.inference_mode()
def warm_eager(runner: StepDevice, verify_widths: Iterable[int], max_tokens: int = 0) -> int:
    """Two-row eager steps of every sampling kind, plain and verifying: what an eager step
    launches beyond the attention variants (the backend's own warm-up) is built here, at start,
    not by the first request that needs it. Those steps are small enough for the small-batch
    kernels; where a step may hold more tokens (max_tokens), a greedy one-row step of
    small_batch.MAX_ROWS + 1 tokens builds what larger steps launch. Returns the steps run."""
    steps = 0
    shapes = [StepGraphs._shape(2, width, greedy, filt) for width in sorted(set(verify_widths))
              for greedy, filt in SAMPLING_KINDS]
    if max_tokens > MAX_ROWS:
        shapes.append(StepGraphs._prefill_shape(MAX_ROWS + 1, True, False))
    for shape in shapes:
        runner.device_step(runner.plan(StepFrame(-1, []), shape), shape)
        steps += 1
    return steps


class SplitGraph:
    """A step captured in two graphs, the forward and what follows it, so the host can put work
    between them in stream order (`late_masks`: the copy of masks known only after launch)."""

    def __init__(self, body: DeviceGraph, head: DeviceGraph) -> None:
        self.body, self.head = body, head

    def replay(self, between: Callable[[], None] | None = None) -> None:
        self.body.replay()
        if between is not None:
            between()
        self.head.replay()

    def pool(self) -> object:
        return self.head.pool()


class StepGraphs:
    def __init__(self, runner: StepDevice, platform: Platform, max_rows: int, verify_widths: Iterable[int],
                 propose_widths: Iterable[int] = (0,), prefill_tokens: Iterable[int] = (),
                 prompt_batches: Iterable[tuple[int, int]] = (), constrained: Iterable[int] = (),
                 full_sampling: Iterable[int] = ()) -> None:
        self.runner = runner
        self.platform = platform
        self.buckets = row_buckets(max_rows)
        self.verify_widths = sorted(set(verify_widths))
        """Drafts a row verifies (StepShape.verify_width): 0 and K."""
        self.propose_widths = sorted(set(propose_widths))
        """Drafts an in-step speculator proposes inside the step (0: its sync pass)."""
        self.prefill = sorted(set(prefill_tokens))
        """Token buckets of one-row steps without drafts (a prompt, or a chunk of one)."""
        self.prompt_batches = sorted(set(prompt_batches)) if self.prefill else []
        """(rows, tokens) buckets of several-prompt steps, each row at most max(prefill) tokens."""
        self.constrained = sorted(set(constrained))
        """Verify widths of the decode and verification steps captured a second time applying the
        token masks (structured output: K, or the grammar's forced drafts without a speculator);
        with any, the prompt steps are captured applying them too."""
        self.full_sampling = sorted(set(full_sampling))
        """Verify widths of the decode and verification steps captured a third time counting tokens
        for the penalties and computing every row's logprobs (the top MAX_LOGPROBS): a step where
        some row has a penalty or asks for logprobs replays one of those (rows without either come
        out exactly as they would have: their penalties are the identity)."""
        self.graphs: dict[StepShape, tuple[DeviceGraph, DeviceOutputs]] = {}
        self.pool: object | None = None
        self.buffer_ptr = 0
        self.num_replays = 0

    def shapes(self) -> list[StepShape]:
        masks = (False, True) if self.constrained else (False,)
        batches = [self._batch_shape(rows, tokens, greedy, filt, propose, masked) for masked in masks
                   for propose in self.propose_widths for rows, tokens in reversed(self.prompt_batches)
                   for greedy, filt in SAMPLING_KINDS]
        prompts = [self._prefill_shape(tokens, greedy, filt, propose, masked) for masked in masks
                   for propose in self.propose_widths for tokens in reversed(self.prefill)
                   for greedy, filt in SAMPLING_KINDS]
        kinds = [(False, False, self.verify_widths)] + ([(True, False, self.constrained)] if self.constrained else [])
        kinds += [(False, True, self.full_sampling)] if self.full_sampling else []
        return batches + prompts + [self._shape(rows, verify, greedy, filt, propose, masked, full)
                                    for masked, full, widths in kinds for verify in widths
                                    for propose in self.propose_widths for rows in reversed(self.buckets)
                                    for greedy, filt in SAMPLING_KINDS]

    @staticmethod
    def _shape(rows: int, verify: int, all_greedy: bool, any_filter: bool, propose: int = 0,
               constrained: bool = False, full_sampling: bool = False) -> StepShape:
        return StepShape(rows=rows, tokens=rows * (verify + 1), verify_width=verify, max_query_len=verify + 1,
                         all_greedy=all_greedy, any_filter=any_filter, decode_like=True, propose_width=propose,
                         constrained=constrained, any_penalty=full_sampling,
                         logprobs=MAX_LOGPROBS if full_sampling else -1)

    @staticmethod
    def _prefill_shape(tokens: int, all_greedy: bool, any_filter: bool, propose: int = 0,
                       constrained: bool = False) -> StepShape:
        return StepShape(rows=1, tokens=tokens, verify_width=0, max_query_len=tokens, all_greedy=all_greedy,
                         any_filter=any_filter, propose_width=propose, constrained=constrained)

    def _batch_shape(self, rows: int, tokens: int, all_greedy: bool, any_filter: bool, propose: int = 0,
                     constrained: bool = False) -> StepShape:
        return StepShape(rows=rows, tokens=tokens, verify_width=0, max_query_len=max(self.prefill),
                         all_greedy=all_greedy, any_filter=any_filter, propose_width=propose, constrained=constrained)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every shape, largest first (smaller ones reuse its memory), with progress."""
        shapes = self.shapes()
        self.runner.isolate_speculator = False
        try:
            for shape in tqdm(shapes, desc="capturing device graphs", unit="graph", file=sys.stderr, disable=None,
                              leave=False):
                meta = self.runner.plan(StepFrame(-1, []), shape)
                self.graphs[shape] = self._record(meta, shape)
        finally:
            self.runner.isolate_speculator = True
        self.platform.synchronize()
        self.buffer_ptr = self._buffer_ptr()
        log.info("graphs_captured", num_graphs=len(self.graphs), row_buckets=self.buckets,
                 verify_widths=self.verify_widths, prefill_tokens=self.prefill, prompt_batches=self.prompt_batches)

    def _record(self, meta: AttentionMetadata, shape: StepShape) -> tuple[DeviceGraph, DeviceOutputs]:
        for _ in range(2):  # compiles kernels and settles the allocator outside the capture
            self.runner.device_step(meta, shape)
        if shape.constrained and shape.decode_like:  # its masks may come after launch: in two parts
            with self.platform.graph_capture(self.pool) as body:
                hidden, captured = self.runner.device_body(meta, shape)
            self.pool = body.pool()
            with self.platform.graph_capture(self.pool) as head:
                out = self.runner.device_head(meta, shape, hidden, captured)
            self.pool = head.pool()
            return SplitGraph(body, head), out
        with self.platform.graph_capture(self.pool) as graph:
            out = self.runner.device_step(meta, shape)
        self.pool = graph.pool()
        return graph, out

    def splits(self, shape: StepShape) -> bool:
        """The captured shape replays in two parts, with host work between them (`replay`)."""
        return isinstance(self.graphs.get(shape, (None,))[0], SplitGraph)

    def _buffer_ptr(self) -> int:
        return self.runner.attention.buffer.data_ptr()

    def padded(self, shape: StepShape) -> StepShape | None:
        """The captured shape that serves this step, or None (run it eagerly)."""
        full = shape.any_penalty or shape.logprobs >= 0
        if not self.graphs or (full and (shape.constrained or not shape.decode_like or not self.full_sampling)):
            return None
        if shape.constrained and not self.constrained:
            return None
        any_filter = shape.any_filter and not shape.all_greedy
        if shape.decode_like:
            rows = next((b for b in self.buckets if b >= shape.rows), None)
            widths = self.full_sampling if full else self.constrained if shape.constrained else self.verify_widths
            verify = next((w for w in widths if w >= shape.verify_width), None)
            if rows is None or verify is None:
                return None
            padded = self._shape(rows, verify, shape.all_greedy, any_filter, shape.propose_width, shape.constrained,
                                 full)
        elif shape.rows == 1 and shape.verify_width == 0:  # one row's prompt, or a chunk of it
            tokens = next((b for b in self.prefill if b >= shape.tokens), None)
            if tokens is None:
                return None
            padded = self._prefill_shape(tokens, shape.all_greedy, any_filter, shape.propose_width, shape.constrained)
        elif shape.verify_width == 0 and self.prefill and shape.max_query_len <= max(self.prefill):  # several prompts
            bucket = next(((r, t) for r, t in self.prompt_batches if r >= shape.rows and t >= shape.tokens), None)
            if bucket is None:
                return None
            padded = self._batch_shape(*bucket, shape.all_greedy, any_filter, shape.propose_width, shape.constrained)
        else:
            return None
        if self._buffer_ptr() != self.buffer_ptr:  # a bigger step grew the plan buffer the graphs read
            log.warning("graphs_dropped", reason="the step plan buffer was reallocated")
            self.graphs.clear()
            return None
        return padded if padded in self.graphs else None

    @torch.inference_mode()
    def step_costs(self, width: int, propose: int, plain_propose: int,
                   repeats: int = 3) -> dict[int, tuple[float, float]]:
        """Seconds of a plain step (verifying nothing, proposing `plain_propose`) and of a drafting
        one (verifying `width`, proposing `propose`) of greedy rows, for each power-of-two batch
        size up to the largest bucket: the captured graphs, replayed on a fresh padding plan (what
        the speculation governor weighs acceptance against). Sizes without both graphs are left out."""
        costs: dict[int, tuple[float, float]] = {}
        size = 1
        while size <= 2 * self.buckets[-1]:
            rows = next((b for b in self.buckets if b >= size), self.buckets[-1])
            plain = self._shape(rows, 0, True, False, plain_propose)
            drafting = self._shape(rows, width, True, False, propose)
            if plain in self.graphs and drafting in self.graphs:
                costs[size] = (self._seconds(plain, repeats), self._seconds(drafting, repeats))
            if rows == self.buckets[-1]:
                break
            size *= 2
        return costs

    def _seconds(self, shape: StepShape, repeats: int) -> float:
        self.runner.plan(StepFrame(-1, []), shape)
        graph, _ = self.graphs[shape]
        graph.replay()
        self.platform.synchronize()
        started = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        self.platform.synchronize()
        return (time.perf_counter() - started) / repeats

    def replay(self, shape: StepShape, between: Callable[[], None] | None = None) -> DeviceOutputs:
        """Replays the shape's graph; between: issued between its forward and the rest (a shape
        that `splits`)."""
        graph, out = self.graphs[shape]
        if between is not None:
            assert isinstance(graph, SplitGraph), "only a split graph has room between its parts"
            graph.replay(between)
        else:
            graph.replay()
        self.num_replays += 1
        return out
