"""A drafter served by `speckernel serve-drafter`, reached over CURVE-authenticated ZeroMQ.

`--speculator remote --speculator-option address=ADDR --speculator-option keys=DIR`. The
capabilities are the served drafter's (its width, its K=0 pass, the target layers it reads),
asked of the server at check time; placement says `remote`, and its draft KV lives there.

Each step the rows go to the server with what the drafter reads of them: the token-buffer span
the step touched, and the declared target layers' hidden states of the step's query tokens,
read from the device in one copy. The runner's thread sends the request itself; one reply
thread receives the replies, writes the drafts into the staging and opens the gate.

Resolution. Deferred (fixed width, `deferred=true`, the default): `propose` returns at once
with host staging memory (pinned where the device copies from it) and a platform `HostGate`;
the reply thread fills the staging and opens the gate, and the kernel issues the drafts' copy,
storage and the next step's inputs behind it, after the next step's host work. Synchronous
elsewhere: variable width (the scheduler needs the draft IDs at once) and `deferred=false`.

Ordering. Replies carry (slot, generation) and are applied only to the call that asked for
them; a slot whose generation changed is freed on the server (`Free`) before the new request's
first row is sent, and the kernel resolves a pending reply before the next step's tokens go
into the token buffer, so a finished request's draft never reaches its slot's next owner.

Failures. An error reply, a reply later than `timeout_ms`, or a dead server release the gate
with -1 drafts (never accepted: the row's output is the target's own) and switch speculation
off for the requests concerned, for the rest of their life; each is logged and counted
(`stats()`). A dead link is dropped and dialled again every `reconnect_ms`; a server that
comes back serves the requests that start after it did (a restarted one has lost the others'
draft state).
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

import msgspec
import numpy as np
import torch
import zmq
import zmq.auth

from speckernel.kit import Decoder, Encoder, drafter_wire, logger, to_device
from speckernel.plugin import (
    DeferredDrafts,
    DeviceStates,
    Drafts,
    HostRows,
    InvalidInputError,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
)

wire = drafter_wire
log = logger("remote")


class RemoteOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    address: str = ""
    """The served drafter's ZeroMQ address (tcp://HOST:PORT, ipc://PATH)."""
    keys: str = ""
    """Folder with the server's public key (server.key) and this engine's pair (client.key_secret)."""
    deferred: bool = True
    """Resolve fixed-width drafts behind the next step's host work (false: wait in propose)."""
    timeout_ms: Annotated[float, msgspec.Meta(gt=0)] = 2000.0
    """A reply later than this fails its call (empty drafts) and drops the link."""
    reconnect_ms: Annotated[float, msgspec.Meta(gt=0)] = 500.0
    """How often a dropped link is dialled again."""
    hello_timeout_ms: Annotated[float, msgspec.Meta(gt=0)] = 30000.0
    """How long the answer to a Hello may take, at start and after each dial: a drafter builds its
    buffers (and may load weights) for the first Hello of an engine's sizes, which on a busy host
    takes tens of seconds. Meanwhile requests run without speculation; nothing waits but the start."""


@dataclass
class Call:
    """One request in flight: the rows it names and, for a proposal, where its drafts go."""

    call_id: int
    kind: str
    keys: list[tuple[int, int]]
    """(slot, generation) of the rows sent, in order."""
    index: list[int] = field(default_factory=list)
    """Their rows in the step (staging rows)."""
    staging: np.ndarray | None = None
    gate: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    session: int = 0
    reply: Any = None
    deadline: float = 0.0
    at: dict[str, float] = field(default_factory=dict)
    """perf_counter() at each mark of its way (`PHASES` says which)."""
    timing: Any = None
    """The server's `ServerTiming` of it."""


