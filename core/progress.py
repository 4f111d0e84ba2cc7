"""Progress for the command line: whatever takes more than a second says so.

On a terminal, bars and counters (tqdm) on stderr; elsewhere (a log file, a pipe) bars are off
and long loops log a line every so often instead (`every`), so a run is never silent for minutes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

from .config import EngineConfig

TICK_S = 0.2


def on_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


def loading_what(config: EngineConfig) -> str:
    """'loading smollm2-135m with ngram': what the wait while an engine starts is for."""
    spec = f" with {config.speculator}" if config.speculator else ""
    return f"loading {config.model}{spec}"


@contextmanager
def waiting(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """'what… 4s' on stderr, counting, while the block runs (on a terminal only); the line goes
    when it ends. For waits with no steps to count: loading a model, starting the core."""
    stream = stream or sys.stderr
    if not on_terminal(stream):
        yield
        return
    bar = tqdm(desc=what, bar_format="{desc}… {elapsed}", file=stream, leave=False)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_S):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="speckernel-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


class Every:
    """True once per `seconds` (and on the first call): when a loop without a bar logs a line."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last: float | None = None

    def __call__(self) -> bool:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.seconds:
            self._last = now
            return True
        return False


LOG_EVERY_S = 10.0


class Progress:
    """A benchmark run's requests and tokens: a bar of tokens (or requests) on a terminal, and
    elsewhere a line every LOG_EVERY_S seconds and one at the end, so a long run is never silent."""

    def __init__(self, desc: str, requests: int, tokens: int | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.desc = desc
        self.requests, self.total_tokens = requests, tokens
        self.done = self.generated = 0
        self.started = time.monotonic()
        self.bar = tqdm(total=tokens if tokens else requests, unit="tok" if tokens else "req", desc=desc,
                        file=self.stream, disable=not on_terminal(self.stream), dynamic_ncols=True)
        self.every = Every(LOG_EVERY_S)
        self.every()  # the first line waits a period: a run shorter than that logs once, at its end

    def tokens(self, n: int) -> None:
        self.generated += n
        if self.total_tokens:
            self.bar.update(n)
        self._log()

    def request_done(self) -> None:
        self.done += 1
        if self.total_tokens:
            self.bar.set_postfix_str(f"{self.done}/{self.requests} req", refresh=False)
        else:
            self.bar.update(1)
        self._log()

    def line(self) -> str:
        return (f"{self.desc}: {self.done}/{self.requests} requests, {self.generated} tokens, "
                f"{time.monotonic() - self.started:.0f}s")

    def _log(self) -> None:
        if self.bar.disable and self.every():
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()
        if self.bar.disable:
            print(self.line(), file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
