"""Values a caller hands the engine: whatever the core could not take fails in the frontend,
typed and naming the field, before anything is sent; whatever passes decodes in the core."""

from __future__ import annotations

import logging
import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckernel import AsyncEngine, EngineConfig, InvalidInputError, InvalidSamplingParamsError, SamplingParams
from speckernel.models.tokenizer import check_messages
from speckernel.sampling_params import MIN_TEMPERATURE, NO_PIPELINE_LOGPROBS, prompt_token_ids, sampling_params
from speckernel.wire.codec import Decoder, Encoder
from speckernel.wire.messages import AddRequest, FrontendMessage

# Values of every kind a caller might pass, the awkward ones included.
ODD = [True, False, 0, 1, -1, 7, 2**31, 2**63, 2**70, 1.5, 0.0, 1e-45, -0.0, math.nan, math.inf, "0.5", "", "x",
       None, (), (1,), (1.0,), ("a",), ("",), [3], np.int64(3), np.int32(-2), np.float32(0.5), np.bool_(True),
       np.uint64(2**64 - 1), (np.int64(4),)]


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional={f: st.sampled_from(ODD) for f in SamplingParams.__struct_fields__}))
def test_whatever_validate_accepts_the_core_decodes_and_the_rest_is_typed(fields: dict[str, object]) -> None:
    """No value escapes as OverflowError/TypeError, and none passes that the core's decoder
    (strict types, Meta bounds) would drop: that request would hang its caller."""
    try:
        params = SamplingParams(**fields).validate(vocab_size=1000)  # type: ignore[arg-type]
    except InvalidSamplingParamsError as e:
        assert str(e).split(":")[0].split(".")[0] in SamplingParams.__struct_fields__  # a nested field: its path
        return
    frames = Encoder().encode(AddRequest(0, np.arange(3), params))
    decoded = Decoder(FrontendMessage).decode(frames)
    assert decoded.params == params
    assert all(type(getattr(params, f)) in (int, float, bool, tuple, type(None)) for f in params.__struct_fields__)
    assert params.temperature == 0.0 or params.temperature >= MIN_TEMPERATURE


@pytest.mark.parametrize(("field", "value", "accepted"), [
    ("max_tokens", True, "an integer in [1, 2147483647]"),
    ("max_tokens", 2**70, "an integer in [1, 2147483647]"),
    ("top_k", 2.0, "an integer in [0, 2147483647]"),
    ("seed", True, "an integer in [0, 9223372036854775807] or None"),
    ("seed", 1.5, "an integer in [0, 9223372036854775807] or None"),
    ("seed", 2**63, "an integer in [0, 9223372036854775807] or None"),
    ("temperature", "0.5", "a number in [0.0, 1000000.0]"),
    ("temperature", math.inf, "a number in [0.0, 1000000.0]"),
    ("top_p", math.nan, "a number in (0.0, 1.0]"),
    ("stop", (123,), "a sequence, each item a non-empty string"),
    ("stop_token_ids", (1.0,), "a sequence, each item an integer in [0, 2147483647]"),
    ("ignore_eos", 1, "True or False"),
])
def test_a_rejected_value_names_its_field_and_what_is_accepted(field: str, value: object, accepted: str) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{field}: expected {accepted}, got {value!r}")


def test_numpy_scalars_are_converted_not_refused() -> None:
    got = SamplingParams(seed=np.int64(2**62), top_k=np.uint8(5), stop_token_ids=(np.int16(3),),  # type: ignore[arg-type]
                         ignore_eos=np.bool_(True)).validate(vocab_size=10)  # type: ignore[arg-type]
    assert (got.seed, got.top_k, got.stop_token_ids, got.ignore_eos) == (2**62, 5, (3,), True)
    assert type(got.seed) is int and type(got.top_k) is int and type(got.ignore_eos) is bool


