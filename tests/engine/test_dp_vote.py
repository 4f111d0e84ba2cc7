"""The data-parallel vote as the K=0 RFC states it ("a rank running a dummy batch votes no, so an
idle DP rank disables the skip for that step"), on two real gloo ranks: the ranks skip drafts
only when every rank has a frame that can skip them. And the idle ranks' wake-up: a message at
one rank ends the others' wait at once, not after a poll interval."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from speckernel.engine.data_parallel import Agreement, DataParallelGroup, votes_to_skip
from speckernel.frontend.dp_client import free_port
from speckernel.kernel.frame import StepFrame


def frame(skip: bool) -> StepFrame:
    return StepFrame(step_id=0, rows=[], skip_drafts=skip)


@pytest.fixture(scope="module")
def groups() -> list[DataParallelGroup]:
    port = free_port()
    made: list[Any] = [None, None]

    def build(r: int) -> None:
        made[r] = DataParallelGroup(r, 2, port)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return made


def both(groups: list[DataParallelGroup], call: Callable[[int, DataParallelGroup], Any]) -> list[Any]:
    """`call` on both ranks at once (each blocks in the collective until the other joins)."""
    got: list[Any] = [None, None]
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, call(r, groups[r]))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def vote(groups: list[DataParallelGroup], frames: list[StepFrame | None]) -> list[Agreement]:
    return both(groups, lambda r, g: g.agree(len(frames[r].rows) if frames[r] else 0, not votes_to_skip(frames[r]),
                                             frames[r] is not None, False))


@pytest.mark.parametrize(("frames", "skip"), [
    ((frame(True), frame(True)), True),  # every rank's frame can skip: K=0
    ((frame(True), frame(False)), False),  # one rank's requests need drafts
    ((None, frame(True)), False),  # an idle rank (dummy step) votes no: the skip is off for every rank
    ((frame(True), None), False),
    ((None, None), False),  # no rank has a frame: nothing to skip, and the dummies vote no
])
def test_ranks_skip_drafts_only_when_every_rank_has_a_frame_that_can(groups, frames, skip: bool) -> None:  # type: ignore[no-untyped-def]
    agreed = vote(groups, list(frames))
    assert [a.skip_drafts for a in agreed] == [skip, skip]


def test_a_dummy_step_votes_that_drafts_are_needed() -> None:
    assert votes_to_skip(None) is False
    assert votes_to_skip(frame(True)) is True and votes_to_skip(frame(False)) is False


def test_the_agreement_reports_padding_and_times_the_vote(groups) -> None:  # type: ignore[no-untyped-def]
    before = [(g.num_padding_rows, g.vote_s, g.num_steps) for g in groups]
    agreed = both(groups, lambda r, g: g.agree(3 if r == 0 else 1, True, True, False))
    assert [a.padded_rows for a in agreed] == [3, 3]
    assert groups[1].num_padding_rows - before[1][0] == 2 and groups[0].num_padding_rows == before[0][0]
    assert all(g.vote_s > b[1] and g.num_steps == b[2] + 1 for g, b in zip(groups, before, strict=True))


def test_a_message_at_one_rank_wakes_the_idle_ranks_at_once(groups) -> None:  # type: ignore[no-untyped-def]
    """Both ranks wait (as idle ranks do); rank 1 gets a message and wakes them, its own wait
    included: a wake that queued behind its own rank's wait would end only at the timeout."""
    keys = both(groups, lambda r, g: g.wake_key())
    assert keys[0] == keys[1]  # the ranks vote in lockstep, so they wait on one key
    waited: dict[int, float] = {}

    def wait(r: int) -> None:
        started = time.monotonic()
        assert groups[r].wait_for_wake(keys[r], 20.0)
        waited[r] = time.monotonic() - started

    waiters = [threading.Thread(target=wait, args=(r,)) for r in range(2)]
    for t in waiters:
        t.start()
    time.sleep(0.2)
    woke = time.monotonic()
    groups[1].wake(keys[1])
    assert time.monotonic() - woke < 5.0, "the wake waited for its own rank's wait"
    for t in waiters:
        t.join(20)
    assert sorted(waited) == [0, 1] and all(0.15 < w < 5.0 for w in waited.values()), waited
    assert not groups[0].wait_for_wake("never-set", 0.05)  # no message anywhere: the wait times out
