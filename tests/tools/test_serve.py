"""`speckernel serve` as a real server process on 127.0.0.1, with the tiny random model: bad
input answered 400 in OpenAI's error shape while the server keeps serving, the API key (401;
from a file or the environment), usage and /metrics, a dead engine core (503, and /health says
so), the ready, access and shutdown lines, a port in use refused before the model loads, and
SIGTERM / Ctrl-C. The official `openai` client against the real model is in
test_serve_openai.py, the load tests in test_serve_load.py and test_serve_hostile.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

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
        with httpx.Client() as client:  # one client: each new one loads the CA certificates (~30 ms)
            while True:
                assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log.read_text()}"
                assert time.monotonic() < deadline, f"server did not start:\n{self.log.read_text()}"
                try:
                    if client.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)

    def metric(self, name: str, default: float | None = None) -> float:
        """One sample of /metrics, named with its labels if it has any."""
        for line in httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text.splitlines():
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
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    """Two tiny servers started together: one with an API key (from a file), one whose core a test
    kills (with a context long enough for a stream that is still running when it dies)."""
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    restarted = [*TINY, "--max-model-len", "2048", "--restart-backoff", "0.5"]
    with serve_many([*TINY, "--api-key-file", str(key_file)], restarted) as started:
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
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("completions", {"suffix": "end"}, "suffix"),
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
    text = httpx.get(f"{tiny.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
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
        core = served.core_pid()
        os.kill(core, signal.SIGKILL)
        assert served.proc.wait(30) == 1
        last = served.log.read_text().splitlines()[-1]
        assert last == (f"speckernel: error: engine core died: pid {core} was killed by SIGKILL; not restarted "
                        "(0 restarts within 600 s)")


# --- talking like a server --------------------------------------------------------------------

LINE = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\S+)")


def events(log: Path, name: str) -> list[dict[str, str]]:
    """The key-value log lines of one event, their values as written (strings unquoted)."""
    found = []
    for line in log.read_text().splitlines():
        fields = {k: v.strip("'") for k, v in LINE.findall(line)}
        if fields.get("event") == name:
            found.append(fields)
    return found


def test_a_ready_line_names_the_url_and_model_and_every_request_is_one_access_line(tiny: Served) -> None:
    (ready,) = events(tiny.log, "ready")
    assert ready["url"] == tiny.url and ready["model"] == "random:tiny" and ready["level"] == "info"
    assert ready["platform"] == "cpu" and ready["max_model_len"] == "64"
    before = len(events(tiny.log, "request"))
    assert post(tiny, "/v1/completions", COMPLETION).status_code == 200
    assert post(tiny, "/v1/completions", COMPLETION | {"max_tokens": "four"}).status_code == 400
    assert httpx.get(f"{tiny.url}/v1/nope").status_code == 404
    time.sleep(0.2)
    seen = events(tiny.log, "request")[before:]
    assert [(r["method"], r["path"], r["status"]) for r in seen] == [
        ("POST", "/v1/completions", "200"), ("POST", "/v1/completions", "400"), ("GET", "/v1/nope", "404")]
    assert all(float(r["duration_ms"]) >= 0 and r["component"] == "serve.access" for r in seen)
    assert "--api-key" not in tiny.log.read_text(), "a key from a file draws no warning"


def test_sigterm_ends_open_streams_with_an_error_then_done_and_ctrl_c_exits_130() -> None:
    """On SIGTERM a stream in flight gets an error event and [DONE] (not a cut connection), a
    request waiting for its whole answer gets 503, serve says it is stopping and exits 0; after
    Ctrl-C it exits 130, like every other command."""
    with serve_many([*TINY, "--max-model-len", "2048"], TINY) as (termed, interrupted):
        long = COMPLETION | {"max_tokens": 1800, "ignore_eos": True}
        waited: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: waited.append(post(termed, "/v1/completions", long)))
        with httpx.stream("POST", termed.url + "/v1/completions", json=long | {"stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            waiter.start()
            deadline = time.monotonic() + 20
            while termed.metric("speckernel_num_requests_running") < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            termed.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        waiter.join(30)
        assert rest[-1] == "data: [DONE]", rest[-3:]
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
        assert all("error" not in json.loads(line[6:]) for line in rest[:-2])
        assert waited[0].status_code == 503 and waited[0].json()["error"]["code"] == "server_shutting_down"
        assert termed.proc.wait(20) == 0
        (stopping,) = events(termed.log, "shutting_down")
        assert stopping["reason"] == "SIGTERM" and stopping["open_streams"] == "1"
        assert events(termed.log, "stopped")
        interrupted.proc.send_signal(signal.SIGINT)
        assert interrupted.proc.wait(20) == 130
        assert events(interrupted.log, "shutting_down")[0]["reason"] == "SIGINT"


def test_a_port_in_use_fails_in_one_line_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "speckernel", "serve", *TINY, "--port", str(port), "--log-level",
                            "debug", "--api-key", KEY], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [
        "speckernel: warning: --api-key shows the key to every user of this host (ps, /proc); set "
        "$SPECKERNEL_API_KEY or use --api-key-file",
        f"speckernel: error: cannot listen on 127.0.0.1:{port}: Address already in use (another process has it; "
        "pick another --port)"]


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_bad_input(port: str) -> None:
    r = subprocess.run([sys.executable, "-m", "speckernel", "serve", "--port", port], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "--port" in r.stderr, r.stderr


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from speckernel.errors import InvalidInputError
    from speckernel.tools.cli import build_parser
    from speckernel.tools.serve.command import API_KEY_ENV, api_key

    def key_of(*flags: str) -> str | None:
        return api_key(build_parser().parse_args(["serve", *flags]))

    (tmp_path / "key").write_text("sk-from-file\n")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert key_of("--api-key-file", str(tmp_path / "key")) == "sk-from-file"
    assert key_of() == "sk-from-env"
    assert capsys.readouterr().err == ""
    assert key_of("--api-key", "sk-typed") == "sk-typed"
    assert "warning: --api-key shows the key" in capsys.readouterr().err
    monkeypatch.delenv(API_KEY_ENV)
    assert key_of() is None
    for flags, message in ((["--api-key-file", str(tmp_path / "empty")], "the file is empty"),
                           (["--api-key-file", str(tmp_path / "nope")], "No such file"),
                           (["--api-key", "a", "--api-key-file", str(tmp_path / "key")], "give one of them")):
        with pytest.raises(InvalidInputError, match=message):
            key_of(*flags)
