"""The grammars' allowed tokens of a step, in one persistent device buffer.

A structured-output step replays a device graph like any other: the graph reads the bitmask
where it was when it was captured, and the host refills it before each step with one copy it
does not wait for. Rows and positions without a grammar allow every token (all ones), so one
buffer serves a step that mixes constrained and free rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..ops.staging import StagingRing


class TokenMasks:
    def __init__(self, rows: int, positions: int, vocab_size: int, device: torch.device, pinned: bool) -> None:
        self.rows = rows
        self.positions = positions
        """Sampled positions a row may have in one step: K + 1."""
        self.words = (vocab_size + 31) // 32
        self.buffer = torch.full((rows * positions * self.words,), -1, dtype=torch.int32, device=device)
        self.staging = StagingRing(device, torch.int32, pinned)

    def view(self, rows: int, positions: int) -> torch.Tensor:
        """[rows, positions, W] int32: what a step of that shape reads (the same address for every
        step of the shape, which is what a captured graph needs)."""
        return self.buffer[: rows * positions * self.words].view(rows, positions, self.words)

    def fill(self, masks: Sequence[bytes], rows: int, positions: int) -> torch.Tensor:
        """Stages the frame rows' masks (`ScheduledRow.token_bitmask`, b"" for none) in the first
        rows, all ones elsewhere, and copies them into `view(rows, positions)` in one copy."""
        staged, _ = self.stage(masks, rows, positions)
        return self.send(staged, rows, positions)

    def stage(self, masks: Sequence[bytes], rows: int, positions: int) -> tuple[torch.Tensor, np.ndarray]:
        """(the staging array, its [rows, positions, W] host view) holding the masks, all ones
        elsewhere: rows whose masks come later (`late_masks`) are written there before `send` runs."""
        if rows > self.rows or positions > self.positions or len(masks) > rows:
            raise ValueError(f"a step of {rows} rows x {positions} positions exceeds the mask buffer "
                             f"({self.rows} x {self.positions})")
        staged = self.staging.take(rows * positions * self.words)
        host = staged.numpy().reshape(rows, positions, self.words)
        host.fill(-1)
        for i, mask in enumerate(masks):
            put(host, i, mask)
        return staged, host

    def send(self, staged: torch.Tensor, rows: int, positions: int) -> torch.Tensor:
        """The staged masks into `view(rows, positions)`, one copy the host does not wait for."""
        device = self.view(rows, positions)
        device.view(-1).copy_(staged, non_blocking=self.staging.pinned)
        self.staging.copied()
        return device


def put(host: np.ndarray, row: int, mask: bytes) -> None:
    """One row's mask (b"": none, all ones stay) into a staged [rows, positions, W] view."""
    if mask:
        allowed = np.frombuffer(mask, np.int32).reshape(-1, host.shape[2])[: host.shape[1]]
        host[row, : len(allowed)] = allowed
