"""The `remote` speculator against real `speckernel serve-drafter` processes (the default model,
float32, CPU): a served fixed-width (eagle3) and variable-width (dflash) drafter change no token,
deferred and synchronous resolution draft the same tokens, a finished request's pending draft
never reaches its slot's next owner, a dead server costs speculation but no token and a
restarted one brings it back, and a peer without the admitted keys gets nothing through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.kit import Decoder, Encoder, drafter_wire
from speckernel.sampling_params import SamplingParams
from speckernel.tools.serve.metrics import ServeMetrics
from tests.conftest import PROMPTS, default_sigint, run_to_completion

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # call timeouts, reconnects, reply waits; one worker

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
K = 3


class Server:
    """A `speckernel serve-drafter` process."""

    def __init__(self, method: str, address: str, keys: Path, *extra: str) -> None:
        self.method, self.address, self.keys, self.extra = method, address, keys, extra
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "speckernel", "serve-drafter", "--method", self.method, "--platform", "cpu",
             "--dtype", "float32", "--bind", self.address, "--keys", str(self.keys), "--log-level", "warning",
             *self.extra], stdout=subprocess.PIPE, text=True, preexec_fn=default_sigint)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("serving"), line
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys")


def served(method: str, keys: Path, tmp: Path) -> Iterator[Server]:
    server = Server(method, f"ipc://{tmp}/{method}.sock", keys).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def eagle3(keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served("eagle3", keys, tmp_path_factory.mktemp("eagle3"))


@pytest.fixture(scope="module")
def dflash(keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served("dflash", keys, tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS[:2]]


def engine(server: Server | None = None, max_num_seqs: int = 2, max_model_len: int = 256,
           **options: str) -> EngineCore:
    spec: dict[str, Any] = {}
    if server is not None:
        spec = {"speculator": "remote", "num_speculative_tokens": K,
                "speculator_options": {"address": server.address, "keys": str(server.keys), **options}}
    return EngineCore(EngineConfig(platform="cpu", dtype="float32", max_model_len=max_model_len,
                                   max_num_seqs=max_num_seqs, **spec))


@pytest.fixture(scope="module")
def plain(prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    core = engine()
    return {"greedy": run_to_completion(core, prompts, GREEDY), "seeded": run_to_completion(core, prompts, SEEDED)}


def host_accepted(core: EngineCore) -> list[tuple[int, int]]:
    """Records, for every row a request carries, its accepted count (derived on the host from
    seq_lens) next to the one the step's verification found on the device. (Compared after the
    run: the runner isolates what a speculator's pass raises.)"""
    spec: Any = core.speculator
    step = spec._step
    seen: list[tuple[int, int]] = []

    def recording(call: Any, states: Any, host: Any, index: list[int], k: int = 0) -> Any:
        msg = step(call, states, host, index, k)
        on_device = states.accepted.tolist()
        seen.extend((r.accepted, on_device[i]) for r, i in zip(msg.rows, index, strict=True))
        return msg

    spec._step = recording
    return seen


def recorded(core: EngineCore) -> list[tuple[list[tuple[int, int]], Any]]:
    """Records every proposal: its rows' (slot, generation) and its drafts tensor (a deferred
    one's host staging, read once the run is over and every reply has landed)."""
    spec: Any = core.speculator
    seen: list[tuple[list[tuple[int, int]], Any]] = []
    propose = spec.propose

    def recording(states: Any, host: Any, k: int) -> Any:
        drafts = propose(states, host, k)
        rows = [i for i in range(states.num_rows) if host.samples[i]]
        seen.append(([(host.slots[i], host.generations[i]) for i in rows], (drafts.token_ids, rows)))
        return drafts

    spec.propose = recording
    return seen


def drafts_of(core: EngineCore, seen: list[tuple[list[tuple[int, int]], Any]]) -> list[Any]:
    spec: Any = core.speculator
    deadline = time.monotonic() + 10
    while spec.link.pending and time.monotonic() < deadline:  # the last reply may still be on its way
        time.sleep(0.01)
    return [(keys, ids[rows].tolist()) for keys, (ids, rows) in seen]


