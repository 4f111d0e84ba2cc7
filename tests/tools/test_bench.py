"""`speckernel bench` scenarios on the CPU with tiny settings: each writes its JSON (header and
per-run keys), its markdown table (one row per run) and its plot; random-weight models load
with their preset's shapes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from speckernel.errors import UnknownModelError
from speckernel.models.checkpoint import read_config, resolve
from speckernel.models.loader import load_model
from speckernel.tools import cli
from speckernel.tools.bench.repeats import SPREAD_WARNING, median_run, spread_cell, spread_note, warn_if_noisy

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HEADER_KEYS = {"scenario", "command", "host", "versions", "platform", "dtype", "device"}
STREAM_KEYS = {"concurrency", "num_requests", "generated_tokens", "elapsed_s", "tokens_per_s", "tpot_p50_ms",
               "tpot_p99_ms", "ttft_p50_ms", "num_steps", "steps_per_s", "spec"}


def bench(scenario: str, args: list[str], out: Path,
          monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[str]]:
    """Runs one scenario through the CLI; returns its report and the rows of its tables."""
    argv = ["bench", scenario, *args, "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["speckernel", *argv])  # the report records this process's command
    assert cli.main(argv) == 0
    report = json.loads((out / f"{scenario}.json").read_text())
    assert report["scenario"] == scenario and report["command"] == "speckernel " + " ".join(argv)
    assert set(report["versions"]) >= {"torch", "transformers", "triton"}
    rows = [line for line in (out / f"{scenario}.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("|---")]
    assert (out / f"{scenario}.png").exists() or not HAS_MATPLOTLIB
    return report, rows[1:]  # without the header row


# --- random-weight models ---------------------------------------------------------------------


def test_random_llama3_8b_has_the_real_shapes() -> None:
    cfg = read_config(resolve("random:llama3-8b"))  # the config only: 16 GB of weights are not built here
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 32, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (14336, 128256, 500000.0)
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == ()
    assert read_config(resolve("random:llama3-8b,num_layers=2")).num_layers == 2


def test_random_model_loads_with_its_shapes_and_the_same_weights_every_time() -> None:
    path = resolve("random:tiny,num_layers=3,hidden_size=32")
    cfg = read_config(path)
    model = load_model(path, torch.float32, torch.device("cpu"), 64)
    assert len(model.layers) == 3
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    q = cfg.num_heads * cfg.head_dim
    assert shapes["embed.weight"] == (cfg.vocab_size, 32)
    assert shapes["lm_head.weight"] == (cfg.vocab_size, 32)
    assert shapes["layers.0.attn.qkv.weight"] == (q + 2 * cfg.num_kv_heads * cfg.head_dim, 32)
    assert shapes["layers.2.mlp.gate_up.weight"] == (2 * cfg.intermediate_size, 32)
    assert torch.equal(model.layers[0].input_norm.weight, torch.ones(32))
    assert 0.015 < model.layers[0].mlp.down.weight.std().item() < 0.025
    again = load_model(path, torch.float32, torch.device("cpu"), 64)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


@pytest.mark.parametrize("name", ["random:nope", "random:tiny,layers=2", "random:tiny,num_layers",
                                  "random:tiny,num_layers=two"])
def test_bad_random_names_fail_before_loading(name: str) -> None:
    with pytest.raises(UnknownModelError):
        resolve(name)


def test_weight_bytes_of_llama3_8b() -> None:
    from speckernel.tools.bench.scale import step_bytes

    weights, kv = step_bytes(read_config(resolve("random:llama3-8b")), 2, 100)
    embed = 128256 * 4096
    assert weights == 2 * (8_030_261_248 - embed + 4096)  # all of Llama-3-8B but the embedding table, less a row
    assert kv == 2 * 32 * 2 * 8 * 128 * 100


# --- scenarios --------------------------------------------------------------------------------


def test_scale_on_random_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, rows = bench("scale", ["--platform", "cpu", "--model", "random:tiny", "--compare", "random:tiny",
                                   "--layers", "3", "--prompt-len", "16", "--warmup-steps", "1", "--steps", "4",
                                   "--copy-mib", "8", "--copy-repeats", "2"], tmp_path, monkeypatch)
    assert set(report) >= HEADER_KEYS | {"copy_bandwidth_gb_s", "models"}
    assert report["dtype"] == "bfloat16" and report["copy_bandwidth_gb_s"] > 0
    assert [m["model"] for m in report["models"]] == ["random:tiny,num_layers=3"] * 2
    for m in report["models"]:
        assert m["num_layers"] == 3 and m["num_steps_timed"] == 4
        assert m["step_p50_ms"] > 0 and m["floor_ms"] > 0 and m["step_over_floor"] > 0
    assert len(rows) == 2 and rows[0].startswith("| random:tiny,num_layers=3 | 3 |")


def test_scale_compares_small_batch_kernels_and_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, rows = bench("scale", ["--platform", "cpu", "--model", "random:tiny", "--compare", "random:smollm2-135m",
                                   "--layers", "1", "--batch", "1,2", "--small-batch-kernels", "both",
                                   "--prompt-len", "8", "--warmup-steps", "1", "--steps", "2", "--copy-mib", "8",
                                   "--copy-repeats", "2"], tmp_path, monkeypatch)
    runs = [(m["model"].split(",")[0], m["batch"], m["small_batch_kernels"]) for m in report["models"]]
    assert runs == [(model, batch, small) for model in ("random:tiny", "random:smollm2-135m") for batch in (1, 2)
                    for small in (True, False)]
    for m in report["models"]:
        assert m["tokens_per_s"] == pytest.approx(m["batch"] * 1e3 / m["step_p50_ms"])
        assert (m["speedup_over_off"] is not None) == m["small_batch_kernels"]
    assert len(rows) == 8 and rows[1].split(" | ")[2:4] == ["1", "off"]


def test_kernels_times_each_kernel_and_sweeps_tiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    report, rows = bench("kernels", ["--models", "random:tiny", "--kernels", "qkv,o,gate_up,down", "--rows", "1,3",
                                     "--sweep", "--repeats", "4"], tmp_path, monkeypatch)
    assert [(r["kernel"], r["m"]) for r in report["results"]] == [(k, m) for k in ("qkv", "o", "gate_up", "down")
                                                                   for m in (1, 3)]
    assert all(r["old_us"] > 0 and r["new_us"] > 0 and r["floor_us"] > 0 for r in report["results"])
    assert [(r["m"], r["new_us"]) for r in report["layers"]] == [
        (m, pytest.approx(sum(r["new_us"] for r in report["results"] if r["m"] == m))) for m in (1, 3)]
    best = {b["kernel"]: b for b in report["best"]}
    assert set(best) == {"qkv", "o", "gate_up", "down"}
    for b in best.values():  # the best tile is the sweep's least total over the rows
        totals: dict[tuple[int, ...], float] = {}
        for s in report["sweep"]:
            if s["kernel"] == b["kernel"]:
                totals[tuple(s["tile"])] = totals.get(tuple(s["tile"]), 0.0) + s["us"]
        assert tuple(b["tile"]) == min(totals, key=totals.__getitem__)
    text = (tmp_path / "kernels.md").read_text()
    assert '("residual", 64, ANY, Tile(' in text and '("residual", ANY, ANY, Tile(' in text  # o's K, then down's
    assert len(rows) >= 8


SCALE_TINY = ["--platform", "cpu", "--model", "random:tiny", "--compare", "random:tiny", "--layers", "1",
              "--prompt-len", "8", "--warmup-steps", "1", "--steps", "2", "--copy-mib", "8", "--copy-repeats", "2"]


def test_without_matplotlib_no_plot_is_written_or_claimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    bench("scale", SCALE_TINY, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert not (tmp_path / "scale.png").exists()
    wrote = [line for line in err.splitlines() if line.startswith("bench: wrote ")]
    assert wrote == [f"bench: wrote {tmp_path / 'scale.json'}, {tmp_path / 'scale.md'}"]
    assert "no plot: matplotlib is not installed" in err


def test_the_files_the_command_names_are_the_files_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    bench("scale", SCALE_TINY, tmp_path, monkeypatch)
    wrote = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("bench: wrote "))
    named = {Path(p) for p in wrote.removeprefix("bench: wrote ").split(", ")}
    assert named == set(tmp_path.iterdir())


def test_repeats_keep_the_median_run_and_its_spread(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [{"tokens_per_s": v, "tpot_p50_ms": 1000 / v} for v in (30.0, 10.0, 12.0)]
    r = median_run(runs)
    assert r["tokens_per_s"] == 12.0 and r["tpot_p50_ms"] == 1000 / 12.0  # every figure from the one median run
    assert r["repeats"] == {"n": 3, "key": "tokens_per_s", "values": [30.0, 10.0, 12.0], "median": 12.0,
                            "min": 10.0, "max": 30.0, "spread": pytest.approx(20.0 / 12.0)}
    assert median_run(runs[1:])["tokens_per_s"] == 10.0  # even count: the lower median, a real run
    assert spread_cell(r) == "10.0-30.0 (167%)" and spread_cell(median_run(runs[:1])) == "\N{EN DASH}"
    warn_if_noisy(r, "none c=1")
    assert "none c=1: tokens_per_s spread 167% of the median over 3 runs" in capsys.readouterr().err
    warn_if_noisy(median_run([{"tokens_per_s": 100.0}, {"tokens_per_s": 100.0 * (1 + SPREAD_WARNING / 2)}]), "x")
    assert capsys.readouterr().err == ""


def test_the_spread_sentence_is_made_from_the_figures() -> None:
    quiet = median_run([{"tokens_per_s": 100.0, "c": 1}, {"tokens_per_s": 104.0, "c": 1}])
    wide = median_run([{"tokens_per_s": 100.0, "c": 4}, {"tokens_per_s": 150.0, "c": 4}])
    assert spread_note([quiet], lambda r: f"c={r['c']}")[-1] == (
        "Each row is the median of 2 runs; the largest spread (max - min over the median) is 4%, within 10%.")
    note = spread_note([quiet, wide], lambda r: f"c={r['c']}")[-1]
    assert "c=4 50%" in note and "c=1" not in note
    assert "no spread" in spread_note([median_run([{"tokens_per_s": 1.0}])], str)[-1]


@pytest.mark.parametrize(("load", "says"), [(0.3, "under half the CPUs busy"), (1.5, "other work held half")])
def test_the_startup_sentence_on_host_load_follows_the_load(load: float, says: str) -> None:
    from speckernel.tools.bench.startup import markdown  # beside the scenario's other tests

    phases = {"python_s": 0.1, "import_s": 1.0, "load_s": 2.0, "first_token_s": 0.5, "total_s": 3.6}
    report = {"command": "speckernel bench startup", "host": "x86_64 Linux", "versions": {}, "model": "m",
              "repeats": 3, "cpu_count": 2, "load_average": {"before": load, "after": 2.5},
              "modes": {"process": {"median": phases, "min_total_s": 3.5, "max_total_s": 3.7, "median_cpu_s": 4.0}}}
    text = "\n".join(markdown(report))
    assert says in text and "slows every phase" not in text


# The decode, hostsync and prefill scenarios below check the report's keys, counts and comparisons,
# not what the real model writes (its outputs are checked by the engine's tests): random:tiny
# runs the same scenario code without the real model's ~200-token prefills. Its tokenizer has no
# vocabulary for HumanEval's text, so every prompt is one token; greedy, the model then falls into
# a loop from its fifth token on, which ngram drafts (and hence decode's 12 tokens, not 4).


@pytest.mark.slow
def test_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, rows = bench("decode", ["--platform", "cpu", "--model", "random:tiny", "--max-tokens", "12",
                                    "--num-prompts", "2", "--repeats", "2", "--concurrency", "1,2",
                                    "--speculator", "ngram", "--no-hf"], tmp_path, monkeypatch)
    assert set(report) >= HEADER_KEYS | {"runs", "peers", "modes", "concurrency"}
    assert report["peers"] == {} and report["modes"] == ["inprocess"]
    runs = report["runs"]
    assert [(r["speculator"], r["concurrency"]) for r in runs] == [("none", 1), ("none", 2), ("ngram", 1),
                                                                    ("ngram", 2)]
    assert [r["num_requests"] for r in runs] == [2, 8, 2, 8]  # concurrency C > 1 runs at least 4 x C requests
    for r in runs:
        assert set(r) >= STREAM_KEYS | {"ratio_to_none", "identical_to_none", "ratio_to_peers", "ratio_to_vllm",
                                        "ttft_p99_ms", "longest_stall_ms"}
        assert r["identical_to_none"] == r["num_requests"]  # greedy float32: speculation changes no token
        assert r["spec"]["num_k0_steps"] >= 0 and r["generated_tokens"] == 12 * r["num_requests"]
        assert r["longest_stall_ms"] >= 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"]
        rep = r["repeats"]  # two runs on the same engine; the row is the lower-median one's
        assert rep["n"] == 2 and len(rep["values"]) == 2 and r["tokens_per_s"] == rep["median"] == min(rep["values"])
        assert rep["spread"] == pytest.approx((max(rep["values"]) - min(rep["values"])) / rep["median"])
    assert runs[2]["spec"]["mean_acceptance_length"] >= 1.0 and runs[0]["spec"]["mean_acceptance_length"] is None
    for r in runs:  # the host's share by phase; the CPU runs each step inside its launch: no device time apart
        assert set(r["host_us_per_step"]) == set(r["host_us_per_row"]) == {"schedule", "launch", "apply"}
        assert all(v > 0 for v in r["host_us_per_step"].values()) and r["device_ms_per_step"] is None
        assert r["rows_per_step"] >= 1 and r["host_us_per_row"]["launch"] * r["rows_per_step"] == \
            pytest.approx(r["host_us_per_step"]["launch"])
    assert [r["rows_per_step"] > 1.5 for r in runs] == [False, True, False, True]  # concurrency 2 batches
    assert [row.split(" | ")[1:3] for row in rows[: len(runs)]] == [["none", "1"], ["none", "2"], ["ngram", "1"],
                                                                   ["ngram", "2"]]
    text = (tmp_path / "decode.md").read_text()  # the prose says what the table shows
    assert "Requests per run, by concurrency: 1: 2, 2: 8." in text and "median tokens/s of 2" in text
    assert "| mode | speculator | concurrency | rows a step | step period ms | device ms a step |" in text


def test_pp_layouts_start_with_pp1_and_count_dp1_once() -> None:
    import argparse

    from speckernel.tools.bench.pp import layouts

    args = argparse.Namespace(pipeline_sizes=[1, 2], data_parallel_sizes=[1, 2], dp_ranks=["process", "in-process"])
    assert layouts(args) == [(1, 1, "default"), (2, 1, "default"), (1, 2, "process"), (1, 2, "in-process")]


@pytest.mark.slow
def test_grammar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real model (the grammar needs its vocabulary), one short request: constraints beside free
    text, with and without a speculator, forced drafts and late masks. A constrained row run ahead
    gets its masks after launch (the report counts those steps); one that waits for its step's
    tokens leaves the device waiting for the host between its steps, and the report says how long."""
    modes = ("free", "json_schema", "boilerplate", "choice")  # the others' validators: the test below
    report, rows = bench("grammar", ["--platform", "cpu", "--max-tokens", "8", "--num-prompts", "1",
                                     "--concurrency", "1", "--speculator", "ngram", "--late-masks", "on,off",
                                     "--modes", ",".join(modes)], tmp_path, monkeypatch)
    runs = report["runs"]
    variants = [("none", f, late) for f in (True, False) for late in (True, False)]
    assert [(r["speculator"], r["forced_drafts"], r["late_masks"], r["mode"]) for r in runs] == [
        (*v, m) for v in [*variants, ("ngram", True, True), ("ngram", False, True)] for m in modes]
    for r in runs:
        assert set(r) >= STREAM_KEYS | {"ratio_to_free", "valid_outputs", "identical_to_none", "num_device_gaps",
                                        "device_gap_ms", "device_gap_share", "identical_to_no_forced",
                                        "identical_to_no_late_masks", "num_late_mask_steps", "late_mask_wait_ms"}
        # greedy float32: neither speculation, forced drafts nor late masks change a token
        assert r["identical_to_none"] == r["identical_to_no_forced"] == r["num_requests"] == 1
        assert r["identical_to_no_late_masks"] in (1, None)
        assert r["num_forced_accepted"] == r["num_forced_drafts"], "a forced draft is the only token greedy can take"
        if not r["forced_drafts"]:
            assert r["num_forced_drafts"] == 0
        elif r["mode"] in ("json_schema", "boilerplate") and not r["late_masks"]:  # a fixed key, an enum of one value
            assert r["num_forced_drafts"] > 0, r
        ahead = r["speculator"] == "none" and r["late_masks"]
        if r["mode"] != "free" and ahead:  # rows run ahead: their masks came after launch
            assert r["num_late_mask_steps"] > 0 and r["late_mask_wait_ms"] >= 0, r
        elif r["mode"] != "free":  # every step of a constrained row waits for the one before
            assert r["num_late_mask_steps"] == 0
            assert r["num_device_gaps"] >= r["num_steps"] - 2, r
            assert r["device_gap_ms"] > 0 and 0 < r["device_gap_share"] < 1
    assert r["mode"] == "choice" and r["valid_outputs"] == 1, "a choice fits in 8 tokens"
    assert len(rows) == len(runs) and rows[1].startswith("| none | on | on | json_schema | 1 |")


