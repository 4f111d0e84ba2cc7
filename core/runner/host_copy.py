"""Host arrays to the device and device tensors to the host, without the host waiting.

Every device-to-host copy the runner makes goes through `to_host`: a step's tokens and counts,
the next drafts where the host must see them, logprobs. Draft IDs are always its `drafts`
argument, so what a step copies can be told from the calls alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` on the device, through pinned memory in a copy the host does not wait for: a copy
    from pageable memory waits for its stream, so for everything queued there first (a stream
    gate included). On the CPU, `a` itself."""
    host = torch.from_numpy(a)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostTensors:
    """Tensors copied to the host, readable once their event passed (at once on the CPU)."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.Event | None) -> None:
        self.tensors = tensors
        self.event = event

    def ready(self) -> bool:
        """The copies are done (asks the device; never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            if not self.event.query():  # one that passed costs no synchronising call
                self.event.synchronize()
            self.event = None
        return self.tensors


def to_host(tokens: torch.Tensor | None, drafts: torch.Tensor | None = None,
            extra: Sequence[torch.Tensor] = ()) -> HostTensors:
    """tokens, drafts (draft IDs, when the host must see them) and extra tensors in host memory:
    on a device, pinned memory filled by copies the host does not wait for, behind one event.
    Its tensors are in that order, the missing ones left out."""
    parts = [t for t in (tokens, drafts, *extra) if t is not None]
    if not parts or parts[0].device.type == "cpu":
        return HostTensors([t.clone() for t in parts], None)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in parts]
    event = torch.Event(parts[0].device)
    event.record()
    return HostTensors(host, event)


def draft_lists(ids: list[list[int]]) -> list[list[int]]:
    """Host draft rows trimmed at their first -1."""
    return [row[: next((m for m, t in enumerate(row) if t < 0), len(row))] for row in ids]


def drafts_on_host(ids: torch.Tensor) -> list[list[int]]:
    """Draft IDs [R, K] copied to the host now (the host waits for them)."""
    return to_host(None, ids).wait()[0].tolist()


class StepCopy:
    """A step's copy to the host, issued right after its launch and waited for only when read:
    per row its output tokens (-1 padded), the real drafts it verified and its accepted count,
    then the next drafts where the host must see them, then the logprobs of the rows that asked."""

    def __init__(self, packed: torch.Tensor, drafts: torch.Tensor | None = None,
                 logprobs: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.width = packed.shape[1] - 2
        """Output columns: a padded step verifies its bucket's width, more than its rows hold."""
        self.has_drafts = drafts is not None
        self.has_logprobs = logprobs is not None
        self._copy = to_host(packed, drafts, logprobs or ())
        self._rows: list[list[int]] | None = None

    def ready(self) -> bool:
        """Reading the copy would not wait."""
        return self._copy.ready()

    def rows(self) -> list[list[int]]:
        """[R, width + 2]: output tokens, drafts verified, accepted."""
        if self._rows is None:
            self._rows = self._copy.wait()[0].tolist()
        return self._rows

    def accepted(self) -> list[int]:
        return [v[self.width + 1] for v in self.rows()]

    def drafts(self) -> list[list[int]]:
        """[R, K] the next drafts (-1 ends a row)."""
        assert self.has_drafts
        ids: list[list[int]] = self._copy.wait()[1].tolist()
        return ids

    def logprobs(self) -> tuple[list[list[list[float]]], list[list[list[int]]]] | None:
        if not self.has_logprobs:
            return None
        values, ids = self._copy.wait()[-2:]
        return values.tolist(), ids.tolist()


@contextmanager
def syncs_fail(enabled: bool) -> Iterator[None]:
    """With `enabled` (on CUDA), a host sync inside the block raises where it happens
    (`torch.cuda.set_sync_debug_mode`): the GPU's own check that a step never waits for the host."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
