"""Speculator options: typed, validated by the kernel from the plugin's own Options struct, with
errors that name the option and list what would be accepted; `check` runs before weights load."""

from __future__ import annotations

import time

import pytest

from speckernel.config import EngineConfig
from speckernel.engine.check import parse_options
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.speculators.draft_model import DraftModelOptions
from speckernel.speculators.ngram import NgramOptions


def test_strings_become_typed_values() -> None:
    assert parse_options("ngram", NgramOptions, {"prompt_lookup_max": "6"}) == NgramOptions(prompt_lookup_max=6)
    assert parse_options("ngram", NgramOptions, {}) == NgramOptions()


@pytest.mark.parametrize(
    ("raw", "message"),
    [({"prompt_lookup_maks": "6"}, r"unknown option\(s\) prompt_lookup_maks; known: prompt_lookup_max, "
                                    r"prompt_lookup_min"),
     ({"prompt_lookup_max": "six"}, r"Expected `int`, got `str` - at `\$.prompt_lookup_max`"),
     ({"prompt_lookup_min": "0"}, r"Expected `int` >= 1 - at `\$.prompt_lookup_min`")],
)
def test_bad_options_name_the_option(raw: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        parse_options("ngram", NgramOptions, raw)


@pytest.mark.timing  # no model load: under 10 s
def test_options_are_checked_before_any_weight_is_read() -> None:
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match=r"prompt_lookup_min \(3\) exceeds prompt_lookup_max \(2\)"):
        EngineCore(EngineConfig(platform="cpu", speculator="ngram",
                                speculator_options={"prompt_lookup_min": "3", "prompt_lookup_max": "2"}))
    with pytest.raises(InvalidInputError, match=r"num_layers: expected an integer in \[1, 30\], got 31"):
        EngineCore(EngineConfig(platform="cpu", speculator="draft_model", speculator_options={"num_layers": "31"}))
    assert time.monotonic() - started < 10  # no model load (a load takes seconds)
    assert DraftModelOptions().num_layers == 0