@pytest.mark.parametrize("method,deferred", [("eagle3", True), ("dflash", False)])
def test_served_drafter_changes_no_token_and_deferred_drafts_what_sync_drafts(
        method: str, deferred: bool, request: pytest.FixtureRequest, prompts: list[list[int]],
        plain: dict[str, list[list[int]]]) -> None:
    server: Server = request.getfixturevalue(method)
    runs = {}
    for mode in ("true", "false"):
        core = engine(server, deferred=mode)
        caps = core.speculator.capabilities  # type: ignore[union-attr]
        assert caps.placement == "remote" and caps.deferred == (deferred and mode == "true")
        seen = recorded(core)
        accepted = host_accepted(core)
        greedy = run_to_completion(core, prompts, GREEDY)
        seeded = run_to_completion(core, prompts, SEEDED)
        spec = core.stats()["spec"]
        runs[mode] = (greedy, seeded, drafts_of(core, seen), spec)
        assert all(host == device for host, device in accepted), accepted
        assert any(host for host, _ in accepted), "no request carried an accepted draft: nothing was checked"
        assert greedy == plain["greedy"] and seeded == plain["seeded"], mode
        plugin = spec["plugin"]
        assert plugin["num_failed_calls"] == 0 and plugin["num_proposals"] > 0, plugin
        assert plugin["num_deferred"] == (plugin["num_proposals"] if caps.deferred else 0), plugin
    assert runs["true"][2] == runs["false"][2]  # the same drafts, row by row, step by step
    assert runs["true"][3]["acceptance_per_position"] == runs["false"][3]["acceptance_per_position"]
    assert runs["true"][3]["num_accepted_tokens"] > 0
    # The served drafter reads what the one in the engine reads (the token spans, the hidden
    # states, the accepted counts the request derives on the host): it accepts as much, where.
    local = EngineCore(EngineConfig(platform="cpu", dtype="float32", max_model_len=256, max_num_seqs=2,
                                    speculator=method, num_speculative_tokens=K))
    assert run_to_completion(local, prompts, GREEDY) == plain["greedy"]
    run_to_completion(local, prompts, SEEDED)
    assert local.stats()["spec"]["acceptance_per_position"] == runs["true"][3]["acceptance_per_position"]


def test_a_pending_draft_never_reaches_the_next_owner_of_its_slot(eagle3: Server, tokenizer: Any) -> None:
    """One slot: request A finishes with a proposal still pending (its last step drafted for
    it), and B, with a prompt a little longer than A's whole text, takes the slot in the very
    next step. Were A's drafts stored after B's prompt went into the token buffer, they would
    overwrite B's prompt tokens at A's length, right before B's last one."""
    a = tokenizer.encode("The sun rises in the")
    b = tokenizer.encode(" ".join(PROMPTS[:6]))[: len(a) + 3 + K + 1]
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    reference = engine(max_num_seqs=1)
    want = run_to_completion(reference, [a, b], short)
    core = engine(eagle3, max_num_seqs=1)
    runner = core.runner
    drafting = runner.drafting
    resolve, device_step = drafting.before, runner.device_step
    dropped: list[tuple[int, int]] = []
    frames: list[Any] = []

    def watching(frame: Any) -> None:
        pending = drafting.pending
        if pending is not None:
            owner = {r.slot: r.generation for r in frame.rows}
            dropped.extend(key for key in pending.keys if owner.get(key[0], key[1]) != key[1])
        frames.append(frame)
        resolve(frame)

    def checked(meta: Any, shape: Any, *rest: Any) -> Any:  # what the step reads is each new prompt, whole
        for row in frames[-1].rows:
            if row.start_pos == 0:
                assert runner.pool.tokens[row.slot, : len(row.token_ids)].tolist() == list(row.token_ids)
        return device_step(meta, shape)

    drafting.before = watching  # type: ignore[method-assign]
    runner.device_step = checked  # type: ignore[method-assign]
    assert run_to_completion(core, [a, b], short) == want
    assert dropped, "A's last proposal was pending when B took its slot"


