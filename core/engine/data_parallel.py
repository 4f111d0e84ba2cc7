"""Data parallelism: the engine-core ranks' one collective per step.

Every rank steps in lockstep. Before running a step, each contributes [rows, needs_drafts,
has_work, stopping] to one all-reduce (MAX): the padded batch size is the largest rank's rows
(what device graphs would pad to), drafts are skipped (K=0) only if no rank needs them (an AND,
spelled as MAX of the negation), and the ranks idle or stop together. A rank with no work runs a
dummy step: it joins the all-reduce voting "no drafts needed", so it never blocks the others.

The group is gloo over a TCPStore on the host rank 0 names (`data_parallel_port`), constructed
directly rather than as torch.distributed's default group, so several ranks can live in one
process (in-process engines, tests).
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..errors import EngineDeadError

TIMEOUT_S = 30.0
"""A rank that does not join a step's all-reduce within this is dead or hung."""


class Agreement(NamedTuple):
    padded_rows: int
    skip_drafts: bool
    any_work: bool
    stopping: bool


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
        self.buf = torch.zeros(4, dtype=torch.int64)
        self.num_steps = 0
        self.num_dummy_steps = 0

    def agree(self, rows: int, needs_drafts: bool, has_work: bool, stopping: bool) -> Agreement:
        self.buf[0], self.buf[1], self.buf[2], self.buf[3] = rows, int(needs_drafts), int(has_work), int(stopping)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch types the enum member apart
        try:
            self.group.allreduce([self.buf], opts).wait()  # type: ignore[attr-defined]  # the group's C++ method, unstubbed
        except RuntimeError as e:
            raise EngineDeadError(f"data-parallel rank {self.rank}: a peer rank is gone ({e})") from None
        self.num_steps += 1
        got = self.buf.tolist()
        return Agreement(padded_rows=got[0], skip_drafts=not got[1], any_work=bool(got[2]), stopping=bool(got[3]))
