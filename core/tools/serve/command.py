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
from ..engine_args import config_from, engine_args, flag

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
    engine_args(p)


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

    # Unknown names and bad flags fail here with the CLI's one-line message (exit 2), not
    # inside uvicorn's start-up.
    checked = check(config(args), flag)
    # The server process owns its metrics: no `_created` sample per series (the library itself
    # leaves prometheus_client's process-wide switches alone for those who embed the app).
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
    app = build_app(checked.config, api_key=args.api_key)
    level = args.log_level.lower()
    uvicorn.run(app, host=args.host, port=args.port, log_level=level, access_log=level in ("debug", "info"),
                timeout_graceful_shutdown=5)
    return 0
