"""`speckernel serve`'s API key on /metrics and on headers that are not ASCII: with a key set,
/metrics needs it (`--public-metrics` serves it without), and an Authorization header of any
bytes is a 401, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from speckernel.tools.serve.command import API_KEY_ENV
from tests.tools.test_serve import KEY, TINY, Served, serve_many

httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def keyed() -> Iterator[list[Served]]:
    """Two tiny servers with the key in the environment: /metrics private, then public."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEY_ENV, KEY)
        with serve_many(TINY, [*TINY, "--public-metrics"]) as started:
            yield started


def get(served: Served, path: str, auth: str | bytes | None = None) -> Any:
    return httpx.get(served.url + path, headers={"Authorization": auth} if auth is not None else {}, timeout=30)


def test_metrics_need_the_key_when_one_is_set(keyed: list[Served]) -> None:
    private = keyed[0]
    for auth in (None, "Bearer wrong", KEY):
        r = get(private, "/metrics", auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", auth
    r = get(private, "/metrics", f"Bearer {KEY}")
    assert r.status_code == 200 and "speckernel_requests_total" in r.text
    assert get(private, "/health").status_code == 200, "probes need no key"


def test_public_metrics_serve_without_the_key_and_v1_still_needs_it(keyed: list[Served]) -> None:
    public = keyed[1]
    assert "speckernel_requests_total" in get(public, "/metrics").text
    assert get(public, "/v1/models").status_code == 401
    assert get(public, "/v1/models", f"Bearer {KEY}").status_code == 200


@pytest.mark.parametrize("auth", ["Bearer ключ".encode(), "Bearer clé".encode("latin-1"),
                                  b"Bearer " + KEY.encode() + "é".encode()])
def test_a_header_that_is_not_ascii_is_a_401(keyed: list[Served], auth: bytes) -> None:
    for path in ("/v1/models", "/metrics"):
        r = get(keyed[0], path, auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
