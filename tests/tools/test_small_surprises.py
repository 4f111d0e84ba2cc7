"""Small things a new user trips on: where bench and train-drafter write, one spelling of a
flag, help that reads right, `plugins` lines that fit the terminal and name what drafters read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from speckernel.tools.bench.command import out_folder
from speckernel.tools.cli import build_parser
from speckernel.tools.train.drafter import data_path


def test_bench_writes_a_fresh_folder_unless_told_where() -> None:
    args = build_parser().parse_args(["bench", "accept"])
    assert args.out is None
    folder = out_folder(args)
    assert folder.name.startswith("bench-accept-") and folder.parent == Path(".")
    told = build_parser().parse_args(["bench", "accept", "--out", "x/y"])
    assert out_folder(told) == Path("x/y")


def test_bench_accept_takes_num_prompts_and_its_old_name() -> None:
    assert build_parser().parse_args(["bench", "accept", "--num-prompts", "4"]).num_prompts == 4
    assert build_parser().parse_args(["bench", "accept", "--limit", "3"]).num_prompts == 3


def test_max_model_len_help_reads_right() -> None:
    text = subprocess.run([sys.executable, "-m", "speckernel", "bench", "accept", "--help"], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}, timeout=60).stdout
    assert "context length, 0 for the model's own (default: 2048)" in text
    assert "None: the model's" not in text


def test_train_drafter_writes_its_data_inside_out(tmp_path: Path) -> None:
    one = build_parser().parse_args(["train-drafter", "--method", "mtp", "--out", str(tmp_path / "d")])
    assert data_path(one) == tmp_path / "d" / "data.npz"
    default = build_parser().parse_args(["train-drafter", "--method", "mtp"])
    assert data_path(default) == Path("drafters") / "data.npz"


def test_plugins_lines_fit_the_terminal_with_a_description(model_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "speckernel", "plugins"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "90"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) < 90
    ngram = next(line for line in lines if line.startswith("  ngram "))
    assert "Prompt lookup" in ngram
    eagle3 = lines.index(next(line for line in lines if line.startswith("  eagle3 ")))
    details = " ".join(lines[eagle3 + 1 : eagle3 + 5])
    assert "target_hidden_layers=()" not in details and "target_hidden_layers=(" in details
