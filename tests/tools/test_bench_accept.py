"""`bench accept --temperature 0,1`: every run, none included, at each temperature, the sampled
ones seeded per request; outputs compared with none's at every temperature; bad temperatures
refused when the command is parsed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from speckernel.sampling_params import SamplingParams
from speckernel.tools.bench import accept
from speckernel.tools.cli import build_parser
from tests.tools.test_bench import bench


def test_temperatures_parse_as_a_comma_list() -> None:
    assert build_parser().parse_args(["bench", "accept"]).temperature == [0.0]
    assert build_parser().parse_args(["bench", "accept", "--temperature", "0, 1,0.7,1"]).temperature == [0.0, 1.0, 0.7]


@pytest.mark.parametrize(("text", "says"), [
    ("-1", "expected temperatures in [0, 1e+06], got '-1'"),
    ("0,warm", "expected temperatures (numbers >= 0) separated by commas, got '0,warm'"),
    ("0,nan", "got 'nan'"),
    ("inf", "got 'inf'"),
    (",", "separated by commas"),
    ("1e-7", "below 1e-05, which samples greedily: write 0"),
])
def test_a_bad_temperature_is_refused_when_parsed(text: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["bench", "accept", "--temperature", text])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --temperature" in err and says in err


def test_a_negative_seed_is_refused_when_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "accept", "--seed", "-1"])
    assert "argument --seed: expected an integer >= 0, got '-1'" in capsys.readouterr().err


@pytest.mark.slow
def test_accept_at_temperatures_0_and_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real model, 2 HumanEval prompts of 8 tokens: each run's acceptance at both temperatures.
    The runs' requests are recorded as the engine got them: a T=1 row must come from sampled,
    seeded requests, not from greedy ones labelled T=1."""
    seen: dict[str, tuple[list[SamplingParams], list[list[int]]]] = {}
    run_one = accept.run_one

    async def recording(config: Any, conversations: Any, params: list[SamplingParams], label: str,
                        concurrency: int = 0) -> dict[str, Any]:
        result = await run_one(config, conversations, params, label, concurrency)
        seen[label] = (list(params), [list(o) for o in result["outputs"]])
        return result

    monkeypatch.setattr(accept, "run_one", recording)
    report, rows = bench("accept", ["--platform", "cpu", "--dtype", "float32", "--num-prompts", "2",
                                    "--max-tokens", "8", "--speculator", "ngram", "--temperature", "0,1",
                                    "--seed", "7"], tmp_path, monkeypatch)
    assert report["temperatures"] == [0.0, 1.0] and report["seed"] == 7
    runs = report["runs"]
    # temperature 0 keeps the keys of reports before --temperature; T=1's are beside them
    assert list(runs) == ["none", "ngram", "none@T=1", "ngram@T=1"] == list(seen)
    assert [(r["name"], r["temperature"]) for r in runs.values()] == [("none", 0.0), ("ngram", 0.0), ("none", 1.0),
                                                                      ("ngram", 1.0)]
    for key in ("ngram", "ngram@T=1"):
        spec = runs[key]["spec"]
        assert spec["num_draft_tokens"] > 0 and spec["mean_acceptance_length"] >= 1.0
        assert len(spec["acceptance_per_position"]) == 4 and all(0.0 <= a <= 1.0
                                                                 for a in spec["acceptance_per_position"])
        assert runs[key]["tokens_per_s_ratio"] > 0
    assert runs["none"]["identical_to_no_speculation"] == runs["ngram"]["identical_to_no_speculation"] == 2
    # sampled, seeded: verification draws the plain sampler's uniforms, so ngram gives the plain tokens
    assert runs["none@T=1"]["identical_to_no_speculation"] == runs["ngram@T=1"]["identical_to_no_speculation"] == 2

    for key in ("none", "ngram"):
        assert [(p.temperature, p.seed) for p in seen[key][0]] == [(0.0, None)] * 2
    for key in ("none@T=1", "ngram@T=1"):
        assert [(p.temperature, p.seed) for p in seen[key][0]] == [(1.0, 7), (1.0, 8)]  # seed S + i
    greedy, sampled = seen["none"][1], seen["none@T=1"][1]
    assert any(a != b for a, b in zip(greedy, sampled, strict=True)), "the T=1 run answered greedily"

    text = (tmp_path / "accept.md").read_text()
    assert "temperature 0 and 1" in text
    assert text.index("## Temperature 0") < text.index("| ngram | ") < text.index("## Temperature 1")
    assert [row.split(" | ")[0] for row in rows if not row.startswith("| speculator")] == ["| none", "| ngram"] * 2
    assert rows[-1].endswith("| 2 |") and rows[1].endswith("| 2 |")  # ngram at T=1, ngram at T=0: both compared


def test_a_report_from_before_temperatures_still_renders() -> None:
    """accept.json files written before --temperature have neither `temperatures` nor a run's
    `name` and `temperature`: their table and plot are the temperature-0 ones."""
    spec = {"acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "acceptance_per_position": [0.5],
            "num_draft_tokens": 4, "num_accepted_tokens": 2, "num_k0_steps": 0, "num_host_draft_copies": 1}
    run = {"spec": spec, "num_steps": 3, "tokens_per_s": 10.0, "tokens_per_s_ratio": 1.0,
           "identical_to_no_speculation": 2, "platform": "cpu", "dtype": "float32"}
    report = {"dataset": "HumanEval (2 prompts, chat template)", "max_tokens": 8, "num_speculative_tokens": 1,
              "command": "speckernel bench accept", "host": "x86_64 Linux", "runs": {"ngram": run}}
    text = "\n".join(accept.markdown(report))
    assert "temperature 0," in text and "| ngram | 0.500 | 2.00 | 0.50 |" in text
