"""Pipeline stages on a real GPU: each stage is the single-stage fast path on its layers.

- In the batch-invariant mode, bf16 output of PP=2 equals PP=1's token for token: the stages
  run the same kernels on the same shapes, and the residual stream crosses the stage boundary as
  the whole model carries it.
- Steady-state decode steps of every stage launch without a host synchronisation
  (`torch.cuda.set_sync_debug_mode("error")`): both stages of PP=2 run in this process, on one
  GPU, joined by in-process device links, and the last stage's token frames leave from its
  publisher thread.

Run on a GPU host: `pytest tests/engine/test_pipeline_gpu.py -n 0`."""

from __future__ import annotations

import queue
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from speckernel import registry
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.engine.stage_messages import StageBootstrap
from speckernel.engine.stage_process import Stage
from speckernel.kernel.token_frames import result_from_frame
from speckernel.runner.stage_runner import StageLinks
from speckernel.sampling_params import SamplingParams
from speckernel.transport import TokenFrame
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import run_loop

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPECS = [pytest.param({}, id="plain"), pytest.param({"speculator": "mtp", "num_speculative_tokens": 3}, id="mtp")]


def gpu_config(pp: int, **kw: Any) -> EngineConfig:
    return EngineConfig(**({"platform": "cuda", "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 16,
                            "num_kv_blocks": 512, "pipeline_parallel_size": pp} | kw))


@pytest.mark.parametrize("spec", SPECS)
def test_batch_invariant_bf16_pp2_equals_pp1(model_path: Path, tokenizer: Any, spec: dict[str, Any]) -> None:
    ids = [tokenizer.encode(p) for p in PROMPTS[:12]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outputs = []
    for pp in (1, 2):
        core = EngineCore(gpu_config(pp, batch_invariant=True, **spec))
        try:
            outputs.append(run_loop(core, ids, params))
        finally:
            core.close()
    assert outputs[1] == outputs[0]


class LocalLink:
    """A device edge between two stages of this process: same stream, so a tensor sent is ready
    for whatever the receiver issues after it."""

    def __init__(self) -> None:
        self.sent: dict[int, deque[torch.Tensor]] = {}

    def send_tensor(self, step_id: int, tensor: torch.Tensor) -> None:
        self.sent.setdefault(step_id, deque()).append(tensor)

    def recv_tensor(self, step_id: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: float | None = None) -> torch.Tensor:
        got = self.sent[step_id].popleft()
        if not self.sent[step_id]:
            del self.sent[step_id]
        assert tuple(got.shape) == shape and got.dtype == dtype, (step_id, got.shape, shape)
        return got


class LocalPipeline:
    """Both stages of PP=2 in this process: `launch` runs a frame on each, in order, and its
    result is the token frame the last stage's publisher sent."""

    def __init__(self, core: EngineCore, config: EngineConfig) -> None:
        kv = core.kv
        k = config.num_speculative_tokens if config.speculator else 0
        boot = StageBootstrap(config=config, num_blocks=kv.num_blocks, max_model_len=kv.max_model_len,
                              lookahead_slots=kv.lookahead_slots, draft_kv_bytes=kv.draft_kv_bytes, commands=[],
                              results="", reports="", transport="", k=k, blocks_per_request=kv.blocks_per_request(k))
        platform = registry.pick_platform("cuda")
        hidden, tokens = LocalLink(), LocalLink()
        self.published: queue.Queue[TokenFrame] = queue.Queue()
        self.errors: list[BaseException] = []
        self.stages = [
            Stage(boot, 0, 2, platform, StageLinks(next=hidden, tokens=tokens)),
            Stage(boot, 1, 2, platform, StageLinks(prev=hidden, tokens=tokens), publish=self.published.put,
                  on_error=self.errors.append),
        ]

    def launch(self, frame: Any) -> None:
        for stage in self.stages:
            stage.run_step(frame)

    def result(self, frame: Any) -> Any:
        try:
            return result_from_frame(frame, self.published.get(timeout=60))
        except queue.Empty:
            raise AssertionError(f"no token frame for step {frame.step_id}: {self.errors}") from None

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


@pytest.mark.parametrize("spec", SPECS)
def test_pp2_decode_steps_of_every_stage_launch_without_host_sync(model_path: Path, tokenizer: Any,
                                                                  spec: dict[str, Any]) -> None:
    """Two frames in flight (the batch queue at PP=2), fixed-width drafts on the device: the
    scheduler gets counts, the first stage gets the tokens device to device. Greedy output equals
    the single-stage engine's."""
    single = gpu_config(1, dtype="float32", in_process=True, **spec)
    core = EngineCore(single)
    pipeline = LocalPipeline(core, msgspec.structs.replace(single, pipeline_parallel_size=2))
    scheduler = core.scheduler
    scheduler.pipeline = True  # as the engine core schedules for stages: nothing runs ahead of its frame
    if scheduler.spec is not None:
        scheduler.spec = msgspec.structs.replace(scheduler.spec, run_ahead=False)
    ids = [tokenizer.encode(p) for p in PROMPTS[:4]]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for key, p in enumerate(ids):
        core.add_request(AddRequest(key, p, params))
    out: dict[int, list[int]] = {key: [] for key in range(len(ids))}
    in_flight: deque[Any] = deque()
    checked = 0
    try:
        while scheduler.requests or in_flight:
            while len(in_flight) < 2 and (frame := scheduler.schedule()) is not None:
                core.ledger.submit(frame)
                assert not frame.host_drafts, "fixed-width drafts went to the host"
                decode = all(r.sampling is not None and r.num_tokens == 1 + r.num_drafts for r in frame.rows)
                if decode:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    pipeline.launch(frame)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                checked += decode
                in_flight.append(frame)
            frame = in_flight.popleft()
            for delta in core._apply(pipeline.result(frame), frame):
                out[delta.key] += delta.new_token_ids
    finally:
        pipeline.close()
    assert checked > 10
    assert not pipeline.errors
    for stage in pipeline.stages:
        assert stage.runner.graphs is not None and stage.runner.graphs.num_replays > 0, "the stage replayed no graph"
    want = run_single(gpu_config(1, dtype="float32", in_process=True, **spec), ids, params)
    assert out == want


def run_single(config: EngineConfig, ids: list[list[int]], params: SamplingParams) -> dict[int, list[int]]:
    core = EngineCore(config)
    for key, p in enumerate(ids):
        core.add_request(AddRequest(key, p, params))
    out: dict[int, list[int]] = {key: [] for key in range(len(ids))}
    while core.scheduler.requests:
        for delta in core.step():
            out[delta.key] += delta.new_token_ids
    return out