def test_grammar_validators_check_every_constraint() -> None:
    from speckernel.tools.bench.grammar import valid

    person = {"full_name": "Ada", "age_in_years": 36,
              "home_address": {"street_address": "1 Rue", "city_name": "Paris", "country_code": "FR"},
              "employment_status": "retired"}
    record = {"record_type": "person_profile", "schema_version": "2024-01-01", "person": person}
    assert valid(json.dumps(record), "boilerplate")
    assert not valid(json.dumps(record | {"schema_version": "2025"}), "boilerplate"), "an enum value"
    assert not valid(json.dumps(record | {"person": person | {"age_in_years": "36"}}), "boilerplate"), "a type"
    assert not valid(json.dumps(record | {"person": {**person, "extra": 1}}), "boilerplate"), "an extra field"
    assert valid('{"name": "Ada", "age": 36, "city": "Paris", "hobbies": ["chess"]}', "json_schema")
    assert not valid('{"name": "Ada", "age": true, "city": "Paris", "hobbies": []}', "json_schema")
    assert valid("Ada is 36 years old and lives in Paris.", "regex") and not valid("Ada is 36.", "regex")
    assert valid("a chef", "choice") and not valid("a cook", "choice")
    assert valid('{"a": 1}', "json_object") and not valid("[1]", "json_object") and valid("anything", "free")


