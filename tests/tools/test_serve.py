"""`speckernel serve` as a real server process on 127.0.0.1, with the tiny random model: bad
input answered 400 in OpenAI's error shape while the server keeps serving, the API key (401),
usage and /metrics, and a dead engine core (503, and /health says so). The official `openai`
client against the real model is in test_serve_openai.py, the load test in test_serve_load.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

START_TIMEOUT_S = 120
KEY = "sk-test-key"
TINY = ["--model", "random:tiny", "--platform", "cpu", "--max-model-len", "64", "--num-kv-blocks", "256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A `python -m speckernel serve` process: its URL, pid and log."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def core_pid(self) -> int:
        """The engine-core child, found by walking /proc (its command line names core_process)."""
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                if b"speckernel.engine.process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
        raise AssertionError("no engine-core child process")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"server did not start:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def metric(self, name: str, default: float | None = None) -> float:
        """One sample of /metrics, named with its labels if it has any."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        assert default is not None, f"{name} not in /metrics"
        return default


@contextmanager
def serve(*flags: str) -> Iterator[Served]:
    with serve_many(list(flags)) as (served,):
        yield served


@contextmanager
def serve_many(*flag_lists: list[str]) -> Iterator[list[Served]]:
    """Servers started side by side (their start-ups overlap), each ready once /health says ok."""
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        try:
            for i, flags in enumerate(flag_lists):
                port, log = free_port(), Path(tmp) / f"serve{i}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "speckernel", "serve", "--port", str(port),
                                             *flags], stdout=out, stderr=subprocess.STDOUT)
                servers.append(Served(proc, f"http://127.0.0.1:{port}", log))
            for served in servers:
                served.wait_ready()
            yield servers
        finally:
            for served in servers:
                served.proc.send_signal(signal.SIGINT)
            for served in servers:
                try:
                    served.proc.wait(20)
                except subprocess.TimeoutExpired:
                    served.proc.kill()
                    served.proc.wait()


@pytest.fixture(scope="module")
def servers() -> Iterator[list[Served]]:
    """Two tiny servers started together: one with an API key, one whose core a test kills (with a
    context long enough for a stream that is still running when it dies)."""
    restarted = [*TINY, "--max-model-len", "2048", "--restart-backoff", "0.5"]
    with serve_many([*TINY, "--api-key", KEY], restarted) as started:
        yield started


@pytest.fixture
def tiny(servers: list[Served]) -> Served:
    return servers[0]


def post(served: Served, path: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, headers=headers, timeout=30)


# --- bad input ----------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "<7><8><9>"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}

BAD = [  # (endpoint, body overrides, the param the error must name)
    ("chat", {"max_tokens": "four"}, "max_tokens"),
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"temperature": -0.5}, "temperature"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": 2.5}, "max_tokens"),
    ("chat", {"seed": True}, "seed"),
    ("chat", {"stop": 7}, "stop"),
    ("chat", {"n": 2}, "n"),
    ("chat", {"messages": [{"role": "wizard", "content": "obey"}]}, "messages[0].role"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "<1>" * 80}]}, "messages"),  # 80 tokens, context 64
    ("chat", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("completions", {"prompt": list(range(1, 81))}, "prompt"),
    ("completions", {"prompt": [1, 2, 100_000]}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"n": 3, "stream": True}, "n"),
    ("chat", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"presence_penalty": -3}, "presence_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"presence_penalty": "some"}, "presence_penalty"),
]


@pytest.mark.parametrize(("endpoint", "override", "param"), BAD)
def test_bad_input_is_400_in_openai_shape(tiny: Served, endpoint: str, override: dict[str, object],
                                          param: str) -> None:
    body = (CHAT if endpoint == "chat" else COMPLETION) | override
    r = post(tiny, f"/v1/{endpoint}" if endpoint == "completions" else "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    # ... and the server keeps serving.
    assert post(tiny, "/v1/completions", COMPLETION).status_code == 200


def test_unknown_models_routes_and_methods_answer_in_openai_shape(tiny: Served) -> None:
    r = post(tiny, "/v1/chat/completions", CHAT | {"model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    for method, path, status, code in (("GET", "/v1/nope", 404, "not_found"), ("GET", "/v1/completions", 405,
                                                                                 "method_not_allowed")):
        r = httpx.request(method, tiny.url + path, timeout=10)
        assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and path in error["message"]


def test_malformed_json_is_400(tiny: Served) -> None:
    r = post(tiny, "/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key_is_required_on_v1(tiny: Served) -> None:
    assert post(tiny, "/v1/chat/completions", CHAT, key=None).status_code == 401
    r = post(tiny, "/v1/completions", COMPLETION, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{tiny.url}/v1/models").status_code == 401
    assert httpx.get(f"{tiny.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0][
        "id"] == "random:tiny"
    assert httpx.get(f"{tiny.url}/health").status_code == 200  # probes and scrapers need no key
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="random:tiny", prompt=[1, 2], max_tokens=2)


def test_usage_and_metrics_count_tokens(tiny: Served) -> None:
    before = tiny.metric("speckernel_generation_tokens_total")
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key=KEY)
    out = client.completions.create(model="random:tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 5 and out.usage.total_tokens == 8
    assert out.choices[0].finish_reason == "length" and out.choices[0].text.count("<") == 5
    chunks = list(client.completions.create(model="random:tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    assert tiny.metric("speckernel_generation_tokens_total") == before + 10
    text = httpx.get(f"{tiny.url}/metrics").text
    for name in ("speckernel_time_to_first_token_seconds_bucket", "speckernel_time_per_output_token_seconds_count",
                 'speckernel_requests_total{outcome="length"}', "speckernel_kv_blocks_in_use",
                 "speckernel_spec_acceptance_rate", "speckernel_spec_k0_steps_total"):
        assert name in text
    assert "_created" not in text, "the server leaves out prometheus_client's creation-time samples"


def test_a_dead_core_is_replaced_its_requests_fail_and_health_recovers(servers: list[Served]) -> None:
    served = servers[1]
    assert post(served, "/v1/completions", COMPLETION).status_code == 200
    old = served.core_pid()
    body = COMPLETION | {"stream": True, "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(old, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["type"] == "service_unavailable"
    seen, deadline = set(), time.monotonic() + 90
    while (health := httpx.get(f"{served.url}/health", timeout=15)).status_code != 200:
        assert time.monotonic() < deadline, f"the core was never replaced:\n{served.log.read_text()}"
        assert health.status_code == 503
        seen.add(health.json()["status"])
        if "restarting" in seen and len(seen) == 1:  # while it restarts, requests answer 503
            r = post(served, "/v1/completions", COMPLETION)
            assert r.status_code in (200, 503), r.text
            assert r.status_code == 200 or r.json()["error"]["code"] == "engine_dead"
        time.sleep(0.1)
    assert seen == {"restarting"}
    assert served.core_pid() != old
    assert post(served, "/v1/completions", COMPLETION).status_code == 200
    assert served.metric("speckernel_engine_restarts_total") == 1
    assert served.metric("speckernel_engine_up") == 1


def test_a_core_that_may_not_be_replaced_ends_serve_with_code_1() -> None:
    with serve(*TINY, "--max-restarts", "0") as served:
        os.kill(served.core_pid(), signal.SIGKILL)
        assert served.proc.wait(30) == 1
        assert "not restarted (0 restarts within 600 s)" in served.log.read_text()
