"""Token masks that arrive after their step was launched.

A structured-output row run ahead of its frame in flight samples under a mask that depends on
the token that frame samples, which the host learns only when the frame is done. Its step needs
the mask only after the forward, so the runner issues the forward, then the mask's copy behind a
host gate, then the sampling; the engine, once the frame before is applied, advances the
grammars, writes the masks where the copy reads them and opens the gate. The device runs the
forward while the host works out the grammar, instead of waiting for both in turn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..platform import HostGate
from .token_masks import put

STAGED_WAIT_S = 0.001
"""How often `deliver` looks whether a launch that never staged its masks has ended."""


class LateMasks:
    """One step's late masks: the runner stages them (all ones where they come late) and gates
    their copy; the engine delivers them and opens the gate."""

    def __init__(self, gate: HostGate) -> None:
        self.gate = gate
        self._host: np.ndarray | None = None
        self._staged = threading.Event()

    def staged(self, host: np.ndarray) -> None:
        """The runner's thread: the [rows, positions, W] host view the gated copy reads."""
        self._host = host
        self._staged.set()

    def deliver(self, masks: Sequence[bytes], launch_ended: Callable[[], bool]) -> None:
        """The engine's thread: masks[i] (b"": none) into frame row i, then the gate opens. Waits
        for the runner to stage them, unless its launch ended without (it failed before)."""
        while not self._staged.wait(STAGED_WAIT_S):
            if launch_ended():
                break
        if self._host is not None:
            for i, mask in enumerate(masks):
                put(self._host, i, mask)
        self.gate.open()

    def release(self) -> None:
        """Opens the gate without masks (the engine stops): nothing waits on it for ever."""
        self.gate.open()

    @property
    def held_s(self) -> float:
        """How long the gated work waited for the masks (the device, or the runner's thread)."""
        g = self.gate
        return max(0.0, g.passed_at - g.blocked_at) if g.blocked_at and g.passed_at else 0.0
