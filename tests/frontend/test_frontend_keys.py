"""AsyncEngine's frontend bookkeeping: request keys, abort(), stop strings on the way out.

The core knows requests only by an integer key, fresh per generate() call. The first tests run
the real frontend against a scripted stand-in core (fast, and the races are deterministic); the
`test_real_engine_*` ones run the same scenarios through the real in-process engine core.
"""

from __future__ import annotations

import math
from contextlib import aclosing
from dataclasses import dataclass

import anyio
import pytest
from anyio.abc import TaskGroup

import speckernel.frontend.async_engine as async_engine_mod
from speckernel import AsyncEngine, EngineConfig, InvalidInputError, SamplingParams
from speckernel.frontend.client import CoreClient
from speckernel.outputs import RequestOutput
from speckernel.wire.messages import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    CoreOutputs,
    CoreReady,
    FrontendMessage,
    RequestDelta,
    Shutdown,
)
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow  # both kinds load the default model's tokenizer; real_engine the model
REAL = EngineConfig(platform="cpu", in_process=True, max_model_len=512)
TIMEOUT_S = 120
SCRIPTED_TIMEOUT_S = 10  # the scripted core answers in milliseconds: waiting longer means a hang


# --- a scripted stand-in for the engine core --------------------------------------------------


@dataclass
class _Running:
    key: int
    tokens: list[int]
    max_tokens: int
    sent: int = 0
    aborted: bool = False


class ScriptedCore(CoreClient):
    """Sends `tokens_per_step` tokens per live request per step. A request's tokens are
    `script[prompt]`, or a stream derived from its prompt (so different prompts give different
    tokens). An abort takes effect one step late, as when a frame is already in flight,
    so the core always sends one more delta for an aborted key."""

    script: dict[tuple[int, ...], list[int]] = {}
    tokens_per_step = 1
    instances: list[ScriptedCore] = []

    def __init__(self, config: EngineConfig) -> None:
        self.tx, self.rx = anyio.create_memory_object_stream[CoreMessage | None](math.inf)
        self.inbox: list[FrontendMessage] = []
        self.received: list[FrontendMessage] = []
        self.running: list[_Running] = []
        self.wake = anyio.Event()
        ScriptedCore.instances.append(self)

    async def start(self, tg: TaskGroup) -> CoreReady:
        tg.start_soon(self._run)
        return CoreReady("scripted", "float32", 512, 64, 16, 49152)

    def send(self, msg: FrontendMessage) -> None:
        self.received.append(msg)
        self.inbox.append(msg)
        self.wake.set()

    async def recv(self) -> CoreMessage | None:
        try:
            return await self.rx.receive()
        except anyio.EndOfStream:
            return None

    async def close(self) -> None:
        self.send(Shutdown())

    def keys_added(self) -> list[int]:
        return [m.key for m in self.received if isinstance(m, AddRequest)]

    def keys_aborted(self) -> list[int]:
        return [k for m in self.received if isinstance(m, AbortRequests) for k in m.keys]

    async def _run(self) -> None:
        while True:
            inbox, self.inbox = self.inbox, []
            for msg in inbox:
                match msg:
                    case AddRequest(key=key, prompt_token_ids=prompt, params=params):
                        seed = int(prompt.sum()) * 37
                        tokens = self.script.get(tuple(prompt.tolist())) or [
                            1000 + (seed + i * 11) % 3000 for i in range(999)]
                        self.running.append(_Running(key, tokens, params.max_tokens))
                    case AbortRequests(keys=keys):
                        for req in self.running:
                            req.aborted = req.aborted or req.key in keys
                    case Shutdown():
                        self.tx.close()
                        return
            deltas = []
            for req in list(self.running):
                n = min(self.tokens_per_step, req.max_tokens - req.sent)
                new, req.sent = req.tokens[req.sent : req.sent + n], req.sent + n
                done = req.sent >= req.max_tokens or req.sent >= len(req.tokens)
                deltas.append(RequestDelta(req.key, new, "length" if done else None))
                if done or req.aborted:
                    self.running.remove(req)
            if deltas:
                await self.tx.send(CoreOutputs(deltas))
            if not self.running and not self.inbox:
                await self.wake.wait()
                self.wake = anyio.Event()
            await anyio.sleep(0.001)


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> type[ScriptedCore]:
    ScriptedCore.instances = []
    monkeypatch.setattr(ScriptedCore, "script", {})
    monkeypatch.setattr(ScriptedCore, "tokens_per_step", 1)
    monkeypatch.setattr(async_engine_mod, "InprocClient", ScriptedCore)
    return ScriptedCore


def timeout_for(engine: AsyncEngine) -> float:
    return SCRIPTED_TIMEOUT_S if isinstance(engine._client, ScriptedCore) else TIMEOUT_S


