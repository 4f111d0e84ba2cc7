"""One training step for every method on one batch, and the one read of the device that turns
the steps' figures into log entries.

Nothing in a step reads the device back: no `.item()`, `.tolist()` or `float(tensor)`, no
selection by a boolean mask (its size is only known on the device), no pageable copy (see
`feed`). The host then queues step after step while the GPU runs them, instead of waiting for
each to finish before it launches the next. Each step's loss and figures stay on the device
until `MethodRun.flush`, once per log interval (and before a save or a measurement), reads them
all at once; the log still holds every step's values.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ...plugin import TrainableDrafter, TrainableSpeculator, TrainBatch
from .feed import DeviceFeed

Figures = Mapping[str, torch.Tensor | float]
"""A step's named figures as a drafter's loss gives them (0-dim tensors on the device, or floats)."""


class Target(Protocol):
    """What runs the frozen target over a batch (`data.TargetFeatures`)."""

    def batch(self, tokens: torch.Tensor, mask: torch.Tensor, counted: int | None = None) -> TrainBatch: ...


def read_figures(figures: Sequence[Figures]) -> list[dict[str, float]]:
    """Every tensor of many steps' figures read from the device in one transfer, as floats."""
    tensors = [v.detach().float().reshape(()) for f in figures for v in f.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [{k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in f.items()} for f in figures]


def rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """Torch's random state where training draws (the CPU's, and the device's on CUDA): the
    drafters' losses draw random anchors and block lengths from it."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, torch.Tensor | None], device: torch.device) -> None:
    """Restores what `rng_state` saved: the CPU's state, and the device's when both are CUDA."""
    cpu, cuda = state.get("cpu"), state.get("cuda")
    if cpu is not None:
        torch.set_rng_state(cpu.cpu())  # state.pt loads onto the training device; a state lives on the host
    if device.type == "cuda" and cuda is not None:
        torch.cuda.set_rng_state(cuda.cpu(), device)


@dataclass
class MethodRun:
    """One method's training: its drafter, optimizer, log and folder; the figures of its steps
    since the last flush wait on the device in `pending`. What a resumed run continues is kept
    cumulatively over every run of the training (`tokens`, the training clock, `runs`) and
    written to state.pt with the weights, the optimizer and torch's random state."""

    method: str
    cls: type[TrainableSpeculator]
    drafter: TrainableDrafter
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    out: Path
    log: list[dict[str, float]] = field(default_factory=list)
    step: int = 0
    pending: list[tuple[int, int, Figures]] = field(default_factory=list)
    tokens: int = 0
    """Training tokens (positions whose label counts) of every step so far, all runs together."""
    seconds_before: float = 0.0
    """Training wall time of the runs before this one, and of this one up to `clock_since`."""
    clock_since: float | None = None
    """time.monotonic() when this run's training clock started; None while it is stopped."""
    clock: list[tuple[int, float]] = field(default_factory=list)
    """(step, training seconds so far) at every read of the device: the log's time axis."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """The runs of this training before this one, as `run_entry` gives them."""
    run_start: tuple[int, float, int] = (0, 0.0, 0)
    """(step, training seconds, tokens) when this run began (`begin_run`)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The flags that define the training (schedule, batches, seed), as state.pt keeps them."""
    data: dict[str, Any] = field(default_factory=dict)
    """The training data's fingerprint (`Sequences.fingerprint`)."""
    rng: dict[str, torch.Tensor | None] | None = None
    """Torch's random state that the resumed state.pt saved (None: a new drafter)."""

    def seconds(self) -> float:
        """Training wall time so far, every run of the training together."""
        running = time.monotonic() - self.clock_since if self.clock_since is not None else 0.0
        return self.seconds_before + running

    def start_clock(self) -> None:
        self.clock_since = time.monotonic()

    def stop_clock(self) -> None:
        self.seconds_before, self.clock_since = self.seconds(), None

    def begin_run(self) -> None:
        """This run of the training starts here (a new drafter, or one resumed)."""
        self.run_start = (self.step, self.seconds(), self.tokens)

    def flush(self) -> None:
        """The pending steps' figures into the log (one read of the device for all of them), and
        the training clock at the last of them (the read waited for the device to get there)."""
        if self.pending:
            read = read_figures([f for _, _, f in self.pending])
            self.log.extend({"step": step, "tokens": tokens, **values}
                            for (step, tokens, _), values in zip(self.pending, read, strict=True))
            self.pending.clear()
            self.clock.append((self.step, self.seconds()))

    def run_entry(self, stopped_by: str | None = None, now: float | None = None) -> dict[str, Any]:
        """This run so far: its first and last step, training seconds (to `now`, training seconds
        read once by the caller) and tokens, and what stopped it (None until it ends: a run killed
        before its final save keeps None)."""
        step, seconds, tokens = self.run_start
        return {"from_step": step, "to_step": self.step, "seconds": (self.seconds() if now is None else now) - seconds,
                "tokens": self.tokens - tokens, "stopped_by": stopped_by}

    def save_state(self, stopped_by: str | None = None) -> None:
        """state.pt: everything a resumed run needs to go on as if this one had not stopped."""
        self.flush()
        device = next((p.device for p in self.drafter.parameters()), torch.device("cpu"))
        seconds = self.seconds()
        torch.save({"model": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "log": self.log, "tokens": self.tokens, "seconds": seconds, "clock": self.clock,
                    "runs": [*self.runs, self.run_entry(stopped_by, seconds)], "settings": self.settings,
                    "data": self.data, "rng": rng_state(device)}, self.out / "state.tmp")
        (self.out / "state.tmp").replace(self.out / "state.pt")


def train_step(runs: Sequence[MethodRun], features: Target, feed: DeviceFeed, lrs: Sequence[float]) -> int:
    """The next batch through the target once, then each run's loss, backward and optimizer step
    at its learning rate, its figures left pending on the device. Returns the batch's training
    tokens (positions whose label counts), which the host counted."""
    fed = next(feed)
    device = fed.tokens.device
    batch = features.batch(fed.tokens, fed.mask, fed.counted)
    for r, lr in zip(runs, lrs, strict=True):
        for group in r.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, metrics = r.drafter.loss(batch)
        r.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(r.params, 1.0)
        r.optimizer.step()
        r.step += 1
        r.tokens += fed.counted
        r.pending.append((r.step, r.tokens, {"loss": loss.detach(), **metrics}))
    return fed.counted


