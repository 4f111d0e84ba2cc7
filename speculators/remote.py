"""A drafter served by `speckernel serve-drafter`, reached over CURVE-authenticated ZeroMQ.

`--speculator remote --speculator-option address=ADDR --speculator-option keys=DIR`. The
capabilities are the served drafter's (its width, its K=0 pass, the target layers it reads),
asked of the server at check time; placement says `remote`, and its draft KV lives there.

Each step the rows go to the server with what the drafter reads of them: the token-buffer span
the step touched, and the declared target layers' hidden states of the step's query tokens.
One reply thread owns the socket; the runner hands it requests through a queue.

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
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import torch
import zmq
import zmq.auth

from speckernel.kit import Decoder, Encoder, drafter_wire, logger
from speckernel.plugin import (
    Drafts,
    InvalidInputError,
    SpeculatorBase,
    SpeculatorCapabilities,
    SpeculatorContext,
    TargetStates,
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


def curve_keys(folder: str) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret) from the keys folder serve-drafter wrote."""
    path = Path(folder).expanduser()
    try:
        server, _ = zmq.auth.load_certificate(str(path / "server.key"))
        public, secret = zmq.auth.load_certificate(str(path / "client.key_secret"))
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"remote: keys={folder}: needs server.key and client.key_secret as "
                                f"`speckernel serve-drafter --keys` writes them ({e})") from None
    assert secret is not None
    return server, public, secret