@pytest.fixture
def lonely(keys: Path, tmp_path: Path) -> Iterator[Server]:
    """A server of the test's own (it is killed and restarted)."""
    server = Server("eagle3", f"ipc://{tmp_path}/lonely.sock", keys).start()
    yield server
    server.kill()


def step_all(core: EngineCore, keys: list[int], until: float = 120.0) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {key: [] for key in keys}
    deadline = time.monotonic() + until
    while any(k in core.scheduler.requests for k in keys):
        assert time.monotonic() < deadline, "the engine hangs"
        for delta in core.step():
            out[delta.key].extend(delta.new_token_ids)
    return out


def test_a_dead_drafter_costs_speculation_not_tokens_and_a_restarted_one_serves_again(
        lonely: Server, prompts: list[list[int]], plain: dict[str, list[list[int]]]) -> None:
    from speckernel.wire.messages import AddRequest

    core = engine(lonely, timeout_ms="400", reconnect_ms="200")
    for i, ids in enumerate(prompts):
        assert core.add_request(AddRequest(100 + i, np.asarray(ids), GREEDY)) is None
    out: dict[int, list[int]] = {100: [], 101: []}
    for _ in range(4):  # prefill and a few speculative steps
        for delta in core.step():
            out[delta.key].extend(delta.new_token_ids)
    lonely.kill()
    for key, tokens in step_all(core, [100, 101]).items():
        out[key].extend(tokens)
    assert [out[100], out[101]] == plain["greedy"]
    plugin = core.stats()["spec"]["plugin"]
    assert plugin["num_failed_calls"] >= 1 and plugin["link_up"] == 0.0, plugin
    proposals = plugin["num_proposals"]
    lonely.start()
    deadline = time.monotonic() + 30
    while not core.stats()["spec"]["plugin"]["link_up"]:
        assert time.monotonic() < deadline, "the link never came back"
        time.sleep(0.05)
    failed = plugin["num_failed_calls"]
    seen = recorded(core)
    assert run_to_completion(core, prompts, GREEDY) == plain["greedy"]
    plugin = core.stats()["spec"]["plugin"]
    assert plugin["num_reconnects"] >= 1 and plugin["num_proposals"] > proposals, plugin
    assert plugin["num_failed_calls"] == failed, plugin
    # Speculation is back: the new requests' drafts are the server's, not the empty ones.
    assert any(t >= 0 for _, ids in drafts_of(core, seen) for row in ids for t in row)
    metrics = ServeMetrics().render(core.stats()).decode()
    assert f"speckernel_spec_plugin_num_failed_calls {float(failed)}" in metrics
    assert "speckernel_spec_plugin_num_reconnects 1.0" in metrics


def test_an_error_reply_releases_the_step_with_empty_drafts(eagle3: Server, prompts: list[list[int]],
                                                            plain: dict[str, list[list[int]]]) -> None:
    """A second engine with a shorter context rebuilds the server's drafter under the first one:
    the first's rows soon lie past its buffers and are refused (an error reply), and those
    requests go on without speculation."""
    core = engine(eagle3)
    engine(eagle3, max_model_len=2)  # the server's buffers now hold 2 + K + 2 positions
    assert run_to_completion(core, prompts, GREEDY) == plain["greedy"]
    plugin = core.stats()["spec"]["plugin"]
    assert plugin["num_error_replies"] >= 1 and plugin["num_rows_unspeculated"] >= 1, plugin
    engine(eagle3)  # back to the usual sizes, for the tests after this one


