"""The transport conformance suite: `check_transport(make_pair)` runs a vendor's transport
through what the engine relies on, and raises AssertionError naming the first broken promise.

`make_pair(max_rows, max_k)` returns (sender, receiver, kill): two connected ends and a callable
that makes the sender's side die (its process, or whatever the transport rides on, gone). Each
check takes a fresh pair, since a transport may be unusable after a timeout or a dead peer.

The checks: frames arrive in the order sent with their step identity (step id, keys,
generations, slots) intact; rows of different widths keep their -1 padding; empty and
zero-token placeholder rows stay typed as such; hidden states round-trip; a receive with
nothing sent raises TimeoutError within its timeout (plus slack); after the peer dies, a receive
raises (TimeoutError or ConnectionError) instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .transport import EMPTY, FAILED, PLACEHOLDER, SAMPLED, TokenFrame, Transport

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


def check_tensors(make_pair: MakePair, max_rows: int = 2, max_k: int = 1) -> None:
    """Tensors arrive in order, equal, of their dtype (bfloat16 too), and the sender may overwrite
    its own right after sending."""
    import torch  # the suite's tensor checks only: the frame checks run without torch

    tx, rx, _ = make_pair(max_rows, max_k)
    try:
        hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
        tx.send_tensor(5, hidden)
        hidden.zero_()
        got = rx.recv_tensor(5, (2, 3, 4), torch.float32, timeout_s=10.0)
        assert torch.equal(got.cpu(), torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)), \
            "a tensor changed in transit (or the transport read it after the sender overwrote it)"
    finally:
        tx.close()
        rx.close()


def check_timeout(make_pair: MakePair, timeout_s: float = 0.3) -> None:
    tx, rx, _ = make_pair(2, 1)
    try:
        started = time.monotonic()
        try:
            rx.recv_frame(timeout_s=timeout_s)
        except TimeoutError:
            pass
        else:
            raise AssertionError("recv_frame returned a frame nobody sent")
        waited = time.monotonic() - started
        assert waited < timeout_s + SLACK_S, f"recv_frame(timeout_s={timeout_s}) took {waited:.1f} s"
    finally:
        tx.close()
        rx.close()


def check_dead_peer(make_pair: MakePair, timeout_s: float = 1.0) -> None:
    tx, rx, kill = make_pair(2, 1)
    try:
        tx.send_frame(sample_frame(0, 2, 1))
        _same(rx.recv_frame(timeout_s=10.0), sample_frame(0, 2, 1))
        kill()
        started = time.monotonic()
        try:
            rx.recv_frame(timeout_s=timeout_s)
        except (TimeoutError, ConnectionError):
            pass
        else:
            raise AssertionError("recv_frame returned a frame after its peer died")
        waited = time.monotonic() - started
        assert waited < timeout_s + SLACK_S, f"a dead peer kept recv_frame waiting {waited:.1f} s"
    finally:
        rx.close()


CHECKS = (check_ordering, check_row_kinds, check_tensors, check_timeout, check_dead_peer)


def check_transport(make_pair: MakePair) -> None:
    """Every check, each on a fresh pair."""
    for check in CHECKS:
        check(make_pair)
