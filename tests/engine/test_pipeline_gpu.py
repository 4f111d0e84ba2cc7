"""Pipeline stages on a real GPU: each stage is the single-stage fast path on its layers.

- In the batch-invariant mode, bf16 output of PP=2 equals PP=1's token for token: the stages
  run the same kernels on the same shapes, and the residual stream crosses the stage boundary as
  the whole model carries it.
- Steady-state decode steps of every stage launch without a host synchronisation
  (`torch.cuda.set_sync_debug_mode("error")`): both stages of PP=2 in this process, on one GPU,
  joined by in-process device links, the last stage's token frames leaving from its publisher
  thread; and real stage processes on the platform's transport, with the check on in each.

Run on a GPU host: `pytest tests/engine/test_pipeline_gpu.py -n 0`."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from speckernel import registry
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.engine.stage_process import SYNC_DEBUG_ENV
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import LocalPipeline, run_loop
from tests.runner.test_gpu_fast_path import run

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPECS = [pytest.param({}, id="plain"), pytest.param({"speculator": "mtp", "num_speculative_tokens": 3}, id="mtp")]


def gpu_config(pp: int, **kw: Any) -> EngineConfig:
    return EngineConfig(**({"platform": "cuda", "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 16,
                            "num_kv_blocks": 512, "pipeline_parallel_size": pp} | kw))


_single: dict[str, list[list[int]]] = {}


def invariant_outputs(config: EngineConfig, ids: list[list[int]]) -> list[list[int]]:
    core = EngineCore(config)
    try:
        return run_loop(core, ids, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    finally:
        core.close()


@pytest.mark.parametrize("transport", [None, "torch_dist"], ids=["preferred", "torch_dist"])
@pytest.mark.parametrize("spec", SPECS)
def test_batch_invariant_bf16_pp2_equals_pp1(model_path: Path, tokenizer: Any, spec: dict[str, Any],
                                             transport: str | None) -> None:
    """On the platform's preferred transport (cuda_ipc: device to device) and on torch_dist (two
    stages on one GPU: gloo, through the host)."""
    ids = [tokenizer.encode(p) for p in PROMPTS[:12]]
    key = str(spec)
    if key not in _single:
        _single[key] = invariant_outputs(gpu_config(1, batch_invariant=True, **spec), ids)
    got = invariant_outputs(gpu_config(2, batch_invariant=True, pipeline_transport=transport, **spec), ids)
    assert got == _single[key]


@pytest.mark.parametrize("spec", SPECS)
def test_pp2_stage_processes_on_the_platforms_transport_never_sync_a_decode_step(
        model_path: Path, tokenizer: Any, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Real stage processes sharing the GPU, linked by the platform's preferred transport
    (cuda_ipc): every decode step of both stages runs under the sync check, and a step that
    synchronised would have failed its stage and so the run."""
    monkeypatch.setenv(SYNC_DEBUG_ENV, "1")
    ids = [tokenizer.encode(p) for p in PROMPTS[:8]]
    core = EngineCore(gpu_config(2, **spec))
    reports: list[Any] = []

    def near_the_end(core: EngineCore, outs: dict[int, list[int]]) -> None:  # the stages still run
        if not reports and all(len(out) >= 40 for out in outs.values()):
            reports.extend(core.runner.digests()[0])  # type: ignore[union-attr]

    try:
        assert core.runner.transport == registry.pick_platform("cuda").capabilities.preferred_transports[0]  # type: ignore[union-attr]
        outputs = run_loop(core, ids, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), near_the_end)
    finally:
        core.close()
    assert all(len(out) == 48 for out in outputs)
    assert [r.num_sync_checked > 5 for r in reports] == [True, True], reports
    assert [r.num_graph_steps > 5 for r in reports] == [True, True], "both stages replay their graphs"


@pytest.mark.parametrize("spec", SPECS)
def test_pp2_decode_steps_of_every_stage_launch_without_host_sync(model_path: Path, tokenizer: Any,
                                                                  spec: dict[str, Any]) -> None:
    """Two frames in flight (the batch queue at PP=2), fixed-width drafts on the device: the
    scheduler gets counts, the first stage gets the tokens device to device. Greedy output equals
    the single-stage engine's."""
    single = gpu_config(1, dtype="float32", in_process=True, **spec)
    core = EngineCore(single)
    pipeline = LocalPipeline(core, msgspec.structs.replace(single, pipeline_parallel_size=2), "cuda")
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
    return run(EngineCore(config), ids, params)
