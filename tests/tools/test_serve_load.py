"""`speckernel serve` under load, on loopback with the tiny random model: 256 streaming requests at
once, a quarter of them disconnecting mid-stream. Every completed greedy output equals the same
prompt's output alone; the disconnected requests are aborted in the core at once (their tokens
stop, their KV blocks come back: /metrics shows none in use); the server still answers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from speckernel.tools.cli import main
from tests.tools.test_serve import Served, serve

httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

NUM_REQUESTS = 256
NUM_PROMPTS = 32
MAX_TOKENS = 12
LEAVER_MAX_TOKENS = 1500
"""Disconnecting requests ask for this many tokens: if they were not aborted, they would still be
generating long after the others finished."""
TIMEOUT_S = 50


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 500 + 1 for j in range(5 + i % 7)]


async def stream(client: httpx.AsyncClient, ids: list[int], max_tokens: int, leave_after: int | None) -> str | None:
    """Streams one completion; leaves after `leave_after` text chunks (returns None then)."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            chunks += bool(choice["text"])
            if leave_after is not None and chunks >= leave_after:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve("--model", "random:tiny", "--platform", "cpu", "--num-kv-blocks", "16384") as started:
        yield started


def test_256_streams_with_disconnects_match_solo_and_free_every_block(served: Served) -> None:
    anyio.run(load, served)


def test_bench_serve_measures_a_running_server(served: Served, tmp_path: Path) -> None:
    """`speckernel bench serve --url`: every request counted, the report written."""
    assert main(["bench", "serve", "--url", served.url, "--concurrency", "1,4", "--num-prompts", "4",
                 "--max-tokens", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [(r["concurrency"], r["num_requests"], r["generated_tokens"]) for r in report["runs"]] == [
        (1, 4, 24), (4, 4, 24)]  # random models have no EOS: max_tokens each
    assert all(r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 and r["tpot_p99_ms"] > 0 for r in report["runs"])
    assert report["model"] == "random:tiny" and report["platform"] == "cpu"
    assert (tmp_path / "serve.md").read_text().count("| server |") == 2


async def load(served: Served) -> None:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 8, max_keepalive_connections=NUM_REQUESTS + 8)
    async with httpx.AsyncClient(base_url=served.url, limits=limits, timeout=TIMEOUT_S) as client:
        with anyio.fail_after(TIMEOUT_S):
            solo = [await stream(client, prompt(i), MAX_TOKENS, None) for i in range(NUM_PROMPTS)]
            assert all(s is not None and s.count("<") == MAX_TOKENS for s in solo)
            generated_before = served.metric("speckernel_engine_generated_tokens_total")
            results: dict[int, str | None] = {}

            async def one(i: int) -> None:
                leaver = i % 4 == 0
                results[i] = await stream(client, prompt(i % NUM_PROMPTS),
                                          LEAVER_MAX_TOKENS if leaver else MAX_TOKENS, 2 if leaver else None)

            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                for i in range(NUM_REQUESTS):
                    tg.start_soon(one, i)
            elapsed = time.monotonic() - started
            completed = {i: text for i, text in results.items() if i % 4}
            assert len(completed) == NUM_REQUESTS * 3 // 4
            mismatched = [i for i, text in completed.items() if text != solo[i % NUM_PROMPTS]]
            assert not mismatched, (f"{len(mismatched)} outputs differ from their solo output, e.g. "
                                    f"{completed[mismatched[0]]} vs {solo[mismatched[0] % NUM_PROMPTS]}")
            assert all(results[i] is None for i in range(0, NUM_REQUESTS, 4))

            # Every block comes back, and soon: 64 unaborted requests would hold theirs for
            # LEAVER_MAX_TOKENS steps more.
            while served.metric("speckernel_kv_blocks_in_use") > 0:
                await anyio.sleep(0.05)
            generated = served.metric("speckernel_engine_generated_tokens_total") - generated_before
            completed_tokens = len(completed) * MAX_TOKENS
            # How soon a leaver is seen to leave depends on how fast this client reads; a quarter
            # of its tokens is far more than it ever took, and far less than it asked for.
            assert generated < completed_tokens + NUM_REQUESTS // 4 * LEAVER_MAX_TOKENS // 4, (
                f"{generated - completed_tokens} tokens went to requests whose clients had left")
            metrics = (await client.get("/metrics")).text
            assert f'speckernel_requests_total{{outcome="abort"}} {float(NUM_REQUESTS // 4)}' in metrics
            # ... and the server still answers.
            assert await stream(client, prompt(0), MAX_TOKENS, None) == solo[0]
            print(f"{NUM_REQUESTS} streams in {elapsed:.1f} s, {generated - completed_tokens:.0f} tokens "
                  "after disconnects")


def test_non_streaming_client_that_leaves_is_aborted(served: Served) -> None:
    """A client waiting for a whole (long) completion gives up: the core stops generating for it."""
    abort = 'speckernel_requests_total{outcome="abort"}'
    aborted = served.metric(abort, 0.0)
    generated = served.metric("speckernel_engine_generated_tokens_total")
    body = {"prompt": prompt(1), "max_tokens": LEAVER_MAX_TOKENS, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.monotonic() + 10  # generating all LEAVER_MAX_TOKENS takes far longer on this model
    while served.metric(abort, 0.0) == aborted or served.metric("speckernel_kv_blocks_in_use") > 0:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert served.metric(abort) == aborted + 1
    assert served.metric("speckernel_engine_generated_tokens_total") - generated < LEAVER_MAX_TOKENS / 2
    assert served.metric("speckernel_num_requests_running") == 0


def test_bench_serve_hostile_runs_each_load_with_and_without_the_hostile_share(served: Served, tmp_path: Path) -> None:
    """`bench serve --hostile 0.25`: the quiet load, then the same load with a quarter of all requests
    hostile; every hostile kind ends its own way, and the well-behaved texts equal the quiet run's."""
    assert main(["bench", "serve", "--url", served.url, "--concurrency", "4", "--num-prompts", "21",
                 "--max-tokens", "6", "--hostile", "0.25", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    quiet, hostile = report["runs"]
    assert (quiet["load"], quiet["num_hostile"], hostile["load"], hostile["num_hostile"]) == ("quiet", 0, "hostile", 7)
    assert quiet["num_requests"] == hostile["num_requests"] == 21 and hostile["generated_tokens"] == 21 * 6
    ended = hostile["hostile_outcomes"]
    # The tiny model's tokenizer reads "hello world ..." as next to nothing: its huge prompt may fit.
    assert ended.pop("huge_prompt") in ({"400": 1}, {"200": 1})
    assert ended == {"huge_body": {"413": 1}, "too_many_stops": {"400": 1}, "longest_stops": {"200": 1},
                     "disconnect": {"left": 1}, "idle": {"closed": 1}, "drip": {"closed": 1}}
    assert hostile["identical_to_quiet"] == 21 and hostile["per_token_p50_ratio_to_quiet"] > 0
    md = (tmp_path / "serve.md").read_text()
    assert "| server + 7 hostile | 4 | 21 |" in md and "huge_body: 1\N{MULTIPLICATION SIGN} 413" in md
