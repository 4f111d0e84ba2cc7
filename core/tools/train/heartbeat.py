"""A line at least every `progress.LOG_EVERY_S` seconds while `train-drafter` works, even inside
one long call (a training step on a CPU, loading the target, the final save).

The trainer's own lines go through `say`; a thread watches the time since the last one and,
when it passes LOG_EVERY_S, says what the run is doing now (`watch`'s status). On a terminal,
the line is written above the bars (`tqdm.write`) so the bars stay intact. Torch releases the
GIL inside its kernels, so the thread speaks while a step computes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

from ...progress import LOG_EVERY_S, on_terminal

TICK_S = 0.5


class Heartbeat:
    """Says `status()` when the run has said nothing for `every` seconds (while a status is set)."""

    def __init__(self, stream: TextIO | None = None, every: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.every = LOG_EVERY_S if every is None else every
        self.terminal = on_terminal(self.stream)
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.status: Callable[[], str] | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="speckernel-train-heartbeat", daemon=True)

    def say(self, text: str) -> None:
        """One line on the stream (above the bars on a terminal); the silence counts from here."""
        with self.lock:
            if self.terminal:
                tqdm.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)
            self.last = time.monotonic()

    def heard(self) -> None:
        """Someone else just wrote a line (a `Progress`): the silence counts from here."""
        with self.lock:
            self.last = time.monotonic()

    @contextmanager
    def watch(self, status: Callable[[], str] | None) -> Iterator[None]:
        """While the block runs, `status()` is what a silence of `every` seconds gets said
        (None: nothing; another reporter, such as a `Progress`, speaks for this phase)."""
        before, self.status = self.status, status
        self.heard()
        try:
            yield
        finally:
            self.status = before

    def _run(self) -> None:
        while not self.stop.wait(TICK_S):
            status = self.status
            if status is not None and time.monotonic() - self.last >= self.every:
                try:
                    text = status()
                except Exception as e:  # a status that breaks must not end the run's progress lines
                    text = f"train-drafter: working ({type(e).__name__})"
                self.say(text)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
