"""`speckernel train-drafter` keeps its word: `--minutes` bounds the whole run (data generation
included), a checkpoint is saved whatever stopped it (the deadline, no data in time, Ctrl-C) and
loads for serving without changing a token, the run says something at least every 10 s (inside a
slow step too), `--init METHOD` names a shipped drafter, defaults fit the device, and every option
says what it does. A small random target on the CPU, so each test takes seconds."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.sampling_params import SamplingParams
from speckernel.tools.cli import build_parser
from speckernel.tools.train import drafter as trainer
from speckernel.tools.train import heartbeat
from speckernel.tools.train.args import SIZED, size_defaults
from speckernel.tools.train.budget import Budget
from speckernel.tools.train.data import Sequences, generate
from speckernel.tools.train.drafter import init_folder, train
from tests.conftest import run_to_completion

pytestmark = pytest.mark.xdist_group(__name__)

TARGET = "random:tiny,num_layers=6"
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def args_for(data: Path, out: Path, *extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["train-drafter", "--method", "mtp", "--target", TARGET, "--data", str(data),
                                      "--out", str(out), "--device", "cpu", "--seq-len", "40", "--batch-size", "8",
                                      "--holdout", "0", *extra])


class TimedLines:
    """A stderr that notes when each line was written (not a terminal: lines, not bars)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.partial = ""

    def write(self, text: str) -> int:
        self.partial += text
        *done, self.partial = self.partial.split("\n")
        self.lines.extend((time.monotonic(), line) for line in done)
        return len(text)

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False


def served_greedy(draft: Path | None) -> list[list[int]]:
    prompts = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46]]
    config = EngineConfig(model=TARGET, platform="cpu", max_model_len=128, speculator="mtp" if draft else None,
                          draft_model=str(draft) if draft else None, num_speculative_tokens=3)
    return run_to_completion(EngineCore(config), prompts, GREEDY)


