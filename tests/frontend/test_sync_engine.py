"""The blocking Engine facade."""

from __future__ import annotations

import pytest

from speckernel import Engine, EngineConfig, InvalidSamplingParamsError, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow


def test_engine_generates_streams_and_shuts_down() -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with Engine(EngineConfig(platform="cpu", max_model_len=256)) as engine:
        outs = engine.generate(PROMPTS[:4], params)
        assert [o.request_id for o in outs] and all(o.finished and len(o.token_ids) == 8 for o in outs)
        streamed = list(engine.stream(PROMPTS[0], params))
        assert len(streamed) >= 2 and streamed[-1].token_ids == outs[0].token_ids
        assert "".join(o.delta_text for o in streamed) == streamed[-1].text
        with pytest.raises(InvalidSamplingParamsError):
            engine.generate(["x"], SamplingParams(top_p=2.0))
        assert engine.stats()["num_generated_tokens"] >= 40
        proc = engine._async._client.proc  # type: ignore[union-attr]
    assert proc.poll() is not None
