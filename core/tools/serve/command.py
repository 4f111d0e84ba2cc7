"""`speckernel serve`: the OpenAI-compatible HTTP server (serve_app.py) under uvicorn.

Flags are defined here without importing the app, so the CLI starts without loading it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import msgspec

from ...config import EngineConfig
from ...engine.check import check
from ...errors import InvalidInputError
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


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}, else none)")
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

    from .app import build_app
    from .connections import guarded_h11

    # Unknown names and bad flags fail here with the CLI's one-line message (exit 2), not
    # inside uvicorn's start-up.
    checked = check(config(args), flag)
    bounds = limits(args)
    policy = restart_policy(args)
    # The server process owns its metrics: no `_created` sample per series (the library itself
    # leaves prometheus_client's process-wide switches alone for those who embed the app).
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    given_up: list[str] = []
    server: uvicorn.Server | None = None

    def give_up(reason: str) -> None:
        given_up.append(reason)
        if server is not None:
            server.should_exit = True

    app = build_app(checked.config, api_key=args.api_key, limits=bounds, restarts=policy, on_give_up=give_up)
    level = args.log_level.lower()
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=level, access_log=level in ("debug", "info"),
        timeout_graceful_shutdown=5, timeout_keep_alive=bounds.keep_alive_s, http=guarded_h11(bounds.header_timeout_s)))
    server.run()
    if given_up:
        print(f"speckernel: error: {given_up[0]}", file=sys.stderr)
        return EXIT_CORE_LOST
    return 0
