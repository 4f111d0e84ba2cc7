"""The transport conformance suite: `check_transport(make_pair)` runs a vendor's transport
through what the engine relies on, and raises AssertionError naming the first broken promise.

`make_pair(max_rows, max_k)` returns (sender, receiver, kill): two connected ends and a callable
that makes the sender's side die (its process, or whatever the transport rides on, gone). Each
check takes a fresh pair, since a transport may be unusable after a timeout or a dead peer.

The checks: frames arrive in the order sent with their step identity (step id, keys,
generations, slots) intact; rows of different widths keep their -1 padding; empty and
zero-token placeholder rows stay typed as such; tensors (float32, bfloat16, int64 token ids),
MIN_IN_FLIGHT of them sent before the first is received, arrive in order and equal, interleaved
with frames, even when the sender overwrites its own right after sending; a tensor received for
another step raises StepMismatchError; a receive with nothing sent raises TimeoutError within
its timeout (plus slack); after the peer dies, a receive raises (TimeoutError or
ConnectionError) instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .transport import (
    EMPTY,
    FAILED,
    MIN_IN_FLIGHT,
    PLACEHOLDER,
    SAMPLED,
    StepMismatchError,
    TokenFrame,
    Transport,
)

if TYPE_CHECKING:
    import torch

MakePair = Callable[[int, int], tuple[Transport, Transport, Callable[[], None]]]
SLACK_S = 2.0
"""How much later than its timeout a receive may return."""


def sample_frame(step_id: int, max_rows: int, max_k: int) -> TokenFrame:
    """A frame with every row kind: sampled rows of varying width, a placeholder, a failed row,
    and empty rows past them; values that name their step, row and column."""
    frame = TokenFrame.empty(step_id, max_rows, max_k)
    n = max_rows - 1
    for i in range(n):
        frame.req_ids[i], frame.generations[i], frame.slots[i] = 100 * step_id + i, 7 + step_id, (i * 3) % max_rows
        kind = PLACEHOLDER if i == 1 else FAILED if i == 2 else SAMPLED
        frame.kinds[i] = kind
        if kind != SAMPLED:
            continue
        width = 1 + (step_id + i) % (1 + max_k)
        frame.tokens[i, :width] = 10_000 * step_id + 100 * i + np.arange(width)
        frame.lengths[i], frame.accepted[i] = width, width - 1
        drafts = (step_id + 2 * i) % (max_k + 1)
        frame.drafts[i, :drafts] = 20_000 + np.arange(drafts)
    return frame


def _same(got: TokenFrame, want: TokenFrame) -> None:
    for field in ("req_ids", "generations", "slots", "kinds", "tokens", "accepted", "lengths", "drafts"):
        a, b = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert a.shape == b.shape and np.array_equal(a, b), \
            f"step {want.step_id}: {field} differs after the transport: {a.tolist()} != {b.tolist()}"
    assert got.step_id == want.step_id, f"frame for step {want.step_id} arrived as step {got.step_id}"
    assert got.k0 == want.k0, f"step {want.step_id}: k0 flag lost"


def check_ordering(make_pair: MakePair, max_rows: int = 5, max_k: int = 3) -> None:
    tx, rx, _ = make_pair(max_rows, max_k)
    try:
        sent = [sample_frame(step, max_rows, max_k) for step in range(8)]
        for frame in sent:
            tx.send_frame(frame)
        for want in sent:
            _same(rx.recv_frame(timeout_s=10.0), want)
    finally:
        tx.close()
        rx.close()


def check_row_kinds(make_pair: MakePair, max_rows: int = 4, max_k: int = 4) -> None:
    """Placeholder, failed and empty rows come back as themselves, with no tokens."""
    tx, rx, _ = make_pair(max_rows, max_k)
    try:
        frame = sample_frame(3, max_rows, max_k)
        tx.send_frame(frame)
        got = rx.recv_frame(timeout_s=10.0)
        _same(got, frame)
        kinds = got.kinds.tolist()
        assert kinds[1] == PLACEHOLDER and kinds[2] == FAILED and kinds[-1] == EMPTY, kinds
        assert got.lengths[1] == 0 and (got.tokens[1] == -1).all(), "a placeholder row carries tokens"
        assert got.req_ids[-1] == -1, "an empty row names a request"
        only_empty = TokenFrame.empty(4, max_rows, max_k)
        tx.send_frame(only_empty)
        _same(rx.recv_frame(timeout_s=10.0), only_empty)
    finally:
        tx.close()
        rx.close()


def _tensors(step: int) -> list[torch.Tensor]:
    """What one step sends: a residual stream slice (float32, and bfloat16, which numpy lacks)
    and token ids, with values that name their step."""
    import torch  # the suite's tensor checks only: the frame checks run without torch

    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * step
    return [hidden, (hidden / 7).to(torch.bfloat16)[0], torch.arange(5, dtype=torch.int64) + 1000 * step]


def check_tensors(make_pair: MakePair, max_rows: int = 2, max_k: int = 1) -> None:
    """Tensors arrive in order, equal, of their dtype, interleaved with frames; the sender
    overwrites its own right after each send (the transport read it in stream order)."""
    tx, rx, _ = make_pair(max_rows, max_k)
    steps = MIN_IN_FLIGHT // len(_tensors(0))  # as many in flight as a sender may send without waiting
    try:
        for step in range(steps):
            for tensor in _tensors(step):
                tx.send_tensor(step, tensor)
                tensor.zero_()
            tx.send_frame(sample_frame(step, max_rows, max_k))
        for step in range(steps):
            _same(rx.recv_frame(timeout_s=10.0), sample_frame(step, max_rows, max_k))
            for want in _tensors(step):
                got = rx.recv_tensor(step, tuple(want.shape), want.dtype, timeout_s=10.0)
                assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
                    f"step {step}: a {want.dtype} {tuple(want.shape)} tensor arrived as {got.dtype} {tuple(got.shape)}"
                assert bool((got.cpu() == want).all()), \
                    f"step {step}: a {want.dtype} tensor changed in transit (or was read after the sender overwrote it)"
    finally:
        tx.close()
        rx.close()


def check_step_ids(make_pair: MakePair) -> None:
    """A tensor sent for one step and received as another's is a StepMismatchError, not data."""
    import torch  # the suite's tensor checks only: the frame checks run without torch

    tx, rx, _ = make_pair(2, 1)
    try:
        tx.send_tensor(3, torch.ones(4))
        try:
            rx.recv_tensor(4, (4,), torch.float32, timeout_s=10.0)
        except StepMismatchError:
            pass
        else:
            raise AssertionError("a tensor sent for step 3 was received as step 4's")
    finally:
        tx.close()
        rx.close()


