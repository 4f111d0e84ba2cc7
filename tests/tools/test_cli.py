"""The `speckernel` command as a user runs it: real processes, the real model wherever its output
is checked (a flag's or a report's plumbing alone runs on random:tiny)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import msgspec
import pytest
import torch

from speckernel.outputs import RequestOutput, Timing
from speckernel.tools.cli import summary

CLI = [sys.executable, "-m", "speckernel.tools.cli"]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


PRIMARY = ["generate", "--raw", "--prompt", "The three primary colors are", "--temperature", "0", "--json",
           "--platform", "cpu"]
"""The greedy plain run that the HF test checks and the speculative run must reproduce."""
SHARED = pytest.mark.xdist_group(f"{__name__}.primary")
"""The tests that read the plain run, on the one worker that makes it."""


@pytest.fixture(scope="module")
def primary() -> dict[str, Any]:
    """`generate` of 48 tokens, made once: the HF test checks all of it, and the first 20 tokens
    are what a 20-token run gives (greedy at batch 1: a step does not depend on max_tokens)."""
    proc = run(*PRIMARY, "--max-tokens", "48")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


@pytest.mark.slow
@SHARED
def test_generate_json_matches_hf_greedy(primary, hf_model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    out = primary
    assert {"text", "token_ids", "prompt_token_ids", "finish_reason", "timing", "stats"} <= out.keys()
    prompt = out["prompt_token_ids"]
    assert prompt == tokenizer.encode("The three primary colors are")
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == ref
    assert out["finish_reason"] == "length"
    assert out["text"] == tokenizer.decode(ref)
    assert out["stats"]["num_draft_tokens"] == 0 and out["stats"]["num_accepted_tokens"] == 0


@pytest.mark.slow
def test_generate_streams_chat_answer() -> None:
    proc = run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "24",
               "--temperature", "0", "--platform", "cpu", "--speculator", "ngram")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]  # one summary line, whatever logged before it
    assert re.fullmatch(r"speckernel: \d+ tokens, [\d.]+ tok/s, first token [\d.]+s, load [\d.]+s"
                        r"(, acceptance \d+% \(\d+/\d+ drafts\))? \((stop|length)\)", last), last
    quiet = run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "4",  # the flag alone:
                "--temperature", "0", "--platform", "cpu", "--quiet", "--model", "random:tiny")  # no real model
    assert quiet.returncode == 0 and "tok/s" not in quiet.stderr, quiet.stderr


def test_summary_names_tokens_speed_and_acceptance() -> None:
    out = RequestOutput(request_id="r", delta_text="", delta_token_ids=[], text="abc", token_ids=[1, 2, 3, 4, 5],
                        prompt_token_ids=[9], finished=True, finish_reason="length",
                        timing=Timing(arrival=10.0, first_token=10.5, finished=12.5),
                        stats={"num_draft_tokens": 8, "num_accepted_tokens": 6})
    assert summary(out, 7.31) == ("speckernel: 5 tokens, 2.0 tok/s, first token 0.50s, load 7.3s, "
                                  "acceptance 75% (6/8 drafts) (length)")
    plain = msgspec.structs.replace(out, token_ids=[1], stats={"num_draft_tokens": 0})
    assert summary(plain, 1.0) == "speckernel: 1 token, first token 0.50s, load 1.0s (length)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--model", "/no/such/model.gguf"], "unknown model"),
        (["--platform", "tpu"], "unknown platform 'tpu'; available:"),
        (["--repetition-penalty", "0"], "repetition_penalty: expected a number in [0.01, 100.0], got 0.0"),
        (["--presence-penalty", "3"], "presence_penalty: expected a number in [-2.0, 2.0], got 3.0"),
        (["--frequency-penalty", "-2.5"], "frequency_penalty: expected a number in [-2.0, 2.0], got -2.5"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    proc = run("generate", "--prompt", "hi", *args, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.slow
def test_prompt_too_long_exits_2() -> None:
    proc = run("generate", "--raw", "--prompt", "word " * 600, "--max-model-len", "256", "--platform", "cpu")
    assert proc.returncode == 2
    assert "context holds 256" in proc.stderr.strip().splitlines()[-1]


def test_plugins_json_lists_builtins_with_capabilities() -> None:
    proc = run("plugins", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert set(found) == {"speculators", "platforms", "transports"}
    assert {"cpu", "cuda", "ascend"} <= set(found["platforms"])
    assert found["platforms"]["cpu"]["available"] is True
    assert found["platforms"]["cpu"]["dist_backend"] == "gloo"
    assert found["platforms"]["cuda"]["default_dtype"] == "bfloat16"
    assert {"inproc", "zmq"} <= set(found["transports"])
    assert found["transports"]["zmq"]["cross_process"] is True


@pytest.mark.slow
@SHARED
def test_generate_json_reports_speculation_counters(primary: dict[str, Any]) -> None:
    """The target as its own draft model accepts every draft: the counters must say so."""
    proc = run(*PRIMARY, "--max-tokens", "20", "--speculator", "draft_model", "--num-speculative-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == primary["token_ids"][:20]  # the plain run's first 20 tokens
    stats = out["stats"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == 1.0 and stats["acceptance_per_position"] == [1.0, 1.0, 1.0]
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["num_draft_tokens"] / stats["num_drafts"])
    assert stats["engine"]["num_host_draft_copies"] == 0
    proc = run("generate", "--prompt", "hi", "--speculator", "no-such-drafter", timeout=120)
    assert proc.returncode == 2 and "available: causal_cascade, dflash, draft_model, dspark, eagle3, mtp, ngram" \
        in proc.stderr


@pytest.mark.slow
def test_bench_accept_writes_json_table_and_plot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    # The report's runs, rows and plot, not the real model's acceptance: random:tiny (one-token
    # prompts, see tests/tools/test_bench.py) falls into a loop by its fifth token, which ngram drafts.
    proc = run("bench", "accept", "--limit", "2", "--max-tokens", "8", "--speculator", "ngram",
               "--speculator", "ngram:2:prompt_lookup_max=2", "--speculator", "ngram:2:prompt_lookup_max=3",
               "--model", "random:tiny", "--platform", "cpu", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "accept.json").read_text())
    assert report["dataset"].startswith("HumanEval (2 prompts")
    ngram, none = report["runs"]["ngram"], report["runs"]["none"]
    assert ngram["identical_to_no_speculation"] == 2 and none["spec"]["num_draft_tokens"] == 0
    assert ngram["spec"]["num_host_draft_copies"] > 0  # variable width copies its drafts
    table = (tmp_path / "accept.md").read_text()
    assert "| ngram |" in table and report["command"] in table
    # runs that differ only in their options keep a row each
    assert {"ngram K=2 prompt_lookup_max=2", "ngram K=2 prompt_lookup_max=3"} <= set(report["runs"])
    assert "| ngram K=2 prompt_lookup_max=3 |" in table
    assert (tmp_path / "accept.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_version_and_python_dash_m() -> None:
    from speckernel import __version__

    proc = subprocess.run([sys.executable, "-m", "speckernel", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"speckernel {__version__}", proc.stderr