@pytest.mark.parametrize(("temperature", "want"), [(1e-45, 0.0), (MIN_TEMPERATURE / 2, 0.0), (0.0, 0.0),
                                                    (MIN_TEMPERATURE, MIN_TEMPERATURE), (0.7, 0.7)])
def test_a_temperature_is_zero_or_at_least_the_minimum(temperature: float, want: float) -> None:
    assert SamplingParams(temperature=temperature).validate().temperature == want


def test_stop_token_ids_must_lie_in_the_vocabulary() -> None:
    with pytest.raises(InvalidSamplingParamsError, match=r"^stop_token_ids: expected token ids in \[0, 99\], got 100"):
        SamplingParams(stop_token_ids=(5, 100)).validate(vocab_size=100)


def test_logprobs_are_refused_where_the_target_is_split_into_stages() -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        sampling_params(SamplingParams(logprobs=0), vocab_size=100, pipeline=True)
    assert str(info.value) == NO_PIPELINE_LOGPROBS
    assert sampling_params(SamplingParams(logprobs=0), vocab_size=100).logprobs == 0
    assert sampling_params(None, vocab_size=100, pipeline=True) == SamplingParams().validate()


async def test_the_frontend_and_the_core_refuse_bad_parameters_with_one_text() -> None:
    """The frontend refuses before it sends, the core refuses the same request from any sender:
    one check, so one text."""
    from speckernel.engine.core import EngineCore

    bad = SamplingParams(max_tokens=2, stop_token_ids=(5, 10**6))
    config = EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=64)
    async with AsyncEngine(msgspec.structs.replace(config, in_process=True)) as engine:
        with pytest.raises(InvalidSamplingParamsError) as info:
            async for _ in engine.generate([1, 2], bad):
                pass
    refused = EngineCore(config).add_request(AddRequest(0, np.asarray([1, 2]), bad))
    assert refused is not None and refused.error == f"InvalidSamplingParamsError: {info.value}"


@pytest.mark.parametrize("prompt", [[1.5, 2.7], [True, 2], [512], [-1], np.array([1.0, 2.0]), np.array([[1, 2]]),
                                    "ab", 7, None, [[1]]])
def test_prompt_token_ids_are_ints_within_the_vocabulary(prompt: object) -> None:
    with pytest.raises(InvalidInputError, match=r"^prompt: expected"):
        prompt_token_ids(prompt, vocab_size=512)


def test_prompt_token_ids_accept_any_integer_sequence() -> None:
    for prompt in ([1, 511], (1, 511), np.array([1, 511], np.int32), [np.int64(1), 511], range(1, 3)):
        got = prompt_token_ids(prompt, vocab_size=512)
        assert got in ([1, 511], [1, 2]) and all(type(t) is int for t in got)


