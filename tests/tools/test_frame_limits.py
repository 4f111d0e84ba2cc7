"""The engine's ZeroMQ frame bounds (`speckernel.wire.limits`): what the code sends fits, a prompt
of the whole context included, and a frame the core would drop fails at the frontend instead."""

from __future__ import annotations

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.errors import InvalidInputError
from speckernel.frontend.client import ProcessClient
from speckernel.sampling_params import SamplingParams
from speckernel.wire.codec import Encoder
from speckernel.wire.limits import ENGINE_FRAME_FLOOR, drafter_request_limit, engine_frame_limit
from speckernel.wire.messages import AddRequest


@pytest.mark.parametrize("max_model_len", [None, 4096, 2**20, 2**24])
def test_a_prompt_of_the_whole_context_fits_the_engine_link(max_model_len: int | None) -> None:
    config = EngineConfig(max_model_len=max_model_len)
    tokens = (max_model_len or 4096) - 1  # the frontend refuses a prompt of max_model_len
    frames = Encoder().encode(AddRequest(1, np.zeros(tokens, dtype=np.int64), SamplingParams(), "r" * 1000))
    assert max(len(f) for f in frames) <= engine_frame_limit(config)
    assert engine_frame_limit(config) >= ENGINE_FRAME_FLOOR


def test_a_step_s_hidden_states_fit_the_drafter_server() -> None:
    hidden = np.zeros((8192, 4096), dtype=np.float32)  # a 4096-wide target, 8192 query tokens
    assert Encoder().encode(hidden.reshape(-1))[1].nbytes <= drafter_request_limit(4096)
    assert drafter_request_limit(576) < 256 * 2**20


def test_a_frame_over_the_link_s_bound_fails_at_the_frontend() -> None:
    client = ProcessClient(EngineConfig())
    try:
        huge = AddRequest(1, np.zeros(4, dtype=np.int64), SamplingParams(), "x" * (client.max_frame_bytes + 1))
        with pytest.raises(InvalidInputError, match="over the engine link's"):
            client.send(huge)
    finally:
        client.release()
