"""Both stages of PP=2 in this process (CPU, float32): the last stage's step loop hands each
launched step to its publisher and goes on, whatever publishing costs; frames still leave in
step order and carry the single stage's tokens."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.kernel.token_frames import result_from_frame
from speckernel.sampling_params import SamplingParams
from speckernel.transport import TokenFrame
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import LocalPipeline

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("spec", [{}, {"speculator": "mtp", "num_speculative_tokens": 3}], ids=["plain", "mtp"])
def test_the_step_loop_never_waits_for_a_frame_to_be_published(tokenizer: Any, spec: dict[str, Any]) -> None:
    config = EngineConfig(platform="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16,
                          num_kv_blocks=128, in_process=True, **spec)
    core = EngineCore(config)
    held = threading.Event()
    sent: list[TokenFrame] = []

    def publish(frame: TokenFrame) -> None:  # a core that takes its frames only once released
        held.wait(10)
        sent.append(frame)

    pipeline = LocalPipeline(core, msgspec.structs.replace(config, pipeline_parallel_size=2), "cpu", publish)
    scheduler = core.scheduler
    scheduler.pipeline = True
    if scheduler.spec is not None:
        scheduler.spec = msgspec.structs.replace(scheduler.spec, run_ahead=False)
    long = [t for p in PROMPTS[:8] for t in tokenizer.encode(p)]  # several chunks of the budget
    assert len(long) > 32
    core.add_request(AddRequest(0, long, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    try:
        # Prompt chunks on a small budget: two frames in flight, as the batch queue at PP=2 has them.
        frames = [f for f in (scheduler.schedule(), scheduler.schedule()) if f is not None]
        assert len(frames) == 2
        for frame in frames:
            pipeline.launch(frame)  # returns with nothing published: the loop did not wait
        assert not sent
        held.set()
        pipeline.close()  # the publisher sends what it holds, in order
        assert [f.step_id for f in sent] == [f.step_id for f in frames]
        for frame, got in zip(frames, sent, strict=True):
            core.ledger.submit(frame)
            core._apply(result_from_frame(frame, got), frame)
    finally:
        held.set()
        pipeline.close()
    assert not pipeline.errors