def curve_keys(folder: str) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret) from the keys folder serve-drafter wrote."""
    path = Path(folder).expanduser()
    wire.check_private(path / wire.CLIENT_SECRET)
    try:
        server, _ = zmq.auth.load_certificate(str(path / "server.key"))
        public, secret = zmq.auth.load_certificate(str(path / wire.CLIENT_SECRET))
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"remote: keys={folder}: needs server.key and client.key_secret as "
                                f"`speckernel serve-drafter --keys` writes them ({e})") from None
    assert secret is not None
    return server, public, secret


def readable_now(sock: zmq.Socket) -> bool:
    """A reply waits in the socket (asking also resets its descriptor's signal)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


class Link(threading.Thread):
    """The DEALER socket and the reply thread. The runner's thread sends its requests itself
    (no hand-off: a queued request would wait for this thread to get the interpreter, which
    the runner holds through the next step's host work, the very work a deferred reply is meant
    to overlap); this thread receives, matches replies to calls by call_id, fills their staging
    and opens their gates, fails calls past their deadline, and dials again after a drop.

    Every use of the socket is under `lock`. The thread waits on the socket's file descriptor
    outside it; that descriptor only says "look again" (ZeroMQ's edge-triggered ZMQ_FD), so
    whoever used the socket last checks `zmq.EVENTS` and, when a reply is readable, makes sure
    this thread drains it."""

    def __init__(self, options: RemoteOptions, hello: wire.Hello, counters: dict[str, float]) -> None:
        """counters: shared with the speculator, which reads them for its stats."""
        super().__init__(name="speckernel-remote-drafter", daemon=True)
        self.options = options
        self.server_key, self.public, self.secret = curve_keys(options.keys)
        self.hello = hello
        self.counters = counters
        self.timeout_s = options.timeout_ms / 1e3
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.fd = -1
        """The socket's ZMQ_FD (only this thread dials and closes, so it is valid while it waits)."""
        self.lock = threading.Lock()
        self.encoder = Encoder()  # the runner thread's
        self.own_encoder = Encoder()  # this thread's (an encoder keeps state while encoding)
        self.decoder = Decoder(wire.DrafterReply)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.pending: dict[int, Call] = {}
        self.up = False
        self.session = 0
        """The session the link is up with (0: down)."""
        self.next_dial = 0.0
        self.stopping = False
        self.broken = False
        """A send found no peer to take it: drop the link and dial again."""
        self.ids = iter(range(1, 1 << 62))
        self.hello_call: Call | None = None
        self.described: wire.Described | None = None
        self.first = threading.Event()
        self.unspeculated: set[tuple[int, int]] = set()
        """(slot, generation) of requests one of whose calls failed: they run without speculation."""

    # --- the runner's side ------------------------------------------------------------------

    def submit(self, call: Call, msg: msgspec.Struct) -> None:
        """Sends a request on the calling thread; a link that is down fails the call at once."""
        call.at["built"] = time.perf_counter()
        frames = self.encoder.encode(msg)
        call.at["encoded"] = time.perf_counter()
        with self.lock:
            sock = self.sock
            if not self.up or sock is None:
                self._fail(call, "unreachable")
                return
            call.deadline = time.monotonic() + self.timeout_s
            self.pending[call.call_id] = call
            call.at["sent"] = time.perf_counter()  # before the call: the round trip holds all the server did
            try:  # never blocks: a DEALER with no peer would hold the step forever
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.broken = True
                self._fail(call, "unreachable")
                readable = True  # wake the thread: it drops the link
            else:
                readable = readable_now(sock)
        if readable:  # the send may have taken the descriptor's signal of a reply already in
            os.write(self.wake_w, b"x")

    def next_id(self) -> int:
        return next(self.ids)

    def close(self) -> None:
        self.stopping = True
        os.write(self.wake_w, b"x")
        self.join(timeout=2)
        os.close(self.wake_r)
        os.close(self.wake_w)

    # --- the reply thread -------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.stopping:
                self._turn()
        finally:
            with self.lock:
                for call in list(self.pending.values()):
                    self._fail(call, "closed")
                if self.sock is not None:
                    self.sock.close(0)
                    self.sock = None
            self.ctx.term()

    def _turn(self) -> None:
        now = time.monotonic()
        if self.sock is None and now >= self.next_dial:
            with self.lock:
                self._dial()
        deadlines = [c.deadline for c in list(self.pending.values())]
        if self.sock is None:
            deadlines.append(self.next_dial)
        wait = max(0.0, min(deadlines, default=now + 0.1) - now)
        poller = select.poll()  # not select(): a busy process may hold descriptors past FD_SETSIZE
        for fd in [self.wake_r] if self.sock is None else [self.wake_r, self.fd]:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(int(min(wait, 0.1) * 1e3) + 1)}
        if self.wake_r in ready:
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                pass
        with self.lock:
            self._drain()
            if self.broken:
                self.broken = False
                self._drop("unreachable")
            now = time.monotonic()
            late = [c for c in self.pending.values() if c.deadline <= now]
            if late:
                self.counters["num_timeouts"] += len(late)
                log.warning("remote_drafter_timeout", calls=len(late), timeout_ms=self.options.timeout_ms,
                            effect="empty drafts; speculation off for those requests; dialling again")
                self._drop("timeout")

    def _drain(self) -> None:
        """Every reply readable now (until zmq.EVENTS says none: the descriptor signals again
        only after that)."""
        while self.sock is not None and readable_now(self.sock):
            self._receive(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))

    def _dial(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.REPLY_FRAME_BYTES)  # a larger reply drops the link, unread
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.connect(self.options.address)
        self.sock, self.fd = sock, cast(int, sock.getsockopt(zmq.FD))
        call = Call(self.next_id(), "hello", [])
        call.deadline = time.monotonic() + self.options.hello_timeout_ms / 1e3
        self.hello_call = call
        self.pending[call.call_id] = call
        sock.send_multipart(self.own_encoder.encode(msgspec.structs.replace(self.hello, call_id=call.call_id)),
                            copy=False)

    def _receive(self, frames: list[Any]) -> None:
        received = time.perf_counter()
        try:
            reply = self.decoder.decode(frames)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["num_bad_replies"] += 1
            log.warning("remote_drafter_bad_reply", error=str(e))
            return
        call = self.pending.pop(reply.call_id, None)
        if call is None:  # a reply to a call that already failed (or was never made)
            self.counters["num_late_replies"] += 1
            return
        if call is self.hello_call:
            self._hello_reply(call, reply)
            return
        if isinstance(reply, wire.Failed):
            self.counters["num_error_replies"] += 1
            log.warning("remote_drafter_error", call=call.kind, error=reply.error,
                        effect="empty drafts; speculation off for those requests")
            self._fail(call, "error")
            return
        if call.kind == "propose":
            if not self._stage(call, reply):
                return
            call.timing = reply.timing
            call.at["received"], call.at["staged"] = received, time.perf_counter()
        call.ok = True
        self._release(call)

    def _stage(self, call: Call, reply: Any) -> bool:
        """Writes a proposal's drafts into its staging rows; a reply for other rows fails the call."""
        assert call.staging is not None
        rows = len(call.index)
        ids = getattr(reply, "token_ids", None)
        keys = list(zip(getattr(reply, "slots", []), getattr(reply, "generations", []), strict=False))
        k = call.staging.shape[1]
        valid = (isinstance(reply, wire.Drafted) and keys == call.keys and isinstance(ids, np.ndarray)
                 and ids.shape == (rows, k) and ids.dtype.kind in "iu")
        if not valid or ids is None:
            self.counters["num_bad_replies"] += 1
            log.warning("remote_drafter_bad_reply", error="the reply names other rows or shapes than the call")
            self._fail(call, "bad_reply")
            return False
        call.staging[call.index] = np.where(ids >= 0, ids, -1)
        return True

    def _hello_reply(self, call: Call, reply: Any) -> None:
        self.hello_call = None
        if not isinstance(reply, wire.Described):
            error = reply.error if isinstance(reply, wire.Failed) else type(reply).__name__
            log.warning("remote_drafter_refused", error=error)
            self.described = None
            self._drop("refused")
            self.first.set()
            return
        if self.session and reply.session != self.session:
            log.warning("remote_drafter_restarted", session=reply.session,
                        effect="requests that began before it run without speculation")
        if self.described is not None or self.first.is_set():
            self.counters["num_reconnects"] += 1
            log.info("remote_drafter_reconnected", address=self.options.address)
        self.described = reply
        self.session = reply.session
        self.up = True
        self.first.set()

    def _drop(self, why: str) -> None:
        """The link is gone: every call in flight fails, and the socket is dialled again later."""
        self.up = False
        self.session = 0
        for call in list(self.pending.values()):
            self._fail(call, why)
        self.pending.clear()
        self.hello_call = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self.next_dial = time.monotonic() + self.options.reconnect_ms / 1e3

    def _fail(self, call: Call, why: str) -> None:
        self.pending.pop(call.call_id, None)
        if call.kind != "hello":
            self.counters["num_failed_calls"] += 1
            self.unspeculated.update(call.keys)
            call.reply = why
        self._release(call)

    def _release(self, call: Call) -> None:
        call.done.set()
        if call.gate is not None:
            call.gate.open()


