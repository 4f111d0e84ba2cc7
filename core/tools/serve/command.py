"""`speckernel serve`: the OpenAI-compatible HTTP server (serve_app.py) under uvicorn.

Flags are defined here without importing the app, so the CLI starts without loading it.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec

from ...config import EngineConfig
from ...engine.check import check
from ...errors import InvalidInputError, SpeckernelError
from ..engine_args import config_from, engine_args, flag
from .limits import ServeLimits
from .supervisor import RestartPolicy

LIMIT_FLAGS = {  # flag -> (ServeLimits field, type, what it bounds)
    "--max-body-bytes": ("max_body_bytes", int, "most bytes in a request body (413 beyond)"),
    "--max-prompt-chars": ("max_prompt_chars", int, "most characters in a prompt or a conversation (400 beyond)"),
    "--max-prompt-tokens": ("max_prompt_tokens", int, "most prompt tokens, None: the context (400 beyond)"),
    "--max-stop": ("max_stop", int, "most stop strings per request (400 beyond)"),
    "--max-stop-chars": ("max_stop_chars", int, "most characters in one stop string (400 beyond)"),
    "--max-queue": ("max_queue", int, "most generation requests in the server at once (429 beyond)"),
    "--max-queue-wait": ("max_queue_wait_s", float, "most seconds a request may wait for its first token (then 429)"),
    "--body-timeout": ("body_timeout_s", float, "most seconds a request body may take to arrive (then 408)"),
    "--header-timeout": ("header_timeout_s", float,
                         "most seconds a connection may take to send a request head (then closed)"),
    "--keep-alive": ("keep_alive_s", int, "seconds an idle keep-alive connection stays open"),
}

API_KEY_ENV = "SPECKERNEL_API_KEY"
EXIT_CORE_LOST = 1
"""serve's exit code once its engine core died and was not (or could not be) replaced."""
EXIT_INTERRUPTED = 130
"""serve's exit code after Ctrl-C (SIGINT), as every other command; SIGTERM is a clean stop (0)."""
ACCESS_LOGGER = "speckernel.serve.access"


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 0: any free one (the ready line says which)")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                   help=f"require `Authorization: Bearer KEY` on /v1/* and /metrics, KEY read from this file "
                        f"(default: ${API_KEY_ENV}, else none)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the key itself: visible to every user in `ps`, so a warning says to use ${API_KEY_ENV} "
                        "or --api-key-file instead")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (default: /metrics needs it when one is set)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no line per request (method, path, status, duration) on stderr")
    p.add_argument("--ignore-unknown-fields", action="store_true",
                   help="ignore request keys the server does not know (default: refused with 400 naming the key); "
                        "known fields it does not serve, such as logit_bias or tools, stay refused")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded at once (default: 64)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks (default: sized from the platform's free memory)")
    defaults = ServeLimits()
    for name, (field, kind, text) in LIMIT_FLAGS.items():
        p.add_argument(name, type=kind, default=None, metavar="N",
                       help=f"{text} (default: {getattr(defaults, field)})")
    p.add_argument("--max-restarts", type=int, default=RestartPolicy().max_restarts, metavar="N",
                   help="engine cores replaced within 10 minutes after their core died; one more death and "
                        "serve exits with code 1 (0: exit at the first) (default: %(default)s)")
    p.add_argument("--restart-backoff", type=float, default=RestartPolicy().backoff_s, metavar="S",
                   help="seconds before the first restart, doubled for each further one within the window "
                        "(default: %(default)s)")
    engine_args(p)


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: expected a number in [0, 65535]") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value}: expected a number in [0, 65535]")
    return value


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, else --api-key (with a warning: a command line is readable by
    every user), else $SPECKERNEL_API_KEY; None: no key required."""
    if args.api_key is not None and args.api_key_file is not None:
        raise InvalidInputError("--api-key and --api-key-file: give one of them")
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"--api-key-file {args.api_key_file}: {getattr(e, 'strerror', None) or e}") \
                from None
        if not key:
            raise InvalidInputError(f"--api-key-file {args.api_key_file}: the file is empty")
        return key
    if args.api_key is not None:
        print(f"speckernel: warning: --api-key shows the key to every user of this host (ps, /proc); set "
              f"${API_KEY_ENV} or use --api-key-file", file=sys.stderr)
        if not args.api_key:
            raise InvalidInputError("--api-key: the key is empty")
        return str(args.api_key)
    return os.environ.get(API_KEY_ENV) or None


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (uvicorn listens on it once the engine is
    up): a port in use, or an address this host does not have, fails in one line at once, not
    after a minute of loading with a traceback."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise InvalidInputError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT does not block
        sock.bind(address)  # not listening yet: until the engine is up, connections are refused
    except OSError as e:
        sock.close()
        raise SpeckernelError(f"cannot listen on {host}:{port}: {e.strerror or e}"
                              + (" (another process has it; pick another --port)"
                                 if e.errno == errno.EADDRINUSE else "")) from None
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, bound = sock.getsockname()[:2]
    return f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    try:
        return msgspec.convert({"max_restarts": args.max_restarts, "backoff_s": args.restart_backoff}, RestartPolicy)
    except msgspec.ValidationError as e:
        name = "--max-restarts" if "max_restarts" in str(e) else "--restart-backoff"
        raise InvalidInputError(f"{name}: {str(e).partition(' - at')[0].lower()}") from None


def limits(args: argparse.Namespace) -> ServeLimits:
    """The bounds the flags spell; a bad value is the CLI's one-line error."""
    given = {field: getattr(args, name[2:].replace("-", "_")) for name, (field, _, _) in LIMIT_FLAGS.items()}
    try:
        return msgspec.convert({k: v for k, v in given.items() if v is not None}, ServeLimits)
    except msgspec.ValidationError as e:
        field = str(e).rpartition("$.")[2].rstrip("`")
        name = next((n for n, (f, _, _) in LIMIT_FLAGS.items() if f == field), field)
        raise InvalidInputError(f"{name}: {str(e).partition(' - at')[0].lower()}") from None


def config(args: argparse.Namespace) -> EngineConfig:
    """The engine config the flags spell, unchecked (main checks it)."""
    cfg = config_from(args)
    if args.max_num_seqs is not None:
        cfg = msgspec.structs.replace(cfg, max_num_seqs=args.max_num_seqs)
    if args.num_kv_blocks is not None:
        cfg = msgspec.structs.replace(cfg, num_kv_blocks=args.num_kv_blocks)
    return cfg


def main(args: argparse.Namespace) -> int:
    # The server stack (uvicorn, starlette, the app) loads only for `serve`, not for every command.
    import uvicorn

    from .app import Server
    from .connections import guarded_h11
    from .lifecycle import ServeServer

    # Unknown names and bad flags fail here with the CLI's one-line message (exit 2), not
    # inside uvicorn's start-up; so does a port that is taken (exit 1), before the model loads.
    checked = check(config(args), flag)
    bounds = limits(args)
    policy = restart_policy(args)
    key = api_key(args)
    sock = listen(args.host, args.port)
    # The server process owns its metrics: no `_created` sample per series (the library itself
    # leaves prometheus_client's process-wide switches alone for those who embed the app).
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    given_up: list[str] = []
    server: ServeServer | None = None

    def give_up(reason: str) -> None:
        given_up.append(reason)
        if server is not None:
            server.should_exit = True

    level = args.log_level.lower()
    if level in ("debug", "info", "warning"):  # the ready, shutdown and access lines show by default
        logging.getLogger("speckernel.serve").setLevel(min(logging.INFO, logging.getLevelName(level.upper())))
    logging.getLogger(ACCESS_LOGGER).disabled = not args.access_log
    served = Server(checked.config, api_key=key, limits=bounds, restarts=policy, on_give_up=give_up,
                    ignore_unknown_fields=args.ignore_unknown_fields)
    served.public_metrics = args.public_metrics
    server = ServeServer(served, url_of(sock), uvicorn.Config(
        served.app(), log_level=level, access_log=False, timeout_graceful_shutdown=5,
        timeout_keep_alive=bounds.keep_alive_s, http=guarded_h11(bounds.header_timeout_s)))
    with sock:
        server.run(sockets=[sock])
    if given_up:
        print(f"speckernel: error: {given_up[0]}", file=sys.stderr)
        return EXIT_CORE_LOST
    return EXIT_INTERRUPTED if signal.SIGINT in server.signals else 0