async def collect(
    engine: AsyncEngine, prompt: str | list[int], params: SamplingParams, **kw: str
) -> list[RequestOutput]:
    """Every output of one request, checking that the deltas add up to the final output."""
    outs = []
    with anyio.fail_after(timeout_for(engine)):
        async for out in engine.generate(prompt, params, **kw):
            outs.append(out)
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert outs[-1].token_ids == [t for o in outs for t in o.delta_token_ids]
    assert outs[-1].text == "".join(o.delta_text for o in outs)
    return outs


async def leave_after(engine: AsyncEngine, prompt: str, params: SamplingParams, n: int, request_id: str) -> None:
    """Reads n outputs of a request, then stops reading (closing the iterator)."""
    seen = 0
    with anyio.fail_after(timeout_for(engine)):
        async with aclosing(engine.generate(prompt, params, request_id=request_id)) as agen:
            async for _ in agen:
                seen += 1
                if seen == n:
                    break
    assert seen == n, "the first request finished before the caller left it"


GREEDY8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
OLD, NEW = PROMPTS[0], PROMPTS[3]


# --- keys -------------------------------------------------------------------------------------


async def test_reused_id_never_gets_the_left_requests_deltas(scripted: type[ScriptedCore]) -> None:
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        solo = (await collect(engine, NEW, GREEDY8))[-1].token_ids
        for _ in range(5):
            await leave_after(engine, OLD, LONG, 3, request_id="x")
            outs = await collect(engine, NEW, GREEDY8, request_id="x")
            assert outs[-1].token_ids == solo and len(solo) == GREEDY8.max_tokens
            assert {o.request_id for o in outs} == {"x"}
        core = scripted.instances[0]
        keys = core.keys_added()
        assert len(set(keys)) == len(keys) == 11, "every generate() call takes a fresh key"
        assert core.keys_aborted() == keys[1::2], "each left request is aborted by its own key"
        assert [m.request_id for m in core.received if isinstance(m, AddRequest)][1:] == ["x"] * 10


async def test_live_id_is_rejected_and_free_again_once_done(scripted: type[ScriptedCore]) -> None:
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        async with aclosing(engine.generate(OLD, LONG, request_id="x")) as agen:
            await agen.__anext__()
            with pytest.raises(InvalidInputError, match="already running"):
                await engine.generate(NEW, GREEDY8, request_id="x").__anext__()
        assert len((await collect(engine, NEW, GREEDY8, request_id="x"))[-1].token_ids) == 8
        assert engine._requests == {} and engine._live_ids == {}


async def test_a_request_id_that_is_not_a_str_is_refused_at_once(scripted: type[ScriptedCore]) -> None:
    """An int id once reached the core, which could not decode the request: the caller waited
    forever. Now the frontend refuses it, and nothing was sent."""
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        with pytest.raises(InvalidInputError, match="request_id: expected a str, got 5"):
            await engine.generate(NEW, GREEDY8, request_id=5).__anext__()  # type: ignore[arg-type]
        assert scripted.instances[0].keys_added() == []


