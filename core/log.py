"""structlog key-value events through the standard `logging` tree, under the `speckernel` logger.

The library never configures logging on its own and never writes to stdout: an embedder's
logging (or structlog) set-up stays as it is, and speckernel's events follow it like any
library's (warnings and errors reach stderr through Python's last-resort handler). The CLI and
the engine-core process call `configure` to show events at a level on stderr.
"""

from __future__ import annotations

import logging
import sys

import structlog

ROOT = "speckernel"
_PROCESSORS: list[structlog.typing.Processor] = [
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso"),
    structlog.processors.format_exc_info,  # exc_info / .exception() render their traceback
    structlog.processors.KeyValueRenderer(key_order=["timestamp", "level", "event"]),
]


class _Handler(logging.StreamHandler):
    """Ours, so configuring twice replaces it instead of adding a second one."""


def configure(level: str = "warning") -> None:
    """Shows speckernel's events at `level` and above on stderr (the CLI, the core process)."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(logging.getLevelNamesMapping().get(level.upper(), logging.WARNING))
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def get(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(f"{ROOT}.{name}"), processors=_PROCESSORS, wrapper_class=structlog.stdlib.BoundLogger)
    return logger.bind(component=name)
