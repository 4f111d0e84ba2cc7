"""What the engine core's loop drives: the single-stage `ModelRunner` and the `Pipeline` of
stage processes both are a `Runner`, so the loop calls one type and never asks which it has."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..kernel.frame import StepFrame, StepResult
    from ..runner.step_graphs import StepGraphs


class PendingResult(Protocol):
    """A launched step: `result` waits for it (on the device, or for the last stage's frame)."""

    def ready(self) -> bool:
        """`result` would not wait (asks; never waits)."""
        ...

    def result(self) -> StepResult: ...


class Runner(Protocol):
    """Runs the frames the scheduler makes, in order; a failing row fails its own request only."""

    @property
    def graphs(self) -> StepGraphs | None:
        """The device graphs its steps replay (None: every step runs eagerly, or elsewhere)."""
        ...

    @property
    def device_s(self) -> float | None:
        """Device time of the steps it ran (None where it is not measured: the CPU, stages)."""
        ...

    def launch(self, frame: StepFrame) -> PendingResult:
        """Issues the step and returns before it has run, so the loop can schedule the next."""
        ...

    def execute(self, frame: StepFrame) -> StepResult:
        """`launch(frame).result()`."""
        ...

    def stop_speculation(self) -> None:
        """The speculator is switched off for the engine: the runner never calls it again."""
        ...
