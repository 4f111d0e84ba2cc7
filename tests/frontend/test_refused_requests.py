"""Requests the Python API cannot serve fail typed, naming what is wrong, before anything is
generated: a stop string that is no Unicode text, an empty conversation, and a JSON schema that
admits no output (the core compiles it on the model's tokenizer and refuses it, instead of
answering with an empty text)."""

from __future__ import annotations

import pytest

from speckernel import AsyncEngine, EngineConfig, InvalidInputError, InvalidSamplingParamsError, SamplingParams
from speckernel.sampling_params import StructuredOutput

LONE_SURROGATE = "\ud800"


@pytest.mark.parametrize(("stop", "where"), [((LONE_SURROGATE,), "character 0 of stop[0]"),
                                             (("ok", "x" + LONE_SURROGATE), "character 1 of stop[1]")])
def test_a_stop_string_with_a_lone_surrogate_is_a_typed_error(stop: tuple[str, ...], where: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=r"^stop: not valid Unicode text") as info:
        SamplingParams(stop=stop).validate()
    assert where in str(info.value)


async def test_a_lone_surrogate_stop_fails_typed_through_a_core_process() -> None:
    """The core in its own process: the stop string would have failed to encode on the wire."""
    async with AsyncEngine(EngineConfig(model="random:tiny", platform="cpu", max_model_len=64)) as engine:
        with pytest.raises(InvalidSamplingParamsError, match=r"^stop: not valid Unicode text"):
            async for _ in engine.generate("<1><2>", SamplingParams(max_tokens=2, stop=(LONE_SURROGATE,))):
                pass
        out = None
        async for out in engine.generate("<1><2>", SamplingParams(max_tokens=2, stop=("<3>",))):  # noqa: B007
            pass
        assert out is not None and out.finished


SELF_REFERENCE = StructuredOutput.of_schema({"$ref": "#"})


@pytest.mark.slow
async def test_an_empty_conversation_and_a_schema_that_admits_no_output_are_typed_errors() -> None:
    """The real model: its chat template renders a prompt even for no messages, and its tokenizer
    is what the grammar compiles on."""
    async with AsyncEngine(EngineConfig(platform="cpu", max_model_len=256, in_process=True)) as engine:
        with pytest.raises(InvalidInputError, match=r"^messages: expected at least one message"):
            async for _ in engine.chat([], SamplingParams(max_tokens=2)):
                pass
        with pytest.raises(InvalidInputError, match=r"^messages: expected at least one message"):
            engine.encode_chat([])
        with pytest.raises(InvalidSamplingParamsError, match=r"^structured\.json_schema: the grammar admits no output"):
            async for _ in engine.generate("Bob as JSON:", SamplingParams(max_tokens=4, structured=SELF_REFERENCE)):
                pass
        out = None
        async for out in engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2)):  # noqa: B007
            pass
        assert out is not None and out.finished and out.token_ids
