"""`speckernel train-drafter` resumes exactly: a training stopped halfway (killed after a
--save-every write, or by Ctrl-C) and run again ends with the weights, optimizer state and
per-step losses of one run that never stopped, bit for bit. dflash draws random anchors and
block lengths from torch's random state, and --minutes is given, so a batch stream restarted, a
random state not restored or a learning-rate schedule that follows the clock all show. Flags
that would make it another training are refused; other data is said. A small random target on
the CPU, float32, so each run takes a second or two."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from speckernel.errors import InvalidInputError
from speckernel.tools.cli import build_parser
from speckernel.tools.train import drafter as trainer
from speckernel.tools.train.data import Sequences, step_batches
from speckernel.tools.train.drafter import lr_at, train

pytestmark = pytest.mark.xdist_group(__name__)

TARGET = "random:tiny,num_layers=6"
STEPS = 6
HALF = STEPS // 2
SMALL = ["--set", "num_layers=1", "--set", "intermediate_size=64", "--set", "block_size=4"]
"""A one-layer dflash of the tiny target's width with short blocks: every part of the loss (the
random anchors and block lengths among them), at a fraction of a default drafter's cost."""


def args_for(data: Path, out: Path, *extra: str) -> argparse.Namespace:
    # --minutes: a deadline far off, which a schedule that followed the clock would still feel.
    return build_parser().parse_args([
        "train-drafter", "--method", "dflash", "--target", TARGET, "--data", str(data), "--out", str(out),
        "--device", "cpu", "--seq-len", "32", "--batch-size", "4", "--steps", str(STEPS), "--warmup", "2",
        "--lr", "3e-3", "--save-every", str(HALF), "--log-every", "2", "--holdout", "0.25", "--eval-every", "2",
        "--eval-batches", "1", "--minutes", "30", *SMALL, *extra])


def state_of(out: Path) -> dict[str, Any]:
    return torch.load(out / "state.pt", map_location="cpu", weights_only=False)


def tensors(tree: object) -> list[torch.Tensor]:
    """Every tensor of a state dict (nested: an optimizer's state), in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors(v)]
    return []


@pytest.fixture(scope="module")
def unbroken(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training in one run of STEPS steps."""
    out = tmp_path_factory.mktemp("unbroken") / "dflash"
    assert train(args_for(data, out))["steps"] == STEPS
    return out


def stop_after(monkeypatch: pytest.MonkeyPatch, steps: int, error: Callable[[], BaseException]) -> None:
    """The run stops at the step after `steps`, before it starts, with `error`."""
    real_step, calls = trainer.train_step, []

    def stopping(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) > steps:
            raise error()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", stopping)


STEP_SECONDS = 20.0
"""How far the clock of a run stopped by its deadline moves at each step: with --minutes 1 (57 s
to train, 3 s kept to save) its deadline comes after HALF steps, whatever the host's speed."""


