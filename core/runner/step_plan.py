"""The per-row plan a step sends to the device, as named columns with their dtypes.

A plan is two arrays: the int64 columns, one row per step row, and the float32 columns, one
row per column (so each float column is contiguous on the device). Both ride along on the
attention backend's one host-to-device copy (`AttentionBackend.prepare(row_extra=...,
row_floats=...)`), each in a section of its own dtype. `Scheme.put` writes a column on the host,
`Scheme.of` reads it on the device; nobody else indexes the plan by number.

Three layouts use these columns: `STEP`, what the runner's step reads (`model_runner`),
`DRAFTER`, what a served drafter's padded pass reads (`engine.drafter_steps`), and
`ROW_SAMPLING`, sampling values alone. A column means the same in each.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .host_copy import to_device

if TYPE_CHECKING:
    from ..attention import AttentionMetadata
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

    __hash__ = object.__hash__  # members are singletons: identity hashing spares Enum's Python-level hash per lookup

    @property
    def dtype(self) -> str:
        return self.value[0]


SAMPLING = {Col.TEMPERATURE: "temperature", Col.TOP_P: "top_p", Col.TOP_K: "top_k", Col.SEED: "seed",
            Col.POSITION: "position", Col.REPETITION: "repetition_penalty", Col.FREQUENCY: "frequency_penalty",
            Col.PRESENCE: "presence_penalty"}
"""The columns a row's `RowSampling` fills, with the field each takes."""

NEUTRAL = {Col.TOP_P: 1.0, Col.REPETITION: 1.0}
"""Values that mean "off" where 0 does not (a row that does not sample, a padding row)."""


class HostPlan(NamedTuple):
    """A plan on the host, as the step's planner fills it."""

    ints: np.ndarray
    """[rows, int columns] int64."""
    floats: np.ndarray
    """[float columns, rows] float32."""

    @property
    def rows(self) -> int:
        return self.ints.shape[0]

    def overwrite(self, head: HostPlan) -> None:
        """`head`'s rows over this plan's first rows (real rows ahead of padding)."""
        self.ints[: head.rows] = head.ints
        self.floats[:, : head.rows] = head.floats

    def to(self, device: torch.device) -> DevicePlan:
        """The plan on the device, in copies the host does not wait for (`host_copy.to_device`)."""
        return DevicePlan(to_device(self.ints, device), to_device(self.floats, device))


class DevicePlan(NamedTuple):
    """A plan on the device, as the step reads it."""

    ints: torch.Tensor
    floats: torch.Tensor


class Scheme:
    """An ordered set of columns: the layout of one kind of plan."""

    def __init__(self, *columns: Col) -> None:
        self.columns = columns
        self.ints = tuple(c for c in columns if c.dtype == "int64")
        self.floats = tuple(c for c in columns if c.dtype == "float32")
        self.index = {c: i for group in (self.ints, self.floats) for i, c in enumerate(group)}
        self._float = {c: c.dtype == "float32" for c in columns}
        self._neutral = np.array([NEUTRAL.get(c, 0.0) for c in self.floats], np.float32)[:, None]

    @property
    def int_width(self) -> int:
        return len(self.ints)

    @property
    def float_width(self) -> int:
        return len(self.floats)

    def empty(self, rows: int) -> HostPlan:
        """A plan of rows that sample nothing, every float column off."""
        floats = np.empty((len(self.floats), rows), np.float32)
        floats[:] = self._neutral
        return HostPlan(np.zeros((rows, len(self.ints)), np.int64), floats)

    def column(self, plan: HostPlan, col: Col) -> np.ndarray:
        """A column on the host ([rows], a view in its own dtype)."""
        return plan.floats[self.index[col]] if self._float[col] else plan.ints[:, self.index[col]]

    def put(self, plan: HostPlan, col: Col, values: object, rows: slice | list[int] = slice(None)) -> None:
        """Writes a column (or some of its rows) on the host."""
        i = self.index[col]
        if self._float[col]:
            plan.floats[i, rows] = values
        else:
            plan.ints[rows, i] = values

    def put_sampling(self, plan: HostPlan, rows: slice | list[int], sampling: Sequence[RowSampling]) -> None:
        """The sampling columns of these rows, from their `RowSampling`."""
        if sampling:
            for col, name in SAMPLING.items():
                self.put(plan, col, [getattr(s, name) for s in sampling], rows)

    @staticmethod
    def on_device(meta: AttentionMetadata) -> DevicePlan:
        """The plan a step's metadata carries."""
        assert meta.row_extra is not None and meta.row_floats is not None, "the step was prepared without a plan"
        return DevicePlan(meta.row_extra, meta.row_floats)

    def of(self, plan: DevicePlan, col: Col) -> torch.Tensor:
        """A column on the device, in its own dtype ([R] int64 or float32)."""
        return plan.floats[self.index[col]] if self._float[col] else plan.ints[:, self.index[col]]


STEP = Scheme(Col.SLOT, Col.NUM_DRAFTS, Col.OUT_POS, Col.SAMPLES, Col.SEED, Col.POSITION, Col.TOP_K,
              Col.TEMPERATURE, Col.TOP_P, Col.SHIFTED, Col.REPETITION, Col.FREQUENCY, Col.PRESENCE)
"""The runner's step: each row's slot, drafts, output position, sampling and run-ahead shift."""

DRAFTER = Scheme(Col.SLOT, Col.ACCEPTED, Col.SEQ_LEN, Col.SAMPLES)
"""A served drafter's padded pass: what its `DeviceStates` are built from."""

ROW_SAMPLING = Scheme(*SAMPLING)
"""Sampling values alone (`SamplingTensors.from_rows`)."""