def _times_out(receive: Callable[[], object], what: str, timeout_s: float, dead: bool = False) -> None:
    started = time.monotonic()
    try:
        receive()
    except TimeoutError:
        pass
    except ConnectionError:
        if not dead:
            raise AssertionError(f"{what} raised ConnectionError while its peer was alive") from None
    else:
        raise AssertionError(f"{what} returned something nobody sent" + (" after its peer died" if dead else ""))
    waited = time.monotonic() - started
    assert waited < timeout_s + SLACK_S, f"{what}(timeout_s={timeout_s}) took {waited:.1f} s" + (
        " after its peer died" if dead else "")


def check_timeout(make_pair: MakePair, timeout_s: float = 0.3) -> None:
    import torch  # the suite's tensor checks only: the frame checks run without torch

    tx, rx, _ = make_pair(2, 1)
    try:
        _times_out(lambda: rx.recv_frame(timeout_s=timeout_s), "recv_frame", timeout_s)
        _times_out(lambda: rx.recv_tensor(0, (4,), torch.float32, timeout_s=timeout_s), "recv_tensor", timeout_s)
        tx.send_frame(sample_frame(0, 2, 1))  # a timed-out end still works
        _same(rx.recv_frame(timeout_s=10.0), sample_frame(0, 2, 1))
    finally:
        tx.close()
        rx.close()


def check_dead_peer(make_pair: MakePair, timeout_s: float = 1.0) -> None:
    import torch  # the suite's tensor checks only: the frame checks run without torch

    tx, rx, kill = make_pair(2, 1)
    try:
        tx.send_frame(sample_frame(0, 2, 1))
        _same(rx.recv_frame(timeout_s=10.0), sample_frame(0, 2, 1))
        kill()
        _times_out(lambda: rx.recv_frame(timeout_s=timeout_s), "recv_frame", timeout_s, dead=True)
        _times_out(lambda: rx.recv_tensor(0, (4,), torch.float32, timeout_s=timeout_s), "recv_tensor", timeout_s,
                   dead=True)
    finally:
        rx.close()


CHECKS = (check_ordering, check_row_kinds, check_tensors, check_timeout, check_dead_peer)


def check_transport(make_pair: MakePair, carries_step_ids: bool = True) -> None:
    """Every check, each on a fresh pair; `carries_step_ids=False` skips the step-id check for a
    transport whose tensors carry no step id (the engine then relies on order alone)."""
    for check in CHECKS:
        check(make_pair)
    if carries_step_ids:
        check_step_ids(make_pair)
