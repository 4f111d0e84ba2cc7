"""Drives an EngineCore through its real loop (`run`, frames in flight) until every request ends."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import numpy as np

from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
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
