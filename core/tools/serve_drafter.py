"""`speckernel serve-drafter --method M --bind ADDR --keys DIR`: a built-in drafter in its own process.

One ROUTER socket, CURVE-authenticated like the engine core's sockets: the server holds the
secret of `DIR/server.key_secret` and admits only the clients whose public keys lie in
`DIR/clients/` (the first start writes both pairs, `client.key_secret` being the engine's:
`--speculator remote --speculator-option address=ADDR --speculator-option keys=DIR`). A peer
without an admitted key never completes the handshake, so it can neither send a request nor
read a reply. Requests are handled one at a time in arrival order (`DrafterHost`); a request
that fails is answered with `Failed` and the server goes on.

`--inject-rtt-ms` holds each reply back by that much after its request arrived (half before
the drafter runs, half after), so `speckernel bench remote` can measure what the link costs.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .. import log
from ..errors import InvalidInputError
from ..wire.codec import Decoder, Encoder
from ..wire.drafter import (
    CLIENT_SECRET,
    SERVER_SECRET,
    Describe,
    Described,
    Done,
    Drafted,
    DrafterReply,
    DrafterRequest,
    Failed,
    Free,
    Hello,
    Ingest,
    Ping,
    Propose,
    check_private,
)
from ..wire.limits import DEFAULT_STEP_TOKENS, drafter_request_limit
from .engine_args import parse_options

TIMED = ("decode", "hold", "prepare", "compute", "d2h", "send")
"""`ServerTiming`'s host-clock phases, summed in the server's stats."""


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("serve-drafter", help="serve a built-in drafter for one target over ZeroMQ "
                                             "(the engine's `--speculator remote` connects to it)")
    p.add_argument("--method", required=True, help="the drafter: a built-in speculator (eagle3, mtp, dflash, ngram...)")
    p.add_argument("--model", default="smollm2-135m", help="the target it drafts for (default: smollm2-135m)")
    p.add_argument("--draft-model", default=None, help="the drafter's checkpoint (default: the shipped one)")
    p.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the drafter (repeatable)")
    p.add_argument("--bind", required=True, metavar="ADDR", help="ZeroMQ address, e.g. tcp://127.0.0.1:5710 or ipc://PATH")
    p.add_argument("--keys", required=True, type=Path, metavar="DIR",
                   help="CURVE keys: server.key(_secret), client.key(_secret) and the admitted clients/ "
                        "(written when missing)")
    p.add_argument("--platform", default=None, help="platform plugin (default: the best available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the platform's)")
    p.add_argument("--max-step-tokens", type=int, default=DEFAULT_STEP_TOKENS, metavar="N",
                   help="the most query tokens of one engine step (at least the engine's max_num_batched_tokens; "
                        f"default: {DEFAULT_STEP_TOKENS}): a frame larger than one target layer's hidden states "
                        "of that many tokens disconnects its peer")
    p.add_argument("--inject-rtt-ms", type=float, default=0.0, help="hold each reply back by this round trip")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step at its own size (default: steady-state steps of an in-step drafter "
                        "replay device graphs captured at start)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _write_key(path: Path, mode: int, public: bytes, secret: bytes | None = None) -> None:
    """A certificate as `zmq.auth.load_certificate` reads it. The file is created with its final
    mode (never readable by others, not even for a moment) under a temporary name, then renamed,
    so a concurrent start never reads half a key."""
    kind = "Secret" if secret else "Public"
    text = (f"#   ZeroMQ CURVE {kind} Certificate, written by speckernel serve-drafter\n"
            f"metadata\ncurve\n    public-key = \"{public.decode()}\"\n")
    if secret:
        text += f"    secret-key = \"{secret.decode()}\"\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_pair(folder: Path, name: str) -> bytes:
    """A fresh key pair `name.key` (public, 0644) and `name.key_secret` (0600); the public key."""
    public, secret = zmq.curve_keypair()
    _write_key(folder / f"{name}.key", 0o644, public)
    _write_key(folder / f"{name}.key_secret", 0o600, public, secret)
    return public


def _check_folder(folder: Path) -> None:
    """Whoever may write into the keys folder (or `clients/`) can admit a key of their own."""
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o022:
        raise InvalidInputError(f"keys folder {folder} is writable by group or others (mode {mode:04o}); "
                                f"run `chmod 700 {folder}`")


def ensure_keys(folder: Path) -> tuple[tuple[bytes, bytes], Path]:
    """The server's key pair, and the folder of admitted client keys (both written when missing,
    in 0700 folders; secret files 0600). A secret file or a folder others may use is refused."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    clients = folder / "clients"
    clients.mkdir(mode=0o700, exist_ok=True)
    for path in (folder, clients):
        _check_folder(path)
    if not (folder / SERVER_SECRET).is_file():
        _write_pair(folder, "server")
    if not (folder / CLIENT_SECRET).is_file():
        _write_key(clients / "client.key", 0o644, _write_pair(folder, "client"))
    for name in (SERVER_SECRET, CLIENT_SECRET):
        check_private(folder / name)
    server_public, server_secret = zmq.auth.load_certificate(str(folder / SERVER_SECRET))
    assert server_secret is not None
    return (server_public, server_secret), clients


