"""speckernel: a speculative-decoding inference engine built as a small async microkernel."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import EngineConfig
from .errors import (
    EngineDeadError,
    EngineRequestError,
    InvalidInputError,
    InvalidSamplingParamsError,
    ModelFetchError,
    PlatformUnavailableError,
    PromptTooLongError,
    SpeckernelError,
    UnknownModelError,
    UnknownPluginError,
)

if TYPE_CHECKING:
    from .frontend.async_engine import AsyncEngine
    from .frontend.sync_engine import Engine
    from .outputs import RequestOutput
    from .sampling_params import SamplingParams

_LAZY = {"AsyncEngine": ".frontend.async_engine", "Engine": ".frontend.sync_engine", "RequestOutput": ".outputs",
         "SamplingParams": ".sampling_params"}
"""Imported on first use: the engine-core process and `speckernel --version` need none of them."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineRequestError",
    "InvalidInputError",
    "InvalidSamplingParamsError",
    "ModelFetchError",
    "PlatformUnavailableError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "SpeckernelError",
    "UnknownModelError",
    "UnknownPluginError",
]
__version__ = "0.1.0"
