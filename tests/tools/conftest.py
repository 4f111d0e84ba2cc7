"""Fixtures the train-drafter tests share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speckernel.tools.train.data import Sequences


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve short answers to random prompts of the tiny target's vocabulary, as token data."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "data.npz"
    pairs = [(rng.integers(3, 500, 8).tolist(), rng.integers(3, 500, 24).tolist()) for _ in range(12)]
    Sequences.pack(pairs).save(path)
    return path