def describe(ctx: SpeculatorContext) -> tuple[SpeculatorCapabilities, Link]:
    """Asks the server what it serves for this target: its capabilities, and a live link."""
    options: RemoteOptions = ctx.options
    if not options.address:
        raise InvalidInputError("remote: set the served drafter's address (--speculator-option address=ADDR)")
    if not options.keys:
        raise InvalidInputError("remote: set the CURVE keys folder serve-drafter wrote "
                                "(--speculator-option keys=DIR)")
    hello = wire.Hello(call_id=0, target=wire.fingerprint(ctx.target), block_size=ctx.block_size,
                       max_model_len=ctx.max_model_len, num_speculative_tokens=ctx.num_speculative_tokens,
                       num_slots=ctx.num_slots)
    counters: dict[str, float] = dict.fromkeys(COUNTERS, 0) | dict.fromkeys(TIMED_COUNTERS, 0.0)
    link = Link(options, hello, counters)
    link.start()
    wait_s = options.hello_timeout_ms / 1e3 + 0.5
    if not link.first.wait(wait_s) or link.described is None:
        link.close()
        raise InvalidInputError(f"remote: no served drafter answered at {options.address} within {wait_s:.1f} s "
                                "(is `speckernel serve-drafter` running there, with these keys, for this target? "
                                "A drafter that builds slowly takes --speculator-option hello_timeout_ms=MS)")
    described = link.described
    caps = msgspec.convert(described.capabilities, SpeculatorCapabilities)
    fixed = caps.draft_width == "fixed"
    return msgspec.structs.replace(
        caps, placement="remote", trainable=False, uses_target_weights=False,
        uses_target_kv=False, lookahead_slots_per_draft=0, deferred=options.deferred and fixed,
        k0_pass=f"the served {described.method}'s: {caps.k0_pass}"), link


