"""`speckernel serve`: the OpenAI-compatible HTTP server (serve_app.py) under uvicorn.

Flags are defined here without importing the app, so the CLI starts without loading it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import msgspec

from ...config import EngineConfig
from ...engine.check import check
from ...errors import InvalidInputError
from ..engine_args import config_from, engine_args, flag
from .limits import ServeLimits

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
    engine_args(p)


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
    # The server process owns its metrics: no `_created` sample per series (the library itself
    # leaves prometheus_client's process-wide switches alone for those who embed the app).
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    app = build_app(checked.config, api_key=args.api_key, limits=bounds)
    level = args.log_level.lower()
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, access_log=level in ("debug", "info"),
                timeout_graceful_shutdown=5, timeout_keep_alive=bounds.keep_alive_s,
                http=guarded_h11(bounds.header_timeout_s))
    return 0
