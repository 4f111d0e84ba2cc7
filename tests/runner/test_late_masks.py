"""A late mask (`runner.late_masks`): the step is launched before its row's mask is known, the
host writes the mask once the launch waits at the gate between forward and sampling, and the
sampling obeys it. The mask allows one token the free step would not pick, so a copy issued
before the gate (the mask not yet written) samples the free token and fails."""

from __future__ import annotations

import threading
import time

from speckernel.kernel.frame import ScheduledRow, StepFrame, StepResult
from speckernel.platforms.gate import HostWaitGate
from speckernel.runner.late_masks import LateMasks
from tests.runner.test_step_graphs import TINY, bitmask, blocks, runner, sampling

PROMPT = [3, 14, 15, 9, 26, 5]


def prompt_then(decode: ScheduledRow) -> tuple[StepFrame, StepFrame]:
    return (StepFrame(0, [ScheduledRow(0, 0, 0, 0, PROMPT, blocks(0), sampling(0, 0))]),
            StepFrame(1, [decode]))


def test_a_late_mask_written_after_launch_constrains_the_sampling() -> None:
    row = ScheduledRow(0, 0, 0, len(PROMPT), [], blocks(0), sampling(0, 1), num_placeholder_inputs=1)
    free = runner(False)
    first, decode = prompt_then(row)
    free.execute(first)
    token = free.execute(decode).rows[0].sampled[0]
    allowed = (token + 1) % TINY.vocab_size

    late_runner = runner(False)
    first, decode = prompt_then(ScheduledRow(0, 0, 0, len(PROMPT), [], blocks(0), sampling(0, 1),
                                             num_placeholder_inputs=1, mask_later=True))
    late_runner.execute(first)
    late = late_runner.late_masks[1] = LateMasks(HostWaitGate(timeout_s=10.0))
    got: list[StepResult] = []
    launch = threading.Thread(target=lambda: got.append(late_runner.launch(decode).result()))
    launch.start()
    deadline = time.monotonic() + 10.0
    while not late.gate.blocked_at and time.monotonic() < deadline:  # the forward ran; the sampling waits
        time.sleep(0.001)
    assert late.gate.blocked_at, "the launch never reached the gate"
    late.deliver([bitmask({allowed})], launch_ended=lambda: False)
    launch.join(10.0)
    assert not late.gate.timed_out
    assert got and got[0].rows[0].sampled == [allowed], (token, allowed, got)
    assert 1 not in late_runner.late_masks, "the launch took its late masks"


def test_a_frame_with_late_rows_and_nobody_to_fill_them_fails_its_rows() -> None:
    """A launch tried again after a failure (or a frame nobody registered masks for) must not
    sample without the grammar: its late rows fail with a message instead."""
    r = runner(False)
    first, decode = prompt_then(ScheduledRow(0, 0, 0, len(PROMPT), [], blocks(0), sampling(0, 1),
                                             num_placeholder_inputs=1, mask_later=True))
    r.execute(first)
    result = r.execute(decode)
    assert result.rows[0].error is not None and "grammar mask" in result.rows[0].error
