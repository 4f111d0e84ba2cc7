"""The step plan's columns reach the device with their own dtype and value, at addresses a
captured graph can rely on."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speckernel.ops.paged_attention import TorchPagedAttention
from speckernel.runner.step_plan import NEUTRAL, STEP, Col

BLOCK = 8


def _prepare(backend: TorchPagedAttention, rows: int, padded_rows: int, tail: int, values: dict[Col, list[float]]):
    plan = STEP.empty(padded_rows)
    for col, column in values.items():
        STEP.put(plan, col, column, slice(0, rows))
    chunks = [(0, 1, [i]) for i in range(rows)]
    return backend.prepare(chunks, num_tokens=padded_rows, num_rows=padded_rows, row_extra=plan.ints,
                           row_floats=plan.floats, tail=np.arange(tail, dtype=np.int64))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), pad=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_every_column_arrives_in_its_dtype_with_its_value(rows: int, pad: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values: dict[Col, list[float]] = {
        col: (rng.uniform(0, 2, rows).astype(np.float32).tolist() if col.dtype == "float32"
              else rng.integers(-2**40, 2**40, rows).tolist()) for col in STEP.columns}
    backend = TorchPagedAttention(BLOCK, 16, torch.device("cpu"), max_rows=16)
    meta = _prepare(backend, rows, rows + pad, tail=3, values=values)
    plan = STEP.on_device(meta)
    for col in STEP.columns:
        got = STEP.of(plan, col)
        assert got.dtype == (torch.float32 if col.dtype == "float32" else torch.int64), col
        want = np.asarray(values[col], np.float32 if col.dtype == "float32" else np.int64)
        assert np.array_equal(got[:rows].numpy(), want), col
        if col.dtype == "float32":
            assert got.is_contiguous(), col  # sampling kernels read a float column as one array
        padding = got[rows:].numpy()
        assert np.all(padding == NEUTRAL.get(col, 0)), (col, padding)


def test_the_plan_does_not_move_when_the_host_tokens_do() -> None:
    """A captured step reads the plan where it was at capture: only the tail may change size."""
    backend = TorchPagedAttention(BLOCK, 16, torch.device("cpu"), max_rows=8, max_blocks=4)
    backend.reserve(16, 8, STEP.int_width, 48, STEP.float_width)
    values = {Col.TEMPERATURE: [0.5, 1.5], Col.SLOT: [3, 4]}
    first = _prepare(backend, 2, 4, tail=0, values=values)
    ptrs = (first.row_extra.data_ptr(), first.row_floats.data_ptr(), first.block_tables.data_ptr())
    for tail in (3, 12, 45):
        meta = _prepare(backend, 2, 4, tail=tail, values=values)
        assert (meta.row_extra.data_ptr(), meta.row_floats.data_ptr(), meta.block_tables.data_ptr()) == ptrs
        assert STEP.of(STEP.on_device(meta), Col.TEMPERATURE)[:2].tolist() == [0.5, 1.5]


def test_steps_of_one_size_each_read_their_own_numbers() -> None:
    """Steps of the same sizes share their views of the plan buffer: each still reads its own
    plan, and a buffer that grows leaves no view on the old one."""
    backend = TorchPagedAttention(BLOCK, 4, torch.device("cpu"), max_rows=2)
    for slots in ([3, 4], [7, 9], [1, 2]):
        meta = _prepare(backend, 2, 2, tail=3, values={Col.SLOT: slots})
        assert STEP.of(STEP.on_device(meta), Col.SLOT).tolist() == slots
    big = _prepare(backend, 2, 2, tail=4 * backend.capacity, values={Col.SLOT: [5, 6]})  # grows the buffer
    assert STEP.of(STEP.on_device(big), Col.SLOT).tolist() == [5, 6]
    meta = _prepare(backend, 2, 2, tail=3, values={Col.SLOT: [8, 1]})
    assert meta.row_extra is not None and meta.row_extra.untyped_storage().data_ptr() == backend.buffer.data_ptr()
    assert STEP.of(STEP.on_device(meta), Col.SLOT).tolist() == [8, 1]