def ping(address: str, server_key: bytes | None, pair: tuple[bytes, bytes] | None, wait_ms: int = 1500) -> Any:
    """A Ping from a peer with these CURVE credentials (None: plain, no CURVE); its reply or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None and pair is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = pair
    sock.connect(address)
    try:
        sock.send_multipart(Encoder().encode(drafter_wire.Ping(7)))
        if not sock.poll(wait_ms):
            return None
        return Decoder(drafter_wire.DrafterReply).decode(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


def test_only_an_admitted_peer_talks_to_the_drafter(eagle3: Server, keys: Path, tmp_path: Path) -> None:
    server_key, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    admitted = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    assert isinstance(ping(eagle3.address, server_key, admitted), drafter_wire.Done)  # type: ignore[arg-type]
    assert ping(eagle3.address, server_key, zmq.curve_keypair()) is None  # a key not in clients/
    assert ping(eagle3.address, None, None) is None  # no CURVE at all
    # A server without the drafter's secret cannot answer an engine: the handshake fails, so
    # no reply (no draft) of its reaches it.
    rogue_ctx = zmq.Context()
    rogue = rogue_ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.curve_server = True
    rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
    address = f"ipc://{tmp_path}/rogue.sock"
    rogue.bind(address)
    try:
        with pytest.raises(InvalidInputError, match="no served drafter answered"):
            engine(Server("eagle3", address, keys), timeout_ms="300", hello_timeout_ms="300")
        assert not rogue.poll(0)  # and nothing of the engine's reached it
    finally:
        rogue.close(0)
        rogue_ctx.term()
    assert os.path.exists(keys / "clients" / "client.key")


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_fixed_shape_steps_draft_what_steps_at_their_own_size_draft(
        method: str, keys: Path, tmp_path: Path, tokenizer: Any) -> None:
    """The served drafter's padded passes (the ones it replays as device graphs where it can)
    against every step at its own size: the same drafts, row by row, step by step. Three rows
    pad to the bucket of four, so a padding row runs beside them."""
    from speckernel.engine.drafter import DrafterHost
    from speckernel.tools.serve_drafter import DrafterServer

    three = [tokenizer.encode(p) for p in PROMPTS[:3]]
    want = run_to_completion(engine(max_num_seqs=4), three, GREEDY)
    runs = {}
    for graphs in (True, False):
        host = DrafterHost(method, "smollm2-135m", platform="cpu", dtype="float32", graphs=graphs)
        server = DrafterServer(host, f"ipc://{tmp_path}/{method}-{graphs}.sock", keys)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        try:
            core = engine(Server(method, server.address, keys), max_num_seqs=4, deferred="false")
            seen = recorded(core)
            assert run_to_completion(core, three, GREEDY) == want
            runs[graphs] = drafts_of(core, seen)
        finally:
            server.stop.set()
            thread.join(5)
        assert (host.num_padded_steps > 0) == graphs and host.num_eager_steps > 0, (graphs, host.num_padded_steps)
    assert runs[True] == runs[False]


def test_a_proposal_s_time_is_accounted_phase_by_phase(keys: Path, tmp_path: Path,
                                                        prompts: list[list[int]]) -> None:
    """With 30 ms injected by the server, the breakdown `bench remote` reports puts them where
    they are: in the server's hold, inside the round trip, which holds every server phase; a
    synchronous step waits the whole round trip, a deferred one at most what was left of it."""
    server = Server("eagle3", f"ipc://{tmp_path}/slow.sock", keys, "--inject-rtt-ms", "30").start()
    try:
        for deferred in (True, False):
            core = engine(server, deferred=str(deferred).lower())
            run_to_completion(core, prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            spec: Any = core.speculator
            calls = spec.timed_proposals()
            plugin = core.stats()["spec"]["plugin"]
            # Every proposal is timed once its reply reached the step that waited for it (a
            # deferred one when the next step passed its gate: the run's last one never is).
            assert plugin["num_timed_proposals"] == len(calls) >= plugin["num_proposals"] - int(deferred) > 0
            assert plugin["time_round_trip_ms"] == pytest.approx(sum(c["round_trip"] for c in calls))
            for c in calls:
                assert min(c.values()) >= 0 and c["build"] > 0 and c["encode"] > 0, c
                served = sum(c[f"server_{p}"] for p in ("decode", "hold", "prepare", "compute", "d2h"))
                assert c["round_trip"] >= max(served, 30.0), c
                assert c["server_decode"] + c["server_hold"] >= 14.9, c  # the first half, held from arrival
                if deferred:  # it waited what the host work after the send left of the reply's way
                    way = c["round_trip"] + c["decode"] + c["release"]
                    assert c["exposed"] <= way + 1e-6 and c["exposed"] == pytest.approx(
                        max(way - c["overlap"], c["release"]), abs=1e-6), c
                else:  # it waited from right after the send to the reply, and then some
                    assert c["exposed"] + c["overlap"] >= c["round_trip"] > c["overlap"], c
            spec.close()
    finally:
        server.kill()


def test_a_reply_reaches_its_call_without_waiting_for_the_reply_thread_s_next_turn(eagle3: Server) -> None:
    """The runner's thread sends, the reply thread receives: whichever used the socket last
    makes sure a reply that is in gets drained, so none waits for the thread's timed turn
    (100 ms), the worst a lost wake-up would cost."""
    from speckernel.speculators.remote import Call

    core = engine(eagle3)
    link: Any = core.speculator.link  # type: ignore[union-attr]
    waits = []
    for _ in range(200):
        call = Call(link.next_id(), "ping", [])
        started = time.perf_counter()
        link.submit(call, drafter_wire.Ping(call.call_id))
        assert call.done.wait(5) and call.ok
        waits.append(time.perf_counter() - started)
    assert float(np.percentile(waits, 90)) < 0.05, sorted(waits)[-10:]
    core.speculator.close()  # type: ignore[union-attr]


def test_a_served_draft_model_accepts_what_the_one_in_the_engine_accepts(
        keys: Path, tmp_path: Path, prompts: list[list[int]], plain: dict[str, list[list[int]]]) -> None:
    """A drafter with KV of its own that takes in every confirmed token (rolled back past the
    rejected drafts), resolved deferred: served, it accepts what it accepts in the engine,
    position by position."""
    server = Server("draft_model", f"ipc://{tmp_path}/draft_model.sock", keys,
                    "--speculator-option", "num_layers=24").start()
    try:
        stats = {}
        for where in ("served", "local"):
            core = engine(server) if where == "served" else EngineCore(EngineConfig(
                platform="cpu", dtype="float32", max_model_len=256, max_num_seqs=2, speculator="draft_model",
                num_speculative_tokens=K, speculator_options={"num_layers": "24"}))
            assert run_to_completion(core, prompts, GREEDY) == plain["greedy"], where
            assert run_to_completion(core, prompts, SEEDED) == plain["seeded"], where
            stats[where] = core.stats()["spec"]
        assert stats["served"]["plugin"]["num_deferred"] > 0 and stats["served"]["num_accepted_tokens"] > 0
        assert stats["served"]["acceptance_per_position"] == stats["local"]["acceptance_per_position"]
    finally:
        server.kill()


def test_structured_output_with_a_served_drafter_equals_plain(eagle3: Server, prompts: list[list[int]]) -> None:
    """A grammar constrains a request whose drafts come from another process: the drafts are cut
    to their grammar-valid prefix (and the grammar's forced tokens lead them), the tokens are those
    of the plain engine under the same grammar."""
    from speckernel.sampling_params import StructuredOutput

    params = [SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput(regex=r"[0-9]{2,5} apples")),
              SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput(json_object=True))]
    outputs = {}
    for name, core in (("plain", engine()), ("served", engine(eagle3))):
        outputs[name] = [run_to_completion(core, [ids], p, prefix=f"g{i}")[0]
                         for i, (ids, p) in enumerate(zip(prompts, params, strict=True))]
        if name == "served":
            spec = core.stats()["spec"]
            assert spec["num_draft_tokens"] > 0 and spec["plugin"]["num_failed_calls"] == 0, spec
            assert spec["num_invalid_drafts"] > 0, "no served draft broke the grammar: the cut was not exercised"
    assert outputs["served"] == outputs["plain"]