def test_the_deadline_ends_training_and_the_checkpoint_serves_losslessly(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "mtp"
    started = time.monotonic()
    # 6 s, 1.5 of them kept for the save (a quarter of a short run): a deadline is a deadline at
    # any length, and a longer one only trains longer.
    summary = train(args_for(data, out, "--minutes", "0.1", "--steps", "1000000"))
    took = time.monotonic() - started
    assert summary["stopped_by"] == "deadline" and 0 < summary["steps"] < 1000000
    assert took < 6.0 + 2.0, took  # the save is inside the budget; a little slack for a busy host
    assert (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text())["sha256"]
    log = json.loads((out / "train_log.json").read_text())
    assert log["summary"]["stopped_by"] == "deadline" and len(log["log"]) == summary["steps"]
    assert served_greedy(out) == served_greedy(None)


def test_a_line_comes_at_least_every_period_even_inside_a_slow_step(data: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    every = 1.0
    monkeypatch.setattr(heartbeat, "LOG_EVERY_S", every)
    monkeypatch.setattr(trainer, "LOG_EVERY_S", every)
    real_step = trainer.train_step

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(2.5 * every)  # a step of a large batch on a CPU
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", slow)
    stderr = TimedLines()
    monkeypatch.setattr("sys.stderr", stderr)
    started = time.monotonic()
    summary = train(args_for(data, tmp_path / "mtp", "--steps", "3", "--log-every", "1000"))
    ended = time.monotonic()
    assert summary["steps"] == 3
    times = [started] + [t for t, _ in stderr.lines] + [ended]
    assert max(b - a for a, b in itertools.pairwise(times)) < every + 1.0, stderr.lines
    texts = [text for _, text in stderr.lines]
    assert any("mtp step 2 running for" in text for text in texts), texts  # said during the step


def test_ctrl_c_saves_what_was_trained_then_stops(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = trainer.train_step
    calls = []

    def interrupted_at_third(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", interrupted_at_third)
    out = tmp_path / "mtp"
    with pytest.raises(KeyboardInterrupt):
        train(args_for(data, out, "--steps", "100"))
    log = json.loads((out / "train_log.json").read_text())
    assert log["summary"]["stopped_by"] == "interrupted" and [e["step"] for e in log["log"]] == [1, 2]
    assert (out / "model.safetensors").is_file() and (out / "state.pt").is_file()
    assert served_greedy(out) == served_greedy(None)


def test_no_data_in_time_still_saves_the_drafter_it_started_with(tmp_path: Path) -> None:
    """The deadline passes before the engine answers anything: no data file is written (the
    next run generates again) and the untrained drafter is saved, as a checkpoint that serves."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Name a colour."}]}\n')
    out = tmp_path / "mtp"
    started = time.monotonic()
    summary = train(build_parser().parse_args([
        "train-drafter", "--method", "mtp", "--target", TARGET, "--prompts", str(prompts), "--out", str(out),
        "--platform", "cpu", "--device", "cpu", "--minutes", "0.002"]))  # 0.12 s, 0.05 s of it for data
    assert time.monotonic() - started < 5.0
    assert summary["stopped_by"] == "no data" and summary["steps"] == 0 and summary["sequences"] == 0
    assert not (out / "data.npz").exists() and (out / "model.safetensors").is_file()
    assert served_greedy(out) == served_greedy(None)


def test_generation_stops_at_its_deadline_and_keeps_the_answers_cut_there() -> None:
    """Answers still being written at the deadline are cut and kept as far as they got (each the
    start of what the target says), instead of every answer finishing first; prompts not started
    are left out. One answer at a time, each far longer than the time allows."""
    config = EngineConfig(model=TARGET, platform="cpu", max_num_seqs=1, max_model_len=2048, log_level="warning")
    conversations = [[{"role": "user", "content": f"<{i + 5}> <{i + 9}>"}] for i in range(4)]
    started = time.monotonic()
    whole = generate(config, conversations[:1], 12, concurrency=1)
    start_up = time.monotonic() - started  # an engine's start on this host, and 12 tokens
    allowed = 2 * start_up + 2.0
    started = time.monotonic()
    cut = generate(config, conversations, 1900, concurrency=1, deadline=started + allowed)
    assert time.monotonic() - started < allowed + 3.0  # the engine's shutdown after the deadline
    lengths = [len(cut.get(i)[0]) - cut.get(i)[1] for i in range(len(cut))]
    assert any(0 < n < 1900 for n in lengths), lengths  # the one under way, cut and kept
    assert cut.get(0)[0][: len(whole.get(0)[0])].tolist() == whole.get(0)[0].tolist()  # greedy: the same start


def test_the_budget_shares_the_time_between_data_training_and_the_save() -> None:
    now = [100.0]
    budget = Budget(1.0, data_share=0.4, clock=lambda: now[0])
    assert budget.data_deadline(training_follows=True) == 124.0
    assert budget.data_deadline(training_follows=False) == 160.0 == budget.end
    assert budget.training_end == 157.0  # 3 s kept to save
    now[0] = 150.0
    assert budget.fits(7.0) and not budget.fits(7.5)
    unlimited = Budget(0.0)
    assert not unlimited.limited and unlimited.fits(1e9)
    assert Budget(0.1).reserve == pytest.approx(1.5)  # a run of seconds keeps most of them to train


def test_init_takes_a_shipped_drafters_name() -> None:
    from speckernel.speculators.learned import WEIGHTS

    assert init_folder("mtp", "mtp", several=False) == WEIGHTS / "mtp"
    with pytest.raises(InvalidInputError, match="no such folder, nor the name of a shipped drafter"):
        init_folder("no-such-drafter", "mtp", several=False)
    with pytest.raises(InvalidInputError, match="with several, --init takes a folder"):
        init_folder("mtp", "mtp", several=True)


def test_init_by_name_starts_from_the_shipped_checkpoint(tmp_path: Path) -> None:
    """--init mtp for the default model: with no step to take, the checkpoint written is the
    shipped one, tensor for tensor; for another target, it is refused naming the shapes."""
    from safetensors.torch import load_file

    from speckernel.speculators.learned import WEIGHTS

    data = tmp_path / "data.npz"
    Sequences.pack([([1, 2, 3], [4, 5, 6])]).save(data)
    out = tmp_path / "mtp"
    summary = train(build_parser().parse_args(["train-drafter", "--method", "mtp", "--init", "mtp", "--data", str(data),
                                               "--out", str(out), "--steps", "0", "--device", "cpu"]))
    assert summary["steps"] == 0
    want, got = (load_file(str(d / "model.safetensors")) for d in (WEIGHTS / "mtp", out))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
    with pytest.raises(InvalidInputError, match="trained for a target"):
        train(args_for(data, tmp_path / "other", "--init", "mtp", "--steps", "0"))


def test_a_short_window_keeps_the_answer_of_a_long_prompt() -> None:
    """On a CPU's short windows (--seq-len 128) most prompts are longer than the window: cut from
    its start, a sequence would have no answer left to learn from."""
    from speckernel.tools.train.data import batches

    prompt, answer = list(range(1, 301)), list(range(1000, 1040))
    tokens, mask = next(batches(Sequences.pack([(prompt, answer)]), 1, 128, np.random.default_rng(0)))
    assert tokens[0, -40:].tolist() == answer and tokens[0, :88].tolist() == prompt[-88:]
    assert mask[0].sum() == 40 and mask[0, 87:127].all()  # from the prompt's last token to the last but one
    short, mask = next(batches(Sequences.pack([([1, 2, 3], [4, 5])]), 1, 128, np.random.default_rng(0)))
    assert short[0, :5].tolist() == [1, 2, 3, 4, 5] and mask[0].sum() == 2


def test_defaults_are_sized_to_the_device() -> None:
    cuda, cpu = (build_parser().parse_args(["train-drafter", "--method", "mtp"]) for _ in range(2))
    size_defaults(cuda, cuda=True)
    size_defaults(cpu, cuda=False)
    assert (cuda.num_prompts, cuda.concurrency, cuda.batch_size, cuda.seq_len, cuda.max_tokens, cuda.steps) == \
        (6000, 256, 32, 512, 256, 2000)  # the GPU defaults as they were
    assert cpu.num_prompts <= 32 and cpu.concurrency <= 8 and cpu.batch_size * cpu.seq_len <= 1024
    given = build_parser().parse_args(["train-drafter", "--method", "mtp", "--batch-size", "64"])
    size_defaults(given, cuda=False)
    assert given.batch_size == 64  # what the command line says stays
    assert set(SIZED) <= set(vars(given))


def test_every_option_says_what_it_does() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train-drafter"]
    missing = [a.option_strings for a in sub._actions if a.option_strings and not (a.help or "").strip()]
    assert missing == []
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "6000 on CUDA" in text and "--init DIR|METHOD" in text
