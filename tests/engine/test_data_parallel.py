"""Data parallelism on the real default model: two engine-core ranks agree every step in one
all-reduce; a step is K=0 only when both ranks vote so, and never while a rank runs a dummy step
(the K=0 RFC's rule); a rank that only prefills (max_tokens=1) or has nothing at all never blocks
the one that decodes; outputs equal one rank's."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch

from speckernel import AsyncEngine, SamplingParams
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.frontend.dp_client import free_port
from speckernel.wire.messages import AddRequest, CoreMessage, CoreOutputs, Shutdown
from tests.conftest import PROMPTS
from tests.engine.pipeline_util import run_loop

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(platform="cpu", max_model_len=256, max_num_seqs=8, speculator="mtp", num_speculative_tokens=3)
DECODE = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ranks(n: int = 2) -> list[EngineCore]:
    port = free_port()
    cores: list[Any] = [None] * n

    def build(r: int) -> None:
        cores[r] = EngineCore(msgspec.structs.replace(CONFIG, data_parallel_size=n, data_parallel_rank=r,
                                                      data_parallel_port=port))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return cores


def serve(core: EngineCore, work: list[tuple[int, list[int], SamplingParams, float]], outs: dict[int, list[int]],
          stop_when: threading.Event, done: threading.Event) -> None:
    """One rank's loop: requests arrive at their times; Shutdown once every rank is done."""

    async def emit(msg: CoreMessage) -> None:
        if isinstance(msg, CoreOutputs):
            for d in msg.deltas:
                outs[d.key].extend(d.new_token_ids)

    async def feed() -> None:
        for key, ids, params, at in work:
            await anyio.sleep(at)
            core.deliver(AddRequest(key, np.asarray(ids), params, str(key)))
        while core.scheduler.requests or core.inbox or any(not outs[k] for k, *_ in work):
            await anyio.sleep(0.02)
        done.set()
        while not stop_when.is_set():
            await anyio.sleep(0.02)
        core.deliver(Shutdown())

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            await core.run(emit)

    anyio.run(main)


def test_prefilling_rank_and_decoding_rank_agree_on_k0(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = [tokenizer.encode(p) for p in PROMPTS[:6]]
    prefill = [(100 + i, ids[i], PREFILL_ONLY, 0.3 * i) for i in range(3)]  # arrive while rank 1 decodes
    decode = [(200 + i, ids[3 + i], DECODE, 0.0) for i in range(3)]
    cores = ranks()
    outs: dict[int, list[int]] = {k: [] for k, *_ in prefill + decode}
    done = [threading.Event(), threading.Event()]
    both = threading.Event()
    threads = [threading.Thread(target=serve, args=(cores[r], w, outs, both, done[r]))
               for r, w in enumerate((prefill, decode))]
    for t in threads:
        t.start()
    for d in done:
        assert d.wait(240), "a rank hung"
    both.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank did not stop"
    votes0, votes1 = cores[0].dp_votes, cores[1].dp_votes
    assert len(votes0) == len(votes1), "the ranks did not step in lockstep"
    for v0, v1 in zip(votes0, votes1, strict=True):
        assert v0.agreed == v1.agreed == (v0.skip and v1.skip), "K=0 without both ranks voting for it"
        assert not ((v0.dummy or v1.dummy) and v0.agreed), "K=0 in a step where a rank ran a dummy batch"
    assert any(v0.skip and not v0.agreed for v0 in votes0), \
        "the prefilling rank was never overruled: the test proves nothing"
    assert any(v0.dummy and v1.skip for v0, v1 in zip(votes0, votes1, strict=True)), \
        "rank 1 never could skip beside an idle rank 0: the RFC's rule was not exercised"
    assert cores[0].dp is not None and cores[0].dp.num_dummy_steps > 0, "rank 0 never idled beside rank 1"
    single = EngineCore(CONFIG)
    want = run_loop(single, [w[1] for w in prefill + decode], [w[2] for w in prefill + decode])
    assert [outs[w[0]] for w in prefill + decode] == want


async def test_frontend_balances_requests_over_ranks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Requests spread over the ranks, whose loops run ahead as the single engine's does (rows
    scheduled while their predecessor runs), and the outputs are one engine's."""
    ids = [tokenizer.encode(p) for p in PROMPTS[:4]]
    config = msgspec.structs.replace(CONFIG, speculator=None, in_process=True, data_parallel_size=2)
    async with AsyncEngine(config) as engine:
        async def one(i: int, got: dict[int, list[int]]) -> None:
            async for out in engine.generate(ids[i], DECODE):
                got[i] = list(out.token_ids)

        got: dict[int, list[int]] = {}
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i, got)
        client = engine._client
        loads = [len(c.core.scheduler.requests) for c in client.ranks]  # type: ignore[union-attr]
        steps = [c.core.num_steps for c in client.ranks]  # type: ignore[union-attr]
        overlapped = [c.core.ledger.num_async_rows for c in client.ranks]  # type: ignore[union-attr]
    assert all(s > 0 for s in steps), f"a rank served nothing: steps {steps}"
    assert all(n > 0 for n in overlapped), f"a rank never scheduled a step while one ran: {overlapped}"
    assert loads == [0, 0]
    single = EngineCore(msgspec.structs.replace(CONFIG, speculator=None))
    want = await anyio.to_thread.run_sync(run_loop, single, ids, DECODE)  # its own event loop
    assert [got[i] for i in range(4)] == want


def test_ranks_built_in_one_process_set_up_their_devices_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks built at once in one process take turns at loading and capturing: a capture
    beside another core's allocations on the same device fails, and the ranks then ran eagerly."""
    spans: list[tuple[float, float]] = []
    local_runner = EngineCore._local_runner

    def timed(self: EngineCore, *args: Any) -> Any:
        started = time.monotonic()
        runner = local_runner(self, *args)
        time.sleep(0.3)  # a capture's worth of device work, long enough for the other to collide
        spans.append((started, time.monotonic()))
        return runner

    monkeypatch.setattr(EngineCore, "_local_runner", timed)
    monkeypatch.setattr(sys.modules[__name__], "CONFIG", msgspec.structs.replace(
        CONFIG, model="random:tiny", speculator=None, max_model_len=128))
    ranks()
    first, second = sorted(spans)
    assert first[1] <= second[0], "the ranks set up their devices at the same time"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device graphs need a GPU")
def test_ranks_built_in_one_process_both_capture_their_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "CONFIG", msgspec.structs.replace(CONFIG, platform="cuda"))
    cores = ranks()
    assert all(c.runner.graphs is not None and c.runner.graphs.graphs for c in cores), \
        "a rank lost its graphs: its steps run eagerly"