def deadline_after_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's --minutes clock moves STEP_SECONDS at each step and not otherwise: its deadline
    stops it after HALF steps, and a schedule that followed the clock would be far along by then."""
    now = [time.monotonic()]
    real_step, real_budget = trainer.train_step, trainer.Budget

    def step(*args: Any, **kwargs: Any) -> int:
        tokens = real_step(*args, **kwargs)
        now[0] += STEP_SECONDS
        return tokens

    monkeypatch.setattr(trainer, "train_step", step)
    monkeypatch.setattr(trainer, "Budget", lambda minutes, share: real_budget(minutes, share, clock=lambda: now[0]))


@pytest.mark.parametrize("stop", ["killed", "ctrl-c", "deadline"])
def test_a_stopped_training_resumed_ends_as_one_that_never_stopped(
        stop: str, data: Path, unbroken: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """killed: the process dies after the --save-every write at HALF, without its final save;
    ctrl-c: the run saves where it got and stops; deadline: --minutes ends it at HALF (a run on a
    GPU lent for minutes). Either way the second run goes on from HALF."""
    out = tmp_path / "dflash"
    with monkeypatch.context() as patch:
        if stop == "killed":
            stop_after(patch, HALF, lambda: RuntimeError("killed"))
            with pytest.raises(RuntimeError, match="killed"):
                train(args_for(data, out))
            assert not (out / "train_log.json").exists()  # nothing after the last write of state.pt
        elif stop == "ctrl-c":
            stop_after(patch, HALF, KeyboardInterrupt)
            with pytest.raises(KeyboardInterrupt):
                train(args_for(data, out))
        else:
            deadline_after_half(patch)
            assert train(args_for(data, out, "--minutes", "1"))["stopped_by"] == "deadline"
    assert state_of(out)["step"] == HALF
    summary = train(args_for(data, out))
    assert summary["steps"] == STEPS

    want, got = state_of(unbroken), state_of(out)
    assert want["model"].keys() == got["model"].keys()
    for name in want["model"]:
        assert torch.equal(want["model"][name], got["model"][name]), name
    assert all(torch.equal(a, b) for a, b in zip(tensors(want["optimizer"]), tensors(got["optimizer"]), strict=True))
    assert torch.equal(want["rng"]["cpu"], got["rng"]["cpu"])  # the random stream, where the unbroken one left it
    assert [e["step"] for e in got["log"]] == list(range(1, STEPS + 1))
    assert [e["loss"] for e in got["log"]] == [e["loss"] for e in want["log"]]
    assert [e["tokens"] for e in got["log"]] == [e["tokens"] for e in want["log"]]
    assert [{k: v for k, v in e.items() if k.startswith("val_")} for e in got["log"]][-1] == \
        [{k: v for k, v in e.items() if k.startswith("val_")} for e in want["log"]][-1]

    # The log over both runs: totals, and one entry per run (a killed one never said what stopped it).
    log = json.loads((out / "train_log.json").read_text())
    whole = json.loads((unbroken / "train_log.json").read_text())["summary"]
    assert log["summary"]["tokens"] == whole["tokens"] == sum(e["tokens"] for e in log["summary"]["each_run"])
    assert log["summary"]["runs"] == 2 and whole["runs"] == 1
    first, second = log["summary"]["each_run"]
    assert (first["from_step"], first["to_step"], second["from_step"], second["to_step"]) == (0, HALF, HALF, STEPS)
    assert first["stopped_by"] == {"killed": None, "ctrl-c": "interrupted", "deadline": "deadline"}[stop]
    assert second["stopped_by"] == "steps"
    assert log["summary"]["seconds"] == pytest.approx(first["seconds"] + second["seconds"])
    clock = log["clock"]
    assert [s for s, _ in clock] == sorted(s for s, _ in clock) and clock[-1][0] == STEPS
    assert all(a <= b for (_, a), (_, b) in itertools.pairwise(clock))


def test_the_batch_of_a_step_depends_on_the_seed_and_the_step_alone(data: Path) -> None:
    sequences = Sequences.load(data)
    from_start = step_batches(sequences, 4, 32, seed=7)
    later = [next(from_start) for _ in range(5)][3:]
    resumed = step_batches(sequences, 4, 32, seed=7, first=3)
    for want in later:
        got = next(resumed)
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
    other = next(step_batches(sequences, 4, 32, seed=8, first=3))
    assert not np.array_equal(other[0], later[0][0])


def test_the_schedule_follows_the_step_alone() -> None:
    args = argparse.Namespace(lr=1.0, warmup=2, steps=12)
    assert [lr_at(s, args) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, args) == pytest.approx(1.0) and lr_at(12, args) == pytest.approx(0.1)
    assert lr_at(7, args) == pytest.approx(0.55)  # halfway through the decay


@pytest.mark.parametrize(("flag", "value"), [("--lr", "1e-3"), ("--warmup", "3"), ("--batch-size", "2"),
                                             ("--seq-len", "24"), ("--seed", "1")])
def test_a_resumed_run_with_other_training_flags_is_refused(flag: str, value: str, data: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dflash"
    with monkeypatch.context() as patch:
        stop_after(patch, 1, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            train(args_for(data, out))
    before = (out / "state.pt").read_bytes()
    with pytest.raises(InvalidInputError, match=f"trained with {flag} .*asks for {flag} .*another --out"):
        train(args_for(data, out, flag, value))
    assert (out / "state.pt").read_bytes() == before  # a refused run changes nothing


def test_other_steps_or_data_on_resume_go_on_with_a_note(data: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dflash"
    train(args_for(data, out, "--steps", "2"))
    assert train(args_for(data, out, "--steps", "3"))["steps"] == 3
    assert "--steps 3 (state.pt: 2): the learning rate from step 2 on follows" in capsys.readouterr().err
    more = tmp_path / "more.npz"
    rng = np.random.default_rng(1)
    Sequences.concat([Sequences.load(data), Sequences.pack([(rng.integers(3, 500, 8).tolist(),
                                                             rng.integers(3, 500, 24).tolist())])]).save(more)
    summary = train(args_for(more, out, "--steps", "4"))
    assert summary["steps"] == 4 and summary["runs"] == 3
    assert "the training data is not what state.pt was trained on" in capsys.readouterr().err