class Link(threading.Thread):
    """The reply thread: owns the DEALER socket, sends what the runner queued, matches replies
    to calls by call_id, fails calls past their deadline, and dials again after a drop."""

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
        self.encoder = Encoder()  # the runner thread's (it encodes before queueing)
        self.own_encoder = Encoder()  # this thread's (an encoder keeps state while encoding)
        self.decoder = Decoder(wire.DrafterReply)
        self.queue: queue.SimpleQueue[tuple[Call, list[Any]]] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.pending: dict[int, Call] = {}
        self.up = False
        self.session = 0
        """The session the link is up with (0: down)."""
        self.next_dial = 0.0
        self.stopping = False
        self.ids = iter(range(1, 1 << 62))
        self.hello_call: Call | None = None
        self.described: wire.Described | None = None
        self.first = threading.Event()
        self.unspeculated: set[tuple[int, int]] = set()
        """(slot, generation) of requests one of whose calls failed: they run without speculation."""

    # --- the runner's side ------------------------------------------------------------------

    def submit(self, call: Call, msg: msgspec.Struct) -> None:
        self.queue.put((call, self.encoder.encode(msg)))
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
            for call in list(self.pending.values()):
                self._fail(call, "closed")
            if self.sock is not None:
                self.sock.close(0)
            self.ctx.term()

    def _turn(self) -> None:
        now = time.monotonic()
        if self.sock is None and now >= self.next_dial:
            self._dial()
        deadlines = [c.deadline for c in self.pending.values()]
        if self.sock is None:
            deadlines.append(self.next_dial)
        wait = max(0.0, min(deadlines, default=now + 0.1) - now)
        poller = zmq.Poller()
        poller.register(self.wake_r, zmq.POLLIN)
        if self.sock is not None:
            poller.register(self.sock, zmq.POLLIN)
        events = dict(poller.poll(int(min(wait, 0.1) * 1e3) + 1))
        if self.wake_r in events:
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                pass
        self._send_queued()
        if self.sock is not None and self.sock in events:
            while self.sock is not None and self.sock.poll(0):
                self._receive(self.sock.recv_multipart(copy=False))
        now = time.monotonic()
        late = [c for c in self.pending.values() if c.deadline <= now]
        if late:
            self.counters["num_timeouts"] += len(late)
            log.warning("remote_drafter_timeout", calls=len(late), timeout_ms=self.options.timeout_ms,
                        effect="empty drafts; speculation off for those requests; dialling again")
            self._drop("timeout")

    def _dial(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.connect(self.options.address)
        self.sock = sock
        call = Call(self.next_id(), "hello", [])
        call.deadline = time.monotonic() + max(self.timeout_s, 1.0)
        self.hello_call = call
        self.pending[call.call_id] = call
        sock.send_multipart(self.own_encoder.encode(msgspec.structs.replace(self.hello, call_id=call.call_id)),
                            copy=False)

    def _send_queued(self) -> None:
        while True:
            try:
                call, frames = self.queue.get_nowait()
            except queue.Empty:
                return
            if not self.up or self.sock is None:
                self._fail(call, "unreachable")
                continue
            call.deadline = time.monotonic() + self.timeout_s
            self.pending[call.call_id] = call
            self.sock.send_multipart(frames, copy=False)

    def _receive(self, frames: list[Any]) -> None:
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
    counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
    link = Link(options, hello, counters)
    link.start()
    wait_s = max(options.timeout_ms / 1e3, 1.0) + 0.5
    if not link.first.wait(wait_s) or link.described is None:
        link.close()
        raise InvalidInputError(f"remote: no served drafter answered at {options.address} within {wait_s:.1f} s "
                                "(is `speckernel serve-drafter` running there, with these keys, for this target?)")
    described = link.described
    caps = msgspec.convert(described.capabilities, SpeculatorCapabilities)
    fixed = caps.draft_width == "fixed"
    return msgspec.structs.replace(
        caps, placement="remote", device_only=False, trainable=False, uses_target_weights=False,
        uses_target_kv=False, lookahead_slots_per_draft=0, deferred=options.deferred and fixed,
        k0_pass=f"the served {described.method}'s: {caps.k0_pass}"), link


COUNTERS = ("num_proposals", "num_deferred", "num_ingests", "num_frees", "num_failed_calls", "num_timeouts",
            "num_error_replies", "num_bad_replies", "num_late_replies", "num_reconnects", "num_rows_unspeculated")


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

    def stats(self) -> dict[str, float]:
        return dict(self.counters) | {"link_up": float(self.link.up)}

    def close(self) -> None:
        self.link.close()

    # --- the kernel's calls -------------------------------------------------------------------

    def sync(self, states: TargetStates) -> None:
        index = self._served_rows(states)
        if not index:
            return
        call = self._call("ingest", states, index)
        self.counters["num_ingests"] += 1
        self.link.submit(call, self._step(call, states, index))

    def propose(self, states: TargetStates, k: int) -> Drafts:
        rows = states.num_rows
        staging = torch.full((rows, k), -1, dtype=torch.int64, pin_memory=self.pin and self.deferred)
        index = self._served_rows(states)
        gate = self.gate(2 * self.options.timeout_ms / 1e3 + 1.0) if self.deferred and self.gate else None
        self.counters["num_rows_unspeculated"] += sum(states.samples) - sum(states.samples[i] for i in index)
        if not index:
            if gate is not None:
                gate.open()
                return Drafts(staging, ready=gate)
            return Drafts(staging.to(self.device))
        call = self._call("propose", states, index)
        call.staging, call.gate = staging.numpy(), gate
        self.counters["num_proposals"] += 1
        self.link.submit(call, self._step(call, states, index, k))
        if gate is not None:
            self.counters["num_deferred"] += 1
            return Drafts(staging, ready=gate)
        call.done.wait(2 * self.options.timeout_ms / 1e3 + 1.0)
        return Drafts(staging.to(self.device))

    # --- rows ---------------------------------------------------------------------------------

    def _served_rows(self, states: TargetStates) -> list[int]:
        """Rows the server holds the state of: their request began while the link was up with
        the session still up, and none of its calls failed. A slot with a new owner is freed."""
        freed: list[tuple[int, int]] = []
        session = self.link.session if self.link.up else 0
        index = []
        for i, (slot, generation) in enumerate(zip(states.slots, states.generations, strict=True)):
            owner = self.owner.get(slot)
            if owner is None or owner[0] != generation:
                if owner is not None and owner[1]:
                    freed.append((slot, owner[0]))
                    self.unspeculated.discard((slot, owner[0]))
                # A request's first row starts at position 0: only then can the server catch up.
                owner = (generation, session if states.start_pos[i] == 0 else 0)
                self.owner[slot] = owner
            if owner[1] and owner[1] == session and (slot, generation) not in self.unspeculated:
                index.append(i)
        if freed and session:
            self.counters["num_frees"] += 1
            call = Call(self.link.next_id(), "free", freed)
            self.link.submit(call, wire.Free(call.call_id, [s for s, _ in freed], [g for _, g in freed]))
        return index

    def _call(self, kind: str, states: TargetStates, index: list[int]) -> Call:
        return Call(self.link.next_id(), kind, [(states.slots[i], states.generations[i]) for i in index], index)

    def _step(self, call: Call, states: TargetStates, index: list[int], k: int = 0) -> Any:
        """The step's rows `index` as the server needs them: their rows, token spans and hidden states."""
        qs = states.query_start
        spans = []
        rows = []
        accepted = states.accepted.tolist()
        for i in index:
            n = qs[i + 1] - qs[i]
            lo, hi = states.start_pos[i], max(states.start_pos[i] + n, states.seq_lens[i])
            spans.append((states.slots[i], lo, hi))
            rows.append(wire.Row(slot=states.slots[i], generation=states.generations[i],
                                 start_pos=states.start_pos[i], num_tokens=n, num_drafts=states.num_drafts[i],
                                 accepted=int(accepted[i]), seq_len=states.seq_lens[i],
                                 samples=states.samples[i], tokens_from=lo, num_new_tokens=hi - lo,
                                 sampling=states.sampling[i]))
        flat_slots = np.concatenate([np.full(hi - lo, s) for s, lo, hi in spans])
        flat_pos = np.concatenate([np.arange(lo, hi) for _, lo, hi in spans])
        tokens = states.tokens[torch.from_numpy(flat_slots).to(states.tokens.device),
                               torch.from_numpy(flat_pos).to(states.tokens.device)].cpu().numpy()
        all_rows = len(index) == states.num_rows
        take = None if all_rows else torch.from_numpy(
            np.concatenate([np.arange(qs[i], qs[i + 1]) for i in index])).to(states.tokens.device)
        hidden, dtype = [], "float32"
        for layer in self.layers:
            h = states.hidden[layer][: qs[-1]]
            if take is not None:
                h = h.index_select(0, take)
            dtype = str(h.dtype).removeprefix("torch.")
            host = h.contiguous().cpu()
            hidden.append((host.view(torch.int16) if dtype == "bfloat16" else host).numpy())
        if k:
            return wire.Propose(call.call_id, rows, tokens, hidden, dtype, k)
        return wire.Ingest(call.call_id, rows, tokens, hidden, dtype)
