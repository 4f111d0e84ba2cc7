"""The per-row plan a step sends to the device, as named columns with their dtypes.

The host packs a step's plan into one int64 array that rides along on the attention backend's
one host-to-device copy (`AttentionBackend.prepare(row_extra=...)`), so a column of floats
travels as its float32 bits. This module is the one place that knows it: `Scheme.put` writes a
column of any dtype, `Scheme.of` reads it back on the device in its own dtype; nobody else
indexes the plan by number.

Three layouts use these columns: `STEP`, what the runner's step reads (`model_runner`),
`DRAFTER`, what a served drafter's padded pass reads (`engine.drafter_steps`), and
`ROW_SAMPLING`, sampling values alone. A column means the same in each.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..sampling_params import RowSampling


class Col(Enum):
    """A plan column: (its dtype on the device, what it holds)."""

    SLOT = ("int64", "the row's slot in the token buffer (padding rows: the spare slot)")
    NUM_DRAFTS = ("int64", "drafts the row verifies")
    OUT_POS = ("int64", "position of the row's first output token")
    SAMPLES = ("int64", "1 where the row samples a token")
    SEED = ("int64", "the request's sampling seed")
    POSITION = ("int64", "index of the output token the row samples (its first, when verifying)")
    TOP_K = ("int64", "top-k (0: off)")
    TEMPERATURE = ("float32", "temperature (0: greedy)")
    TOP_P = ("float32", "top-p (1: off)")
    SHIFTED = ("int64", "1 where run-ahead planned the row before its predecessor's counts were known")
    REPETITION = ("float32", "repetition penalty (1: off)")
    FREQUENCY = ("float32", "frequency penalty (0: off)")
    PRESENCE = ("float32", "presence penalty (0: off)")
    ACCEPTED = ("int64", "drafts the row's step accepted")
    SEQ_LEN = ("int64", "the row's confirmed tokens after its step")

    @property
    def dtype(self) -> str:
        return self.value[0]


SAMPLING = {Col.TEMPERATURE: "temperature", Col.TOP_P: "top_p", Col.TOP_K: "top_k", Col.SEED: "seed",
            Col.POSITION: "position", Col.REPETITION: "repetition_penalty", Col.FREQUENCY: "frequency_penalty",
            Col.PRESENCE: "presence_penalty"}
"""The columns a row's `RowSampling` fills, with the field each takes."""

NEUTRAL = {Col.TOP_P: 1.0, Col.REPETITION: 1.0}
"""Values that mean "off" where 0 does not (a row that does not sample, a padding row)."""


def _bits(values: object) -> np.ndarray:
    """float32 values as the int64 the plan array carries: their bits, read as an int32."""
    return np.asarray(values, np.float32).view(np.int32).astype(np.int64)


class Scheme:
    """An ordered set of columns: the layout of one kind of plan."""

    def __init__(self, *columns: Col) -> None:
        self.columns = columns
        self.index = {c: i for i, c in enumerate(columns)}

    @property
    def width(self) -> int:
        return len(self.columns)

    def empty(self, rows: int) -> np.ndarray:
        """[rows, width] a plan of rows that sample nothing, every float column off."""
        plan = np.zeros((rows, self.width), np.int64)
        for col, value in NEUTRAL.items():
            if col in self.index:
                plan[:, self.index[col]] = _bits(np.float32(value))
        return plan

    def put(self, plan: np.ndarray, col: Col, values: object, rows: slice | list[int] = slice(None)) -> None:
        """Writes a column (or some of its rows) on the host."""
        plan[rows, self.index[col]] = _bits(values) if col.dtype == "float32" else np.asarray(values, np.int64)

    def of(self, plan: torch.Tensor, col: Col) -> torch.Tensor:
        """A column of the plan on the device, in its own dtype ([R] int64 or float32)."""
        raw = plan[:, self.index[col]]
        return raw.to(torch.int32).view(torch.float32) if col.dtype == "float32" else raw

    def put_sampling(self, plan: np.ndarray, rows: list[int], sampling: Sequence[RowSampling]) -> None:
        """The sampling columns of these rows, from their `RowSampling`."""
        if rows:
            for col, name in SAMPLING.items():
                self.put(plan, col, [getattr(s, name) for s in sampling], rows)


STEP = Scheme(Col.SLOT, Col.NUM_DRAFTS, Col.OUT_POS, Col.SAMPLES, Col.SEED, Col.POSITION, Col.TOP_K,
              Col.TEMPERATURE, Col.TOP_P, Col.SHIFTED, Col.REPETITION, Col.FREQUENCY, Col.PRESENCE)
"""The runner's step: each row's slot, drafts, output position, sampling and run-ahead shift."""

DRAFTER = Scheme(Col.SLOT, Col.ACCEPTED, Col.SEQ_LEN, Col.SAMPLES)
"""A served drafter's padded pass: what its `DeviceStates` are built from."""

ROW_SAMPLING = Scheme(*SAMPLING)
"""Sampling values alone (`SamplingTensors.from_rows`)."""
