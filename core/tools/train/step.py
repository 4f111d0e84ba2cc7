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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

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


@dataclass
class MethodRun:
    """One method's training: its drafter, optimizer, log and folder; the figures of its steps
    since the last flush wait on the device in `pending`."""

    method: str
    cls: type[TrainableSpeculator]
    drafter: TrainableDrafter
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    out: Path
    log: list[dict[str, float]] = field(default_factory=list)
    step: int = 0
    pending: list[tuple[int, Figures]] = field(default_factory=list)

    def flush(self) -> None:
        """The pending steps' figures into the log (one read of the device for all of them)."""
        if self.pending:
            read = read_figures([f for _, f in self.pending])
            self.log.extend({"step": step, **values} for (step, _), values in zip(self.pending, read, strict=True))
            self.pending.clear()

    def save_state(self) -> None:
        self.flush()
        torch.save({"model": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "log": self.log}, self.out / "state.tmp")
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
        r.pending.append((r.step, {"loss": loss.detach(), **metrics}))
    return fed.counted