COUNTERS = ("num_proposals", "num_deferred", "num_ingests", "num_frees", "num_failed_calls", "num_timeouts",
            "num_error_replies", "num_bad_replies", "num_late_replies", "num_reconnects", "num_rows_unspeculated")

PHASES = ("build", "encode", "send", "round_trip", "decode", "release", "exposed", "overlap")
"""A proposal's way, timed (`time_<phase>_ms` in the stats, summed over `num_timed_proposals`):
build: the request from the step's states (device-to-host copies included); encode; send: to
the socket (waiting for the reply thread to let go of it); round_trip: from the socket's send
call to the reply received (the server's phases, `server_<phase>_ms`, and the wire); decode: the
reply decoded into the staging; release: staged to the waiting work going on (the gate's or the
waiting thread's wake-up); exposed: how long the step waited for the reply (synchronous: in
propose; deferred: the work held at the gate), the part of the round trip no host work hid;
overlap: the host work between the send and that wait, what a deferred reply hides behind."""

SERVER_PHASES = ("decode", "hold", "prepare", "compute", "d2h", "send")
TIMED_COUNTERS = ("num_timed_proposals", *(f"time_{p}_ms" for p in PHASES),
                  *(f"time_server_{p}_ms" for p in (*SERVER_PHASES, "device_compute")))


