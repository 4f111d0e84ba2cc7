"""speckernel: a speculative-decoding inference engine built as a small async microkernel."""

from .async_engine import AsyncEngine
from .config import EngineConfig
from .engine import Engine
from .errors import (
    EngineDeadError,
    InvalidInputError,
    InvalidSamplingParamsError,
    ModelFetchError,
    PlatformUnavailableError,
    PromptTooLongError,
    SpeckernelError,
    UnknownModelError,
    UnknownPluginError,
)
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
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