class DrafterServer:
    """The socket loop around a `DrafterHost`."""

    def __init__(self, host: Any, bind: str, keys: Path, inject_rtt_ms: float = 0.0,
                 max_step_tokens: int = DEFAULT_STEP_TOKENS) -> None:
        self.host = host
        self.log = log.get("serve_drafter")
        self.rtt_s = inject_rtt_ms / 1e3
        (_, secret), clients = ensure_keys(keys)
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(f"{log.ROOT}.zap"))
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(clients))
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.max_frame_bytes = drafter_request_limit(host.target.hidden_size, max_step_tokens)
        """A larger frame drops its peer's connection before any of it is buffered (`wire.limits`)."""
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        self.sock.curve_server = True
        self.sock.curve_secretkey = secret
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.encoder = Encoder()
        self.decoder = Decoder(DrafterRequest)
        self.stop = threading.Event()
        self.num_requests = 0
        self.send_ms = 0.0
        """Encoding and sending the latest reply (it travels with the next one)."""
        self.totals: dict[str, float] = dict.fromkeys(TIMED, 0.0)
        """Per phase, ms summed over the steps served (`stats`)."""
        self.num_timed = 0

    def serve(self) -> None:
        self.log.info("drafter_serving", address=self.address, method=self.host.method, session=self.host.session,
                      max_frame_bytes=self.max_frame_bytes)
        try:
            while not self.stop.is_set():
                if not self.sock.poll(100):
                    continue
                frames = self.sock.recv_multipart(copy=False)
                arrived = time.perf_counter()
                ident, body = frames[0], frames[1:]
                reply = self.handle(body, arrived)
                sending = time.perf_counter()
                self.sock.send_multipart([ident, *self.encoder.encode(reply)], copy=False)
                self.send_ms = (time.perf_counter() - sending) * 1e3
        finally:
            self.close()

    def handle(self, body: list[Any], arrived: float) -> DrafterReply:
        try:
            msg = self.decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.log.warning("drafter_bad_frame", error=str(e))
            return Failed(-1, f"undecodable request: {e}")
        decoded = time.perf_counter()
        self.num_requests += 1
        held = self._hold(arrived, 0.5)
        try:
            reply = self._answer(msg)
        except InvalidInputError as e:
            reply = Failed(msg.call_id, str(e), invalid_input=True)
        except Exception as e:  # a fault in one request never ends the server
            self.log.exception("drafter_request_failed", request=type(msg).__name__)
            reply = Failed(msg.call_id, f"{type(e).__name__}: {e}")
        held += self._hold(arrived, 1.0)
        if isinstance(reply, Drafted | Done) and isinstance(msg, Ingest):
            timing = msgspec.structs.replace(self.host.timing, decode=(decoded - arrived) * 1e3, hold=held * 1e3,
                                             send=self.send_ms)
            self.num_timed += 1
            for name in TIMED:
                self.totals[name] += getattr(timing, name)
            reply = msgspec.structs.replace(reply, timing=timing)
        return reply

    def stats(self) -> dict[str, float]:
        """Requests served, and the mean ms per step of each phase."""
        n = max(self.num_timed, 1)
        return {"num_requests": self.num_requests, "num_steps": self.num_timed} | {
            f"mean_{name}_ms": total / n for name, total in self.totals.items()}

    def _hold(self, arrived: float, fraction: float) -> float:
        """Sleeps until `fraction` of the injected round trip has passed since arrival; the seconds slept."""
        if not self.rtt_s:
            return 0.0
        now = time.perf_counter()
        left = arrived + self.rtt_s * fraction - now
        if left <= 0:
            return 0.0
        time.sleep(left)
        return time.perf_counter() - now

    def _answer(self, msg: Any) -> DrafterReply:
        host = self.host
        match msg:
            case Hello():
                caps = host.hello(msg)
                return Described(msg.call_id, host.session, host.method, msgspec.to_builtins(caps), str(host.dtype))
            case Describe():
                caps = host.describe(msg)
                return Described(msg.call_id, host.session, host.method, msgspec.to_builtins(caps), str(host.dtype))
            case Propose() if msg.k > 0:
                drafts = host.step(msg)
                return Drafted(msg.call_id, [r.slot for r in msg.rows], [r.generation for r in msg.rows], drafts)
            case Ingest():
                host.step(msg)
                return Done(msg.call_id, host.session)
            case Free():
                host.free(msg)
                return Done(msg.call_id, host.session)
            case Ping():
                return Done(msg.call_id, host.session)
        return Failed(getattr(msg, "call_id", -1), f"unknown request {type(msg).__name__}")

    def close(self) -> None:
        self.log.info("drafter_stats", **self.stats())
        self.sock.close(0)
        self.auth.stop()
        self.ctx.term()


def main(args: argparse.Namespace) -> int:
    from ..engine.drafter import DrafterHost  # torch and the drafter load for this command alone

    if args.max_step_tokens < 1:
        raise InvalidInputError(f"--max-step-tokens: expected >= 1, got {args.max_step_tokens}")
    ensure_keys(args.keys)  # a key others may read is refused before the model loads
    host = DrafterHost(args.method, args.model, platform=args.platform, dtype=args.dtype,
                       draft_model=args.draft_model, options=parse_options(args.speculator_option),
                       graphs=not args.enforce_eager)
    server = DrafterServer(host, args.bind, args.keys, args.inject_rtt_ms, args.max_step_tokens)
    signal.signal(signal.SIGTERM, lambda *_: server.stop.set())
    print(f"serving {args.method} for {host.path.name} at {server.address}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        return 130
    return 0
