"""The vLLM peer's measuring loop and its place in `bench decode`'s report, without vLLM: the
loop drives any object with vLLM's engine interface (add_request, has_unfinished_requests,
step), so a scripted engine checks what it measures; vLLM itself runs in the GPU benchmark."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from speckernel.tools.bench import decode, vllm_peer


class ScriptedEngine:
    """Each step gives every request in flight one token; request i wants lengths[i] tokens.
    Records how many were in flight at each step, and sleeps `stall_s` once on step `stall_at`."""

    def __init__(self, lengths: list[int], stall_at: int = -1, stall_s: float = 0.0) -> None:
        self.lengths, self.stall_at, self.stall_s = lengths, stall_at, stall_s
        self.live: dict[str, list[int]] = {}
        self.in_flight: list[int] = []
        self.steps = 0

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        i = prompt["prompt_token_ids"][0]
        self.live[rid] = [i, 0]

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[Any]:
        if self.steps == self.stall_at:
            time.sleep(self.stall_s)
        self.steps += 1
        self.in_flight.append(len(self.live))
        outs = []
        for rid, state in list(self.live.items()):
            i, n = state
            state[1] += 1
            done = state[1] == self.lengths[i]
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=[100 * i + n])]))
            if done:
                del self.live[rid]
        return outs


def test_keeps_c_requests_in_flight_and_collects_every_token() -> None:
    lengths = [3, 5, 2, 4, 6, 1]
    engine = ScriptedEngine(lengths)
    prompts = [[i] for i in range(len(lengths))]
    r = vllm_peer.run_concurrency(engine, None, prompts, 2, "test", [0])
    assert r["outputs"] == [[100 * i + n for n in range(length)] for i, length in enumerate(lengths)]
    assert r["generated_tokens"] == sum(lengths) and r["num_requests"] == 6
    assert max(engine.in_flight) == 2 and engine.in_flight[0] == 2  # the next is added as one finishes
    assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] >= 0


def test_reports_the_longest_gap_between_two_tokens_of_one_request() -> None:
    engine = ScriptedEngine([6, 6], stall_at=3, stall_s=0.2)
    r = vllm_peer.run_concurrency(engine, None, [[0], [1]], 2, "test", [0])
    assert r["longest_stall_ms"] >= 200
    quiet = vllm_peer.run_concurrency(ScriptedEngine([6, 6]), None, [[0], [1]], 2, "test", [0])
    assert quiet["longest_stall_ms"] < 100


def test_decode_report_gets_the_ratio_to_each_vllm_peer_at_its_concurrency() -> None:
    def run(spec: str, c: int, tps: float, outputs: list[list[int]]) -> dict[str, Any]:
        return {"mode": "inprocess", "speculator": spec, "concurrency": c, "tokens_per_s": tps,
                "outputs": outputs, "num_requests": len(outputs)}

    runs = [run("none", 1, 900.0, [[1, 2]]), run("none", 16, 5000.0, [[1], [2]]),
            run("ngram", 1, 1800.0, [[1, 2]])]
    peer = {"vllm": {"runs": [{"concurrency": 1, "tokens_per_s": 300.0, "outputs": [[1, 2]]},
                              {"concurrency": 16, "tokens_per_s": 2500.0, "outputs": [[1], [3]]}]},
            "vllm_ngram": {"error": "it did not start", "runs": []}}
    decode.compare(runs, {}, ["inprocess"], peer)
    assert runs[0]["ratio_to_vllm"] == {"vllm": 3.0} and runs[1]["ratio_to_vllm"] == {"vllm": 2.0}
    assert runs[2]["ratio_to_vllm"] == {"vllm": 6.0}
    assert [v["identical_to_engine"] for v in peer["vllm"]["runs"]] == [1, 1]
    assert all("outputs" not in v for v in peer["vllm"]["runs"])


def test_runs_only_the_vllm_peers_asked_for(tmp_path: Any, monkeypatch: Any) -> None:
    """`--vllm-peers vllm` spares a run the ngram configuration's start-up: one child, one entry."""
    children: list[dict[str, Any]] = []

    def child(cmd: list[str], **_: Any) -> None:
        job, out = cmd[-2], cmd[-1]
        children.append(json.loads(Path(job).read_text()))
        Path(out).write_text(json.dumps({"runs": [{"concurrency": 1, "tokens_per_s": 1.0}]}))

    monkeypatch.setattr(vllm_peer, "hf_folder", lambda model, dtype: tmp_path)
    monkeypatch.setattr(vllm_peer.subprocess, "run", child)
    peers = vllm_peer.run_peers("m", "bfloat16", [[1, 2]], {1: 1}, 8, 4, 4, 64, names=("vllm",))
    assert list(peers) == ["vllm"] and [c["k"] for c in children] == [0]
    both = vllm_peer.run_peers("m", "bfloat16", [[1, 2]], {1: 1}, 8, 4, 4, 64)
    assert list(both) == ["vllm", "vllm_ngram"] and [c["k"] for c in children[1:]] == [0, 4]
