"""Data parallelism: the engine-core ranks' one collective per step.

Every rank steps in lockstep. Before launching a step, each contributes [rows, needs_drafts,
has_work, stopping] to one all-reduce (MAX): drafts are skipped (K=0) only if no rank needs
them (an AND, spelled as MAX of the negation), and the ranks idle or stop together. A rank with
no frame runs a dummy step and votes "drafts needed", as the K=0 RFC says: an idle rank disables
the skip for that step (`votes_to_skip`).

The padded batch size (the largest rank's rows) is agreed and reported, never padded to: ranks
pad where a collective inside the forward needs every rank's batch to have one shape (expert
parallelism's all-to-all). Here each rank's forward is its own model on its own batch, with no
collective in it, so padding would only add work; a rank's device graphs already pad to their
own bucket. `num_padding_rows` counts what padding would have cost (the ranks' imbalance).

The group is gloo over a TCPStore on the host rank 0 names (`data_parallel_port`), constructed
directly rather than as torch.distributed's default group, so several ranks can live in one
process (in-process engines, tests). The store also carries the idle ranks' wake-up: a rank that
gets a message while every rank idles sets a key the others wait on, so a request arriving at
one rank is not held back by a sleeping peer.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..errors import EngineDeadError
from ..kernel.frame import StepFrame

TIMEOUT_S = 30.0
"""A rank that does not join a step's all-reduce within this is dead or hung."""
IDLE_WAKE_S = 0.5
"""With no work on any rank: the longest a rank waits for a message (its own, or a peer's wake-up
through the store) before the ranks vote again. A wake-up ends the wait at once; this only bounds
how long a rank that is told to shut down waits for its peers to hear of it."""


class Agreement(NamedTuple):
    padded_rows: int
    skip_drafts: bool
    any_work: bool
    stopping: bool


class Vote(NamedTuple):
    """One step of one rank: whether it ran a dummy step, its K=0 vote, what the ranks agreed."""

    dummy: bool
    skip: bool
    agreed: bool


def votes_to_skip(frame: StepFrame | None) -> bool:
    """This rank's K=0 vote for the step it is about to launch: yes only for a frame whose drafts
    no request can use. A rank running a dummy step (no frame) votes no, so an idle rank disables
    the skip for that step (the K=0 RFC's rule)."""
    return frame is not None and frame.skip_drafts


def rank_threads(size: int) -> int:
    """Intra-op CPU threads for one rank process of `size` on this host: a share of the cores, as
    pipeline stages get, so ranks do not oversubscribe the CPUs (spinning OpenMP workers)."""
    return max(1, (os.cpu_count() or 1) // size)


class DataParallelGroup:
    def __init__(self, rank: int, size: int, port: int, host: str = "127.0.0.1",
                 join_timeout_s: float = TIMEOUT_S) -> None:
        """`join_timeout_s`: how long the ranks wait for each other to form the group; they get
        there after loading and capturing graphs, which on a GPU can take longer than a step may."""
        self.rank, self.size = rank, size
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        join = datetime.timedelta(seconds=max(join_timeout_s, TIMEOUT_S))
        self.store = dist.TCPStore(host, port, size, rank == 0, timeout=join, wait_for_workers=False)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("speckernel-dp", self.store), rank, size, timeout)
        self.wakes = dist.PrefixStore("speckernel-dp-wake", self.store)
        # Its own connection: a client blocked in wait() holds its socket, so a wake() through
        # the same one would wait for that wait to time out.
        self.wake_waits = dist.PrefixStore("speckernel-dp-wake", dist.TCPStore(
            host, port, size, False, timeout=join, wait_for_workers=False))
        self.buf = torch.zeros(4, dtype=torch.int64)
        self.num_steps = 0
        self.num_dummy_steps = 0
        self.num_padding_rows = 0
        """Rows this rank would have padded its batches with to the agreed size (see the module doc)."""
        self.vote_s = 0.0
        """Seconds of the timed turns spent in the all-reduce: waiting for the slowest rank, plus
        the collective."""
        self.turn_s = 0.0
        """Seconds of the loop's turns, vote to vote, idle waits left out (turn period: turn_s
        over the turns it counts, `num_timed_turns`)."""
        self.num_timed_turns = 0
        self._turn_started = 0.0
        self._stale_wake: str | None = None

    def agree(self, rows: int, needs_drafts: bool, has_work: bool, stopping: bool) -> Agreement:
        started = time.perf_counter()
        self.buf[0], self.buf[1], self.buf[2], self.buf[3] = rows, int(needs_drafts), int(has_work), int(stopping)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch types the enum member apart
        try:
            self.group.allreduce([self.buf], opts).wait()  # type: ignore[attr-defined]  # the group's C++ method, unstubbed
        except RuntimeError as e:
            raise EngineDeadError(f"data-parallel rank {self.rank}: a peer rank is gone ({e})") from None
        now = time.perf_counter()
        if self._turn_started:
            self.turn_s += now - self._turn_started
            self.vote_s += now - started
            self.num_timed_turns += 1
        self._turn_started = now
        self.num_steps += 1
        got = self.buf.tolist()
        self.num_padding_rows += got[0] - rows if rows else 0
        if self._stale_wake is not None and self.rank == 0:  # every rank has left that idle wait
            self.wakes.delete_key(self._stale_wake)
            self._stale_wake = None
        return Agreement(padded_rows=got[0], skip_drafts=not got[1], any_work=bool(got[2]), stopping=bool(got[3]))

    def wake_key(self) -> str:
        """The key of this idle turn: the same on every rank, since they vote in lockstep. The
        idle wait is no part of a turn's time: the next turn is timed from its vote."""
        key = str(self.num_steps)
        self._stale_wake = key
        self._turn_started = 0.0
        return key

    def wake(self, key: str) -> None:
        """This rank has a message: the ranks waiting on `key` stop idling."""
        self.wakes.set(key, "1")

    def wait_for_wake(self, key: str, timeout_s: float) -> bool:
        """Blocks until a rank sets `key` or the timeout passes; whether it was set."""
        try:
            self.wake_waits.wait([key], datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError):  # the timeout (or the store is gone: the next vote says)
            return False
        return True

    def stats(self) -> dict[str, float | int]:
        return {"rank": self.rank, "size": self.size, "num_steps": self.num_steps,
                "num_dummy_steps": self.num_dummy_steps, "num_padding_rows": self.num_padding_rows,
                "vote_s": self.vote_s, "turn_s": self.turn_s, "num_timed_turns": self.num_timed_turns}
