"""One weight-free check for every caller: the library gets the CLI's checks, in the field's own
names, and the engine reads the context cap and the pipeline depth from what it checked."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from speckernel import AsyncEngine, EngineConfig
from speckernel.config import CONTEXT_CAP
from speckernel.engine.check import check
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError, UnknownModelError, UnknownPluginError

TINY = EngineConfig(model="random:tiny", platform="cpu", dtype="float32")


@pytest.mark.parametrize(("overrides", "error", "message"), [
    ({"draft_model": "x.gguf"}, InvalidInputError, r"^draft_model is read by a speculator: add speculator NAME"),
    ({"speculator_options": {"a": "1"}}, InvalidInputError, r"^speculator_options is read by a speculator"),
    ({"speculator": "ngram", "num_speculative_tokens": 17}, InvalidInputError,
     r"^num_speculative_tokens: speculator 'ngram' drafts at most 16 tokens per step; got 17$"),
    ({"speculator": "ngram", "num_speculative_tokens": 0}, InvalidInputError,
     r"^num_speculative_tokens: expected >= 1"),
    ({"speculator": "ngram", "speculator_options": {"bogus": "1"}}, InvalidInputError, r"unknown option\(s\) bogus"),
    ({"speculator": "bogus"}, UnknownPluginError, r"unknown speculator 'bogus'"),
    ({"platform": "tpu"}, UnknownPluginError, r"unknown platform 'tpu'"),
    ({"dtype": "int8"}, InvalidInputError, r"^unknown dtype 'int8'; available: float32"),
    ({"speculator": "draft_model", "draft_model": "no/such.gguf"}, UnknownModelError,
     r"^draft_model no/such.gguf: no such file or folder"),
    ({"max_model_len": 1}, InvalidInputError, r"^max_model_len: expected an integer in \[2, "),
])
def test_check_names_fields_as_the_library_spells_them(overrides: dict[str, object], error: type[Exception],
                                                       message: str) -> None:
    config = msgspec.structs.replace(TINY, **overrides)
    with pytest.raises(error, match=message):
        check(config)
    with pytest.raises(error, match=message):
        EngineCore(config)


async def test_async_engine_checks_before_it_starts_a_core() -> None:
    with pytest.raises(InvalidInputError, match="num_speculative_tokens: speculator 'ngram' drafts at most 16"):
        async with AsyncEngine(TINY, speculator="ngram", num_speculative_tokens=99):
            pass


def test_check_imports_no_torch_without_a_speculator() -> None:
    code = ("import sys\nfrom speckernel.config import EngineConfig\nfrom speckernel.engine.check import check\n"
            "c = check(EngineConfig(model='random:tiny'))\n"
            "print(c.max_model_len, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["2048", "False"]


def test_the_engine_caps_a_long_context_where_the_cli_does() -> None:
    long = "random:tiny,max_position=8192"
    core = EngineCore(EngineConfig(model=long, platform="cpu", dtype="float32", num_kv_blocks=300))
    assert core.max_model_len == check(core.config).max_model_len == CONTEXT_CAP


@pytest.mark.parametrize(("overrides", "depth"), [
    ({}, 2), ({"async_scheduling": False}, 1), ({"speculator": "ngram", "async_scheduling": False}, 1)])
def test_pipeline_depth(overrides: dict[str, object], depth: int) -> None:
    """Two frames in flight only with async scheduling and requests that can run ahead."""
    core = EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=128,
                                   **overrides))  # type: ignore[arg-type]
    assert core.pipeline_depth() == depth


def test_a_speculator_without_run_ahead_keeps_one_frame_in_flight() -> None:
    core = EngineCore(EngineConfig(model="random:tiny", platform="cpu", dtype="float32", max_model_len=128,
                                   speculator="ngram"))
    spec = core.scheduler.spec
    assert spec is not None and core.pipeline_depth() == (2 if spec.run_ahead else 1)
