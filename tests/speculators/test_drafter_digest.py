"""A learned drafter's weights never load damaged without a word. A checkpoint at a shipped
checkpoint's place is checked against the pinned digest even when its config.json records none
(served with --draft-model, or started from with `train-drafter --init`); any other checkpoint
whose config.json records no digest loads with a warning naming the missing digest (damaged
weights would otherwise only show as acceptance falling). A small random target on the CPU."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.models.builtin import sha256_of
from speckernel.speculators import learned
from speckernel.tools.cli import build_parser
from speckernel.tools.train.data import Sequences
from speckernel.tools.train.drafter import train

pytestmark = pytest.mark.xdist_group(__name__)

TARGET = "random:tiny,num_layers=6"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mtp checkpoint for the tiny target, as train-drafter writes it (its digest recorded)."""
    folder = tmp_path_factory.mktemp("trained")
    rng = np.random.default_rng(0)
    Sequences.pack([(rng.integers(3, 500, 6).tolist(), rng.integers(3, 500, 20).tolist()) for _ in range(6)]
                   ).save(folder / "data.npz")
    train(build_parser().parse_args(["train-drafter", "--method", "mtp", "--target", TARGET, "--data",
                                     str(folder / "data.npz"), "--out", str(folder / "mtp"), "--steps", "2",
                                     "--device", "cpu", "--seq-len", "32", "--batch-size", "4", "--holdout", "0"]))
    return folder / "mtp"


def damaged_copy(trained: Path, folder: Path) -> Path:
    """A copy with one weight nudged (finite, the right shape: every tensor check passes) and a
    config.json that records no digest."""
    shutil.copytree(trained, folder)
    path = folder / "model.safetensors"
    state = load_file(str(path))
    name = next(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)
    state[name] = state[name] + torch.ones_like(state[name])
    save_file(state, str(path), metadata={"format": "pt"})
    cfg = msgspec.structs.replace(learned.read_config(folder), sha256="")
    (folder / "config.json").write_bytes(msgspec.json.encode(cfg))
    return folder


@pytest.fixture
def warnings_seen() -> list[str]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("speckernel")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def core_with(draft: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=TARGET, platform="cpu", max_model_len=128, speculator="mtp",
                                   draft_model=str(draft), num_speculative_tokens=2))


@pytest.fixture
def shipped_place(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The trained checkpoint put where the shipped ones live, pinned as the shipped mtp, then
    damaged there with its config.json's digest removed."""
    monkeypatch.setenv("SPECKERNEL_CACHE", str(tmp_path / "cache"))  # the shipped file's stamp goes here
    monkeypatch.setattr(learned, "WEIGHTS", tmp_path / "weights")
    monkeypatch.setitem(learned.SHIPPED_SHA256, "mtp", sha256_of(trained / "model.safetensors"))
    return damaged_copy(trained, tmp_path / "weights" / "mtp")


def test_a_shipped_checkpoint_is_checked_against_its_pinned_digest_whatever_its_config_says(
        shipped_place: Path) -> None:
    with pytest.raises(InvalidInputError, match="corrupt, its sha256 is not the shipped one"):
        core_with(shipped_place)


def test_init_from_a_damaged_shipped_checkpoint_is_refused(shipped_place: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.npz"
    Sequences.pack([([1, 2, 3], [4, 5, 6])]).save(data)
    args = ["train-drafter", "--method", "mtp", "--target", TARGET, "--data", str(data), "--steps", "0",
            "--device", "cpu", "--holdout", "0"]
    with pytest.raises(InvalidInputError, match="corrupt, its sha256 is not the shipped one"):
        train(build_parser().parse_args([*args, "--out", str(tmp_path / "a"), "--init", "mtp"]))  # by name
    with pytest.raises(InvalidInputError, match="corrupt"):
        train(build_parser().parse_args([*args, "--out", str(tmp_path / "b"), "--init", str(shipped_place)]))


def test_a_checkpoint_without_a_digest_loads_with_a_warning_naming_it(trained: Path, tmp_path: Path,
                                                                      warnings_seen: list[str]) -> None:
    folder = damaged_copy(trained, tmp_path / "mtp")
    core_with(folder)  # served: nothing to check it against, so it loads, and says so
    said = [w for w in warnings_seen if "drafter_weights_unverified" in w]
    assert len(said) == 1 and str(folder / "model.safetensors") in said[0] and "no sha256 digest" in said[0]
    warnings_seen.clear()
    core_with(trained)  # a digest recorded: checked, no warning
    assert not [w for w in warnings_seen if "drafter_weights_unverified" in w]
