"""`speckernel serve-drafter`'s secrets and its socket's bounds: key secret files are written 0600
in 0700 folders whatever the umask; a secret key file that group or others may read is refused by
the server and by the engine's `remote` speculator, with the fix in one line; and a keyed peer
that sends a frame over the server's limit is disconnected before the frame is buffered, while
the server keeps serving a good client."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from speckernel.errors import InvalidInputError
from speckernel.tools.serve_drafter import ensure_keys
from speckernel.wire.codec import Decoder, Encoder
from speckernel.wire.drafter import Done, DrafterReply, Ping
from speckernel.wire.limits import DRAFTER_FRAME_FLOOR

OVERSIZE = 256 * 2**20


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The common umask 022, under which a plain open() writes 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_keys_are_written_private_whatever_the_umask(tmp_path: Path, loose_umask: None) -> None:
    keys = tmp_path / "made" / "keys"
    (_, secret), clients = ensure_keys(keys)
    assert mode(keys) == 0o700 and mode(clients) == 0o700
    assert mode(keys / "server.key_secret") == 0o600 and mode(keys / "client.key_secret") == 0o600
    assert not [p.name for p in keys.iterdir() if p.name.startswith(".")], "no temporary file is left"
    public, client_secret = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    assert client_secret and zmq.auth.load_certificate(str(clients / "client.key"))[0] == public
    assert zmq.auth.load_certificate(str(keys / "server.key_secret"))[1] == secret
    assert ensure_keys(keys)[0][1] == secret, "a second start keeps the keys"


@pytest.mark.parametrize("name", ["server.key_secret", "client.key_secret"])
def test_a_secret_key_others_may_read_is_refused_with_the_fix(tmp_path: Path, name: str) -> None:
    keys = tmp_path / "keys"
    ensure_keys(keys)
    (keys / name).chmod(0o644)
    with pytest.raises(InvalidInputError, match=re.escape(f"run `chmod 600 {keys / name}`")):
        ensure_keys(keys)
    (keys / name).chmod(0o600)
    ensure_keys(keys)


def test_a_keys_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    ensure_keys(keys)
    (keys / "clients").chmod(0o777)  # anyone could admit a key of their own
    with pytest.raises(InvalidInputError, match=re.escape(f"run `chmod 700 {keys / 'clients'}`")):
        ensure_keys(keys)


def test_the_engine_refuses_a_client_secret_others_may_read(tmp_path: Path) -> None:
    from speckernel.speculators.remote import curve_keys  # torch loads with the speculator

    keys = tmp_path / "keys"
    ensure_keys(keys)
    assert len(curve_keys(str(keys))) == 3
    (keys / "client.key_secret").chmod(0o640)
    with pytest.raises(InvalidInputError, match=r"open to group or others .*chmod 600"):
        curve_keys(str(keys))


def test_the_command_refuses_a_readable_secret_in_one_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    ensure_keys(keys)
    (keys / "server.key_secret").chmod(0o644)
    run = subprocess.run([sys.executable, "-m", "speckernel", "serve-drafter", "--method", "ngram", "--platform",
                          "cpu", "--bind", f"ipc://{tmp_path}/d.sock", "--keys", str(keys)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"speckernel: error: secret key {keys / 'server.key_secret'} is open to group or others (mode 0644); "
        f"run `chmod 600 {keys / 'server.key_secret'}`"]


# --- the frame bound ---------------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    """Bytes: the process's resident high-water mark."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def keyed(ctx: zmq.Context, keys: Path, address: str) -> zmq.Socket:
    """A DEALER holding the admitted client key (a peer the server lets in)."""
    server_key, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    public, secret = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, public, secret
    sock.connect(address)
    return sock


def ping(sock: zmq.Socket, call_id: int) -> DrafterReply:
    sock.send_multipart(Encoder().encode(Ping(call_id)))
    assert sock.poll(30_000), "no reply to a Ping"
    reply: DrafterReply = Decoder(DrafterReply).decode(sock.recv_multipart())
    return reply


def test_an_oversize_frame_drops_its_peer_unbuffered_and_the_server_serves_on(tmp_path: Path) -> None:
    keys, address = tmp_path / "keys", f"ipc://{tmp_path}/drafter.sock"
    proc = subprocess.Popen([sys.executable, "-m", "speckernel", "serve-drafter", "--method", "ngram",
                             "--platform", "cpu", "--bind", address, "--keys", str(keys), "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None and "serving ngram" in proc.stdout.readline()
        good = keyed(ctx, keys, address)
        assert isinstance(ping(good, 1), Done)
        before = peak_rss(proc.pid)

        bad = keyed(ctx, keys, address)
        events = bad.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        assert isinstance(ping(bad, 2), Done), "the peer is admitted: only its frame's size is wrong"
        bad.send(bytearray(OVERSIZE), copy=False)
        assert events.poll(60_000), "the peer that sent the oversize frame was not disconnected"
        assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        assert not bad.poll(500), "an oversize frame got an answer"

        assert isinstance(ping(good, 3), Done), "the server stopped serving its good client"
        time.sleep(0.2)
        grown = peak_rss(proc.pid) - before
        assert grown < DRAFTER_FRAME_FLOOR, f"the server's peak RSS grew by {grown} bytes"
        assert proc.poll() is None
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.wait(30)
