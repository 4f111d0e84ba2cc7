"""A request the engine fails while running it, through `speckernel serve`: a 500 in OpenAI's
error shape with the core's own message (code engine_error), a stream ended by an error event
and [DONE], each counted in /metrics, and the server serving on; and a speculator that raises on
every step switched off while requests keep their output.

The failure is injected into the real core process: a `sitecustomize` on the server's
PYTHONPATH (inherited by its engine-core child) makes the runner raise for the request whose
prompt starts with MAGIC, once its output is AFTER tokens long (0: at its prefill)."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tools.test_serve import Served, httpx, post, serve_many

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

MAGIC = [11, 12, 13, 14]

FAULT = textwrap.dedent('''
    import os
    if os.environ.get("SPECKERNEL_TEST_FAULT"):
        from speckernel.runner import model_runner

        MAGIC, AFTER = [11, 12, 13, 14], int(os.environ["SPECKERNEL_TEST_FAULT"])
        poisoned = {}
        launch = model_runner.ModelRunner._launch

        def faulty(self, frame):
            for row in frame.rows:
                if row.start_pos == 0 and list(row.token_ids[:4]) == MAGIC:
                    poisoned[row.key] = len(row.token_ids) + AFTER
                if row.key in poisoned and row.start_pos + row.num_tokens >= poisoned[row.key]:
                    raise RuntimeError("device fault (injected)")
            return launch(self, frame)

        model_runner.ModelRunner._launch = faulty

    if os.environ.get("SPECKERNEL_TEST_SPECULATOR_FAULT"):
        from speckernel.speculators.ngram import NgramSpeculator

        def propose(self, states, k):
            raise IndexError("index 70000 is out of bounds for dimension 0 with size 512")

        NgramSpeculator.propose = propose
''')

TINY = ["--model", "random:tiny", "--platform", "cpu", "--max-model-len", "128", "--num-kv-blocks", "128"]
GOOD = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True}




@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    """A plain server and one whose ngram speculator raises on every step, both with the fault."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(FAULT)
    saved = dict(os.environ)
    os.environ.update(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                      SPECKERNEL_TEST_FAULT="3", SPECKERNEL_TEST_SPECULATOR_FAULT="1")
    try:
        with serve_many(TINY, [*TINY, "--speculator", "ngram", "--num-speculative-tokens", "3"]) as started:
            yield started
    finally:
        os.environ.clear()
        os.environ.update(saved)


def errors_counted(served: Served) -> float:
    return served.metric('speckernel_requests_total{outcome="error"}', 0.0)


def test_a_request_that_fails_in_the_core_is_a_typed_500_counted_and_the_server_serves_on(
        servers: list[Served]) -> None:
    served = servers[0]
    before = errors_counted(served)
    r = post(served, "/v1/completions", GOOD | {"prompt": [*MAGIC, 5]}, key=None)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error == {"message": "RuntimeError: device fault (injected)", "type": "server_error", "param": None,
                     "code": "engine_error"}
    assert errors_counted(served) == before + 1
    ok = post(served, "/v1/completions", GOOD, key=None)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6


def test_a_stream_that_fails_mid_way_ends_with_an_error_event_and_done(servers: list[Served]) -> None:
    served = servers[0]
    before = errors_counted(served)
    body = GOOD | {"prompt": [*MAGIC, 6], "stream": True, "max_tokens": 20}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert sum(t.count("<") for t in texts) == 3  # the tokens before the fault reached the client
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    assert errors_counted(served) == before + 1


def test_a_speculator_failing_every_step_is_switched_off_and_answers_stay_the_targets(
        servers: list[Served]) -> None:
    plain, spec = servers
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9], [4, 4, 4, 4]]
    for prompt in prompts:
        want = post(plain, "/v1/completions", GOOD | {"prompt": prompt, "max_tokens": 12}, key=None)
        got = post(spec, "/v1/completions", GOOD | {"prompt": prompt, "max_tokens": 12}, key=None)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert spec.metric("speckernel_spec_speculator_off") == 1.0
    assert spec.metric("speckernel_spec_speculator_failures_total") >= 8
    assert httpx.get(f"{spec.url}/health").status_code == 200
    log = Path(spec.log).read_text()
    assert "speculator_switched_off" in log
