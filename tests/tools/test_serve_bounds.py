"""What one request may cost `speckernel serve`: a real server process on 127.0.0.1 (tiny random
model) with small bounds. Bodies over the limit (413), long prompts and stop lists (400), a full
queue and a wait for a slot that runs out (429), a body that drips (408), and connections that
send no request head (closed), each in OpenAI's error shape, while the server keeps serving.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.tools.test_serve import Served, serve

pytestmark = pytest.mark.timing  # queue waits, body and header timeouts

httpx = pytest.importorskip("httpx2")

FLAGS = ["--model", "random:tiny", "--platform", "cpu", "--max-model-len", "4096", "--num-kv-blocks", "256",
         "--max-num-seqs", "1", "--max-body-bytes", "100000", "--max-prompt-chars", "20000", "--max-stop", "4",
         "--max-stop-chars", "32", "--max-queue", "2", "--max-queue-wait", "1.5", "--body-timeout", "1",
         "--header-timeout", "1"]
OK = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
HOLD = {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
"""A stream that holds the one slot for seconds: at least 1.8 s must pass from its first token to
the end of a wait for the slot (900 tokens took less on an idle host)."""


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(*FLAGS) as started:
        yield started


def post(served: Served, body: object, path: str = "/v1/completions", **kw: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, timeout=30, **kw)


def error_of(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error  # type: ignore[no-any-return]


def test_a_body_over_the_limit_is_413_whether_declared_or_streamed(served: Served) -> None:
    big = json.dumps({"prompt": "x" * 200_000, "max_tokens": 1}).encode()
    assert error_of(post(served, big), 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused once the bytes read pass the bound
        for i in range(0, len(big), 10_000):
            yield big[i:i + 10_000]

    r = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=30)
    assert "100000" in str(error_of(r, 413)["message"])
    assert post(served, OK).status_code == 200


def test_long_prompts_and_stop_lists_are_400_naming_the_field(served: Served) -> None:
    assert error_of(post(served, OK | {"prompt": "hi " * 10_000}), 400)["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": "hi " * 10_000}], "max_tokens": 1}
    assert error_of(post(served, chat, "/v1/chat/completions"), 400)["param"] == "messages"
    assert error_of(post(served, OK | {"stop": ["a", "b", "c", "d", "e"]}), 400)["param"] == "stop"
    assert error_of(post(served, OK | {"stop": "s" * 33}), 400)["param"] == "stop"
    assert post(served, OK | {"stop": ["a", "b", "c", "d" * 32]}).status_code == 200


def test_a_full_queue_and_a_wait_for_a_slot_that_runs_out_are_429(served: Served) -> None:
    first = threading.Event()
    results: dict[str, object] = {}

    def hold() -> None:
        with httpx.stream("POST", served.url + "/v1/completions", json=HOLD, timeout=60) as r:
            for line in r.iter_lines():
                first.set()
                if line == "data: [DONE]":
                    results["held"] = "done"

    def waiter() -> None:
        t0 = time.monotonic()
        results["waiter"] = post(served, OK)
        results["waited"] = time.monotonic() - t0

    holder = threading.Thread(target=hold)
    holder.start()
    assert first.wait(30)
    waiting = threading.Thread(target=waiter)  # the second request in the server: it waits for the slot
    waiting.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    full = post(served, OK)  # the third: the queue (2) is full, refused at once
    assert time.monotonic() - t0 < 1
    assert error_of(full, 429)["code"] == "rate_limit_exceeded" and "(--max-queue)" in str(full.json())
    waiting.join(30)
    late = results["waiter"]
    assert isinstance(late, httpx.Response) and "--max-queue-wait" in str(error_of(late, 429)["message"])
    assert 1.4 < float(results["waited"]) < 5  # type: ignore[arg-type]
    holder.join(60)
    assert results.get("held") == "done"
    # Nothing was kept: the server takes requests again, and the refused ones hold no KV block.
    assert post(served, OK).status_code == 200
    assert served.metric("speckernel_kv_blocks_in_use") == 0
    assert served.metric('speckernel_requests_total{outcome="overloaded"}') == 2


def test_a_dripping_body_is_408(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        time.sleep(1.5)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--body-timeout" in answer


@pytest.mark.parametrize("drip", [False, True])
def test_a_connection_without_a_request_head_is_closed(served: Served, drip: bool) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 40
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=10) as s:
        t0 = time.monotonic()
        closed = None
        for i in range(len(head) if drip else 40):
            if drip:
                try:
                    s.sendall(head[i:i + 1])
                except OSError:
                    closed = time.monotonic() - t0
                    break
            s.settimeout(0.1)
            try:
                if s.recv(1) == b"":
                    closed = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
    assert closed is not None and closed < 3, "the server kept a connection that sent no request head"
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