class RemoteSpeculator(SpeculatorBase):
    name = "remote"
    capabilities = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=64, placement="remote",
                                          k0_pass="the served drafter's (asked of it at start)")
    Options = RemoteOptions

    @classmethod
    def check(cls, ctx: SpeculatorContext[RemoteOptions]) -> None:
        _, link = describe(ctx)
        link.close()

    @classmethod
    def capabilities_for(cls, ctx: SpeculatorContext[RemoteOptions]) -> SpeculatorCapabilities:
        caps, link = describe(ctx)
        link.close()
        return caps

    def __init__(self, ctx: SpeculatorContext[RemoteOptions]) -> None:
        self.options = ctx.options
        caps, self.link = describe(ctx)
        self.counters = self.link.counters
        self.gate = ctx.host_gate
        self.deferred = caps.deferred and self.gate is not None
        self.capabilities = msgspec.structs.replace(caps, deferred=self.deferred)  # type: ignore[misc]
        self.device = ctx.device
        self.pin = ctx.pin_memory
        self.layers = caps.target_hidden_layers
        self.owner: dict[int, tuple[int, int]] = {}
        """Per slot: (generation, session it began under; 0 while the link was down)."""
        self.unspeculated = self.link.unspeculated
        self.awaiting: list[Call] = []
        """Deferred proposals whose gate has not been passed yet (timed once it has)."""
        self.timed: deque[dict[str, float]] = deque(maxlen=4096)

    def stats(self) -> dict[str, float]:
        self._harvest()
        return dict(self.counters) | {"link_up": float(self.link.up)}

    def _timed(self, call: Call, released: float, blocked: float) -> None:
        """Adds a proposal's phases to the stats, once its reply has reached the work that waited."""
        at, t = call.at, call.timing
        if not call.ok or t is None or not {"start", "sent", "received", "staged"} <= at.keys():
            return
        phases = {"build": at["built"] - at["start"], "encode": at["encoded"] - at["built"],
                  "send": at["sent"] - at["encoded"], "round_trip": at["received"] - at["sent"],
                  "decode": at["staged"] - at["received"], "release": released - max(at["staged"], blocked),
                  "exposed": released - blocked, "overlap": max(blocked - at["sent"], 0.0)}
        ms = {name: seconds * 1e3 for name, seconds in phases.items()}
        ms |= {f"server_{name}": getattr(t, name) for name in SERVER_PHASES}
        ms["server_device_compute"] = max(t.device_compute, 0.0)
        for name, value in ms.items():
            self.counters[f"time_{name}_ms"] += value
        self.counters["num_timed_proposals"] += 1
        self.timed.append(ms)

    def timed_proposals(self) -> list[dict[str, float]]:
        """The latest timed proposals' phases, ms each, oldest first (a bench takes percentiles)."""
        self._harvest()
        return list(self.timed)

    def _harvest(self) -> None:
        """Times the deferred proposals whose gate the step's work has passed since."""
        waiting = []
        for call in self.awaiting:
            gate = call.gate
            if gate.passed_at:
                self._timed(call, gate.passed_at, gate.blocked_at)
            else:
                waiting.append(call)
        self.awaiting = waiting[-8:]  # a gate the runner dropped (speculation stopped) is never passed

    def close(self) -> None:
        self.link.close()

    # --- the kernel's calls -------------------------------------------------------------------

    def sync(self, states: DeviceStates, rows: HostRows) -> None:
        index = self._served_rows(rows)
        if not index:
            return
        call = self._call("ingest", rows, index)
        self.counters["num_ingests"] += 1
        self.link.submit(call, self._step(call, states, rows, index))

    def propose(self, states: DeviceStates, rows: HostRows, k: int) -> Drafts | DeferredDrafts:
        start = time.perf_counter()
        self._harvest()
        staging = torch.full((states.num_rows, k), -1, dtype=torch.int64, pin_memory=self.pin and self.deferred)
        index = self._served_rows(rows)
        gate = self.gate(2 * self.options.timeout_ms / 1e3 + 1.0) if self.deferred and self.gate else None
        self.counters["num_rows_unspeculated"] += sum(rows.samples) - sum(rows.samples[i] for i in index)
        if not index:
            if gate is not None:
                gate.open()
                return DeferredDrafts(staging, gate)
            return Drafts(staging.to(self.device))
        call = self._call("propose", rows, index)
        call.staging, call.gate = staging.numpy(), gate
        call.at["start"] = start
        self.counters["num_proposals"] += 1
        self.link.submit(call, self._step(call, states, rows, index, k))
        if gate is not None:
            self.counters["num_deferred"] += 1
            self.awaiting.append(call)
            return DeferredDrafts(staging, gate)
        waiting = time.perf_counter()
        call.done.wait(2 * self.options.timeout_ms / 1e3 + 1.0)
        self._timed(call, time.perf_counter(), waiting)
        return Drafts(staging.to(self.device))

    # --- rows ---------------------------------------------------------------------------------

    def _served_rows(self, rows: HostRows) -> list[int]:
        """Rows the server holds the state of: their request began while the link was up with
        the session still up, and none of its calls failed. A slot with a new owner is freed."""
        freed: list[tuple[int, int]] = []
        session = self.link.session if self.link.up else 0
        index = []
        for i, (slot, generation) in enumerate(zip(rows.slots, rows.generations, strict=True)):
            owner = self.owner.get(slot)
            if owner is None or owner[0] != generation:
                if owner is not None and owner[1]:
                    freed.append((slot, owner[0]))
                    self.unspeculated.discard((slot, owner[0]))
                # A request's first row starts at position 0: only then can the server catch up.
                owner = (generation, session if rows.start_pos[i] == 0 else 0)
                self.owner[slot] = owner
            if owner[1] and owner[1] == session and (slot, generation) not in self.unspeculated:
                index.append(i)
        if freed and session:
            self.counters["num_frees"] += 1
            call = Call(self.link.next_id(), "free", freed)
            self.link.submit(call, wire.Free(call.call_id, [s for s, _ in freed], [g for _, g in freed]))
        return index

    def _call(self, kind: str, rows: HostRows, index: list[int]) -> Call:
        return Call(self.link.next_id(), kind, [(rows.slots[i], rows.generations[i]) for i in index], index)

    def _step(self, call: Call, states: DeviceStates, host: HostRows, index: list[int], k: int = 0) -> Any:
        """The step's rows `index` as the server needs them: their rows, token spans and hidden
        states. What lives on the device (the spans' tokens, the declared layers' hidden states)
        is gathered and packed there and read back in one copy, into pinned memory the request's
        frames then point into; the accepted counts come from the host's own figures."""
        qs, start, seq = host.query_start, host.start_pos, host.seq_lens
        rows, slots, positions = [], [], []
        for i in index:
            n = qs[i + 1] - qs[i]
            lo, hi = start[i], max(start[i] + n, seq[i])
            # A row that sampled confirmed its context before the drafts, the drafts it accepted
            # and one token more: seq_lens says how many it accepted, no device read needed.
            accepted = seq[i] - (lo + n - host.num_drafts[i]) - 1 if host.samples[i] else 0
            rows.append(wire.Row(slot=host.slots[i], generation=host.generations[i], start_pos=lo,
                                 num_tokens=n, num_drafts=host.num_drafts[i], accepted=accepted,
                                 seq_len=seq[i], samples=host.samples[i], tokens_from=lo, num_new_tokens=hi - lo,
                                 sampling=host.sampling[i]))
            slots.append(np.full(hi - lo, host.slots[i], np.int64))
            positions.append(np.arange(lo, hi, dtype=np.int64))
        n_tokens = sum(len(p) for p in positions)
        take = [] if len(index) == states.num_rows else [np.arange(qs[i], qs[i + 1], dtype=np.int64) for i in index]
        where = to_device(np.concatenate([*slots, *positions, *take]), self.device)  # one copy to the device
        parts = [states.tokens[where[:n_tokens], where[n_tokens : 2 * n_tokens]].view(torch.uint8)]
        shapes = []
        for layer in self.layers:
            h = states.hidden[layer][: qs[-1]]
            if take:
                h = h.index_select(0, where[2 * n_tokens :])
            shapes.append(tuple(h.shape))
            parts.append(h.contiguous().view(torch.uint8).reshape(-1))
        dtype = str(states.hidden[self.layers[0]].dtype).removeprefix("torch.") if self.layers else "float32"
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.pin:  # one device-to-host copy
            staged = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True).copy_(packed)
        else:
            staged = packed.cpu()
        buf = staged.numpy()
        tokens = buf[: 8 * n_tokens].view(np.int64)
        hidden, offset = [], 8 * n_tokens
        carrier = np.dtype(wire.HIDDEN_CARRIERS.get(dtype, "float32"))
        for shape in shapes:
            size = shape[0] * shape[1] * carrier.itemsize
            hidden.append(buf[offset : offset + size].view(carrier).reshape(shape))
            offset += size
        if k:
            return wire.Propose(call.call_id, rows, tokens, hidden, dtype, k)
        return wire.Ingest(call.call_id, rows, tokens, hidden, dtype)