@pytest.mark.parametrize(("messages", "where"), [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "messages[1]"),
    ([{"role": "", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content"),
    ("hi", "messages"),
    ({"role": "user", "content": "hi"}, "messages"),
])
def test_chat_messages_the_template_could_not_render_are_typed_errors(messages: object, where: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        check_messages(messages)
    assert str(info.value).startswith(f"{where}:")
    check_messages([{"role": "user", "content": "hi", "name": "extra keys pass"}])


@pytest.mark.parametrize(("field", "value"), [
    ("kv_cache_bytes", -5), ("kv_cache_bytes", 0), ("kv_cache_bytes", 2**64), ("num_kv_blocks", True),
    ("max_num_seqs", 1.5), ("block_size", 0), ("max_model_len", 1), ("seed", -1), ("seed", True),
    ("startup_timeout_s", 0), ("log_level", "loud"), ("in_process", 1), ("speculator_options", {"k": 1}),
])
def test_engine_config_values_are_strict_and_bounded(field: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=rf"^{field}: expected .*, got"):
        EngineConfig(**{field: value}).validate()  # type: ignore[arg-type]


def test_engine_config_converts_numpy_and_travels_to_the_core() -> None:
    config = EngineConfig(max_num_seqs=np.int64(3), seed=np.uint32(9), log_level="INFO").validate()  # type: ignore[arg-type]
    assert (config.max_num_seqs, config.seed) == (3, 9) and type(config.max_num_seqs) is int
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig) == config


@pytest.mark.parametrize("kv", [{"kv_cache_bytes": 1}, {"num_kv_blocks": 4, "max_model_len": 128},
                                {"num_kv_blocks": 7, "max_model_len": 120, "speculator": "ngram",
                                 "num_speculative_tokens": 4}])
def test_a_kv_cache_the_user_sized_below_the_context_fails_naming_both(kv: dict[str, object]) -> None:
    from speckernel.engine.core import EngineCore

    with pytest.raises(InvalidInputError, match=r"holds \d+ tokens per request, below max_model_len \d+"):
        EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32", **kv))  # type: ignore[arg-type]


def test_a_default_kv_budget_too_small_for_the_context_warns(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from speckernel.engine.core import EngineCore
    from speckernel.models.paged import kv_bytes_per_block
    from speckernel.platforms.cpu import CpuPlatform

    core = EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32"))
    full = core.max_model_len
    per_block = kv_bytes_per_block(core.model_cfg, core.config.block_size, core.dtype)
    monkeypatch.setattr(CpuPlatform, "kv_budget_bytes", lambda self: 5 * per_block)
    with caplog.at_level(logging.WARNING, logger="speckernel"):
        small = EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32"))
    assert small.max_model_len < full
    (record,) = [r for r in caplog.records if "kv_cache_shrinks_context" in r.getMessage()]
    assert f"max_model_len={full}" in record.getMessage() and f"context={small.max_model_len}" in record.getMessage()


async def test_the_frontend_refuses_bad_values_before_sending_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through AsyncEngine (core in process, real tokenizer): each bad value raises its typed
    error and no message reaches the core; a good request afterwards is served."""
    async with AsyncEngine(EngineConfig(platform="cpu", max_model_len=256, in_process=True)) as engine:
        client = engine._client
        assert client is not None
        sent: list[object] = []
        real_send = client.send
        monkeypatch.setattr(client, "send", lambda msg: (sent.append(msg), real_send(msg))[1])
        bad: list[tuple[object, object, dict[str, object]]] = [
            ("Hi", SamplingParams(max_tokens=True), {}),  # type: ignore[arg-type]
            ("Hi", SamplingParams(top_k=True), {}),  # type: ignore[arg-type]
            ("Hi", SamplingParams(seed=True), {}),  # type: ignore[arg-type]
            ("Hi", SamplingParams(seed=1.5), {}),  # type: ignore[arg-type]
            ("Hi", SamplingParams(stop_token_ids=(1.0,)), {}),  # type: ignore[arg-type]
            ("Hi", SamplingParams(max_tokens=2**70), {}),
            ("Hi", SamplingParams(stop=(123,)), {}),  # type: ignore[arg-type]
            ("Hi", SamplingParams(temperature="0.5"), {}),  # type: ignore[arg-type]
            ("Hi", {"max_tokens": 3}, {}),
            ([1.5, 2.7], None, {}),
            ([engine.info.vocab_size], None, {}),
            ("Hi", None, {"request_id": 7}),
        ]
        for prompt, params, kw in bad:
            with pytest.raises(InvalidInputError):
                async for _ in engine.generate(prompt, params, **kw):  # type: ignore[arg-type]
                    pass
        with pytest.raises(InvalidInputError, match=r"^messages\[0\]\.content"):
            async for _ in engine.chat([{"role": "user", "content": None}]):
                pass
        assert sent == []
        out = None
        async for out in engine.generate("Hi", SamplingParams(seed=np.int64(3), max_tokens=np.int32(2))):  # type: ignore[arg-type]  # noqa: B007
            pass
        assert out is not None and out.finished and len(out.token_ids) <= 2
        assert [type(m) for m in sent][:1] == [AddRequest]