@pytest.mark.slow
def test_hostsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, rows = bench("hostsync", ["--platform", "cpu", "--model", "random:tiny", "--max-tokens", "4",
                                      "--num-prompts", "2", "--repeats", "1", "--concurrency", "1",
                                      "--speculator-option", "num_layers=1"], tmp_path, monkeypatch)
    assert set(report) >= HEADER_KEYS | {"speculator", "runs"}
    assert [r["force_host_drafts"] for r in report["runs"]] == [False, True]
    for r in report["runs"]:
        assert set(r) >= STREAM_KEYS | {"ratio_to_host_copies", "identical_to_host_copies"}
        assert r["identical_to_host_copies"] == 2
    copies = [r["spec"]["num_host_draft_copies"] for r in report["runs"]]
    assert copies[0] == 0 and copies[1] > 0  # fixed width: drafts stay on the device unless forced to the host
    assert [row.split(" | ")[0] for row in rows] == ["| False", "| True"]


def test_a_bench_cut_short_keeps_the_runs_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Each finished run is a line of `<scenario>.runs.jsonl` as the bench goes (a time limit or a
    failure later keeps them); a bench that ends well leaves only its report."""
    from speckernel.tools.bench import hostsync

    args = ["--platform", "cpu", "--model", "random:tiny", "--max-tokens", "4", "--num-prompts", "2", "--repeats",
            "1", "--concurrency", "1", "--speculator-option", "num_layers=1"]

    def fails(report: dict[str, Any]) -> list[str]:
        raise RuntimeError("a failure after the runs")

    with monkeypatch.context() as m:
        m.setattr(hostsync, "markdown", fails)
        with pytest.raises(RuntimeError, match="after the runs"):
            bench("hostsync", args, tmp_path / "cut", monkeypatch)
    lines = [json.loads(line) for line in (tmp_path / "cut" / "hostsync.runs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(r["tokens_per_s"] > 0 and r["run"] for r in lines), lines
    assert "the 2 runs that finished are in" in capsys.readouterr().err
    bench("hostsync", args, tmp_path / "whole", monkeypatch)
    assert not (tmp_path / "whole" / "hostsync.runs.jsonl").exists()


@pytest.mark.slow
def test_prefill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, rows = bench("prefill", ["--platform", "cpu", "--model", "random:tiny", "--prompt-tokens", "48",
                                     "--num-prompts", "2", "--concurrency", "1", "--repeats", "1"],
                         tmp_path, monkeypatch)
    runs = {(r["speculator"], r["skip_drafts"]): r for r in report["runs"]}
    assert list(runs) == [("none", None), ("ngram", True), ("ngram", False)]
    for r in runs.values():
        assert r["prompt_tokens"] == 96 and r["generated_tokens"] == 2 and r["prefill_tokens_per_s"] > 0
    # max_tokens=1: no step can verify a draft, so every step skips drafting exactly when allowed to
    assert runs[("ngram", True)]["spec"]["num_k0_steps"] == runs[("ngram", True)]["num_steps"]
    assert runs[("ngram", False)]["spec"]["num_k0_steps"] == 0
    assert len(rows) == 3


@pytest.mark.slow
def test_hf_peers_match_the_engine(hf_model, core, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The peers' harness on the conftest HF model: eager and prompt-lookup greedy outputs equal
    the engine's token for token (the compiled peer is left to GPU runs: compiling takes minutes)."""
    from speckernel.sampling_params import SamplingParams
    from speckernel.tools.bench.hf import run_peer
    from tests.conftest import run_to_completion

    prompts = [tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(")]
    engine = run_to_completion(core, prompts, SamplingParams(max_tokens=5, temperature=0.0), "hf")
    for peer in ("hf_eager", "hf_prompt_lookup"):
        result = run_peer(hf_model, peer, prompts, 5, tuple(tokenizer.eos_token_ids), 3, torch.device("cpu"))
        assert result["outputs"] == engine and result["generated_tokens"] == sum(len(e) for e in engine)
        assert result["tokens_per_s"] > 0 and result["tpot_p50_ms"] is not None


@pytest.mark.slow
def test_pp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pp grid on a tiny one: every layout (DP ranks as processes and as threads) at every
    concurrency, with PP=1 as the reference; the stages' transport named, the DP ranks' turn and
    vote timed."""
    report, rows = bench("pp", ["--platform", "cpu", "--model", "random:tiny", "--max-tokens", "4",
                                "--num-prompts", "2", "--concurrency", "1,2", "--pipeline-sizes", "1,2",
                                "--dp-ranks", "in-process", "--speculator", "ngram", "--max-model-len", "256"],
                         tmp_path, monkeypatch)  # DP ranks as processes: tests/engine/test_data_parallel.py
    assert set(report) >= HEADER_KEYS | {"runs", "concurrency"} and report["concurrency"] == [1, 2]
    runs = report["runs"]
    layouts = ((1, 1, "in-process"), (2, 1, "in-process"), (1, 2, "in-process"))
    assert [(r["speculator"], r["pipeline_parallel_size"], r["data_parallel_size"], r["ranks"], r["concurrency"])
            for r in runs] == [(s, *layout, c) for s in ("none", "ngram") for layout in layouts for c in (1, 2)]
    for r in runs:
        assert set(r) >= STREAM_KEYS | {"step_period_ms", "ratio_to_pp1", "identical_to_pp1", "transport"}
        assert r["identical_to_pp1"] == r["num_requests"] == 2  # greedy float32: layouts change no token
        assert r["generated_tokens"] == 8 and r["step_period_ms"] > 0
        pipeline, dp = r["pipeline_parallel_size"] > 1, r["data_parallel_size"] > 1
        assert r["transport"] == ("zmq" if pipeline else None), "the CPU's preferred transport, as the engine picked it"
        assert (r["bubble_mean"] is not None) == pipeline
        assert (r["dp_step_period_ms"] is not None) == dp and (r["dp_vote_share"] is not None) == dp
        if dp:
            assert 0 < r["dp_vote_share"] <= 1 and r["dp_step_period_ms"] > 0
        if (r["pipeline_parallel_size"], r["data_parallel_size"]) == (1, 1):
            assert r["ratio_to_pp1"] == 1.0
    assert len(rows) == len(runs) and [row.split(" | ")[1:5] for row in rows[:2]] == [["1", "1", "1", "2"],
                                                                                    ["1", "1", "2", "2"]]


@pytest.mark.parametrize(("spec", "says"), [("none", "always runs first"), ("bogus", "unknown speculator 'bogus'"),
                                            ("mtp:x", "K must be a whole number")])
def test_a_bad_speculator_is_refused_before_anything_runs(spec: str, says: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "pp", "--platform", "cpu", "--speculator", "ngram", "--speculator", spec])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