async def test_abort_ends_the_stream_with_an_abort_output(scripted: type[ScriptedCore]) -> None:
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        outs: list[RequestOutput] = []
        two = anyio.Event()

        async def consume() -> None:
            async for out in engine.generate(OLD, SamplingParams(max_tokens=500), request_id="a"):
                outs.append(out)
                if len(outs) == 2:
                    two.set()

        with anyio.fail_after(timeout_for(engine)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await two.wait()
                await engine.abort("a")
                # The id is free at once, even before the consumer has read the final output.
                fresh = await collect(engine, NEW, GREEDY8, request_id="a")
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert all(not o.finished for o in outs[:-1]) and len(outs[-1].token_ids) < 500
        assert fresh[-1].finish_reason == "length" and len(fresh[-1].token_ids) == 8
        core = scripted.instances[0]
        assert core.keys_aborted() == core.keys_added()[:1]
        await engine.abort("a")  # no longer live: nothing happens
        await engine.abort("never-seen")
        assert core.keys_aborted() == core.keys_added()[:1]


async def test_abort_while_the_caller_holds_the_iterator(scripted: type[ScriptedCore]) -> None:
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        with anyio.fail_after(timeout_for(engine)):
            async with aclosing(engine.generate(OLD, LONG, request_id="b")) as agen:
                await agen.__anext__()
                await engine.abort("b")
                outs = [out async for out in agen]
        assert outs[-1].finish_reason == "abort" and outs[-1].finished


# --- stop strings on the way out --------------------------------------------------------------


@pytest.mark.parametrize("tokens_per_step", [1, 5])
async def test_stop_string_trims_tokens_and_aborts_the_core(
    scripted: type[ScriptedCore], tokens_per_step: int
) -> None:
    scripted.tokens_per_step = tokens_per_step
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        ids = engine.tokenizer.encode("The cat sat on the mat. The dog sat too.", add_special_tokens=False)
        prompt = [ids[0]]
        scripted.script = {(ids[0],): ids}
        params = SamplingParams(max_tokens=40, stop=(" on the",))
        with anyio.fail_after(timeout_for(engine)):
            async with aclosing(engine.generate(prompt, params)) as agen:
                async for out in agen:
                    if out.finished:
                        break
                # Aborted before the caller even asks for more: no step is wasted on it.
                core = scripted.instances[0]
                assert core.keys_aborted() == core.keys_added()[-1:]
        assert out.text == "The cat sat" and out.finish_reason == "stop"
        assert out.token_ids == ids[:3]  # The| cat| sat


@pytest.mark.parametrize("tokens_per_step", [1, 5])
async def test_stop_string_in_the_delta_that_hits_max_tokens_is_a_stop(
    scripted: type[ScriptedCore], tokens_per_step: int
) -> None:
    scripted.tokens_per_step = tokens_per_step
    async with AsyncEngine(EngineConfig(in_process=True)) as engine:
        ids = engine.tokenizer.encode("The cat sat on the mat. The dog sat too.", add_special_tokens=False)
        scripted.script = {(ids[0],): ids}
        outs = await collect(engine, [ids[0]], SamplingParams(max_tokens=5, stop=(" the",)))
        assert outs[-1].finish_reason == "stop" and outs[-1].text == "The cat sat on"
        assert outs[-1].token_ids == ids[:4]
        core = scripted.instances[0]
        assert core.keys_aborted() == [], "the core had finished it already: nothing to abort"


# --- the same through the real engine core ----------------------------------------------------

async def test_real_engine_reused_id_after_leaving_early() -> None:
    """The reported bug: leave `x` after 3 deltas, start a new `x` at once; it returned 9 tokens
    for max_tokens=8, the first one from the old request (5 of 5 trials)."""
    async with AsyncEngine(REAL) as engine:
        solo = (await collect(engine, NEW, GREEDY8))[-1].token_ids
        old = (await collect(engine, OLD, GREEDY8))[-1].token_ids
        assert len(solo) == 8 and solo[0] != old[3], "the prompts must make a stray token visible"
        for trial in range(5):
            await leave_after(engine, OLD, LONG, 3, request_id="x")
            outs = await collect(engine, NEW, GREEDY8, request_id="x")
            assert outs[-1].token_ids == solo, f"trial {trial}: {outs[-1].token_ids} != {solo}"
            assert len(outs[-1].token_ids) == GREEDY8.max_tokens
        stats = await engine.stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_real_engine_abort_ends_the_stream() -> None:
    async with AsyncEngine(REAL) as engine:
        solo = (await collect(engine, NEW, GREEDY8))[-1].token_ids
        outs: list[RequestOutput] = []
        two = anyio.Event()

        async def consume() -> None:
            async for out in engine.generate(OLD, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
                                             request_id="a"):
                outs.append(out)
                if len(outs) == 2:
                    two.set()

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await two.wait()
                await engine.abort("a")
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert len(outs[-1].token_ids) < 400
        stats = await engine.stats()
        assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert (await collect(engine, NEW, GREEDY8, request_id="a"))[-1].token_ids == solo


@pytest.mark.parametrize("speculator", [None, "ngram"])
async def test_real_engine_stop_string_trims_tokens(tokenizer, speculator: str | None) -> None:  # type: ignore[no-untyped-def]
    """A stop string in the last delta (the one where max_tokens runs out) and one in the middle."""
    async with AsyncEngine(REAL, speculator=speculator) as engine:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt in PROMPTS:  # one whose last token adds text not seen before
            plain = (await collect(engine, prompt, params))[-1]
            pieces = [tokenizer.decode([t]) for t in plain.token_ids]
            if pieces[-1].strip() and "\ufffd" not in plain.text and plain.text.find(pieces[-1]) == len(
                    plain.text) - len(pieces[-1]):
                break
        else:
            pytest.fail("no prompt ends in a fresh token")
        middle = next(p for p in pieces[len(pieces) // 2 :] if p.strip())
        for stop in (pieces[-1], middle):  # in the delta where max_tokens runs out, then earlier
            hit = plain.text.find(stop)
            outs = await collect(engine, prompt, SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))
            final = outs[-1]
            assert final.finish_reason == "stop", (stop, final)
            assert final.text == plain.text[:hit]
            expected = next(plain.token_ids[:n] for n in range(13)
                            if tokenizer.decode(plain.token_ids[:n]).startswith(final.text))
            assert final.token_ids == expected
            assert all(stop not in o.text for o in outs)
