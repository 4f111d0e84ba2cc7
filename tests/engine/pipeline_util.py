"""Drives an EngineCore through its real loop (`run`, frames in flight) until every request ends;
runs both stages of PP=2 in this process (`LocalPipeline`)."""

from __future__ import annotations

import itertools
import queue
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
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
from speckernel.wire.messages import AddRequest, CoreMessage, CoreOutputs, Shutdown

_KEYS = itertools.count(1)


def run_loop(core: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             on_step: Any = None) -> list[list[int]]:
    """Outputs in prompt order; `on_step(core, outputs)` runs after each batch of deltas."""
    base = next(_KEYS) * 10_000
    each = params if isinstance(params, list) else [params] * len(prompts)
    outputs: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
    done: set[int] = set()
    errors: dict[int, str] = {}

    async def emit(msg: CoreMessage) -> None:
        if isinstance(msg, CoreOutputs):
            for d in msg.deltas:
                outputs[d.key].extend(d.new_token_ids)
                if d.finish_reason is not None:
                    done.add(d.key)
                    if d.error:
                        errors[d.key] = d.error
            if on_step is not None:
                on_step(core, outputs)
            if len(done) == len(prompts):
                core.deliver(Shutdown())

    async def main() -> None:
        for i, ids in enumerate(prompts):
            core.deliver(AddRequest(base + i, np.asarray(ids), each[i], f"p{i}"))
        await core.run(emit)

    anyio.run(main)
    assert not errors, errors
    return [outputs[base + i] for i in range(len(prompts))]


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

    def __init__(self, core: EngineCore, config: EngineConfig, platform: str,
                 publish: Callable[[TokenFrame], None] | None = None) -> None:
        """`publish`: what the last stage's publisher calls with each frame (default: keep it for
        `result`)."""
        kv = core.kv
        k = config.num_speculative_tokens if config.speculator else 0
        boot = StageBootstrap(config=config, num_blocks=kv.num_blocks, max_model_len=kv.max_model_len,
                              lookahead_slots=kv.lookahead_slots, draft_kv_bytes=kv.draft_kv_bytes, commands=[],
                              results="", reports="", transport="", k=k, blocks_per_request=kv.blocks_per_request(k))
        device = registry.pick_platform(platform)
        hidden, tokens = LocalLink(), LocalLink()
        self.published: queue.Queue[TokenFrame] = queue.Queue()
        self.errors: list[BaseException] = []
        self.stages = [
            Stage(boot, 0, 2, device, StageLinks(next=hidden, tokens=tokens)),
            Stage(boot, 1, 2, device, StageLinks(prev=hidden, tokens=tokens), publish=publish or self.published.put,
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
