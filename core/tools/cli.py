"""The `speckernel` command: generate, chat, plugins, serve, serve-drafter, bench, train-drafter.

Bad input (invalid sampling parameters, a prompt too long, an unknown model or plugin) exits
with code 2 and a one-line message on stderr, and every check that needs no weights runs
before the model loads. Ctrl-C exits with code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import textwrap
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import msgspec

from .. import log
from ..engine.check import check
from ..errors import InvalidInputError, InvalidSamplingParamsError, PromptTooLongError, SpeckernelError
from ..frontend.async_engine import AsyncEngine
from ..models.builtin import BUILTIN_MODELS, DEFAULT_MODEL, cached
from ..models.checkpoint import load_tokenizer, read_config, resolve
from ..outputs import RequestOutput
from ..progress import loading_what, waiting
from ..registry import describe
from .bench.args import add_arguments as add_bench_arguments
from .bench.command import main as bench_main
from .engine_args import (
    EXIT_BAD_INPUT,
    Parser,
    config_from,
    engine_args,
    flag,
    params_from,
    sampling_args,
    structured_args,
    structured_error,
    utf8,
)
from .serve.command import add_arguments as add_serve_arguments
from .serve.command import main as serve_main
from .serve_drafter import add_arguments as add_serve_drafter_arguments
from .serve_drafter import main as serve_drafter_main
from .train.args import add_arguments as add_train_arguments

EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="speckernel", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"speckernel {version('speckernel')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt; - reads it from stdin")
    source.add_argument("--prompt-file", type=Path, metavar="PATH", help="read the prompt from a UTF-8 file")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument("--quiet", action="store_true",
                     help="no summary line (tokens, tok/s, acceptance) on stderr, no load progress")
    engine_args(gen)
    sampling_args(gen, 256)
    structured_args(gen)
    chat_parser = sub.add_parser("chat", help="interactive chat: line editing, Ctrl-C stops a reply, /help lists "
                                              "the commands (an empty line or Ctrl-D ends it)")
    chat_parser.add_argument("--system", default=None, help="system prompt (default: the model's default)")
    engine_args(chat_parser)
    sampling_args(chat_parser, 512)
    plugins = sub.add_parser("plugins", help="list discovered speculators, platforms and transports")
    plugins.add_argument("--json", action="store_true", help="print one JSON object")
    add_bench_arguments(sub)
    add_serve_arguments(sub)
    add_serve_drafter_arguments(sub)
    add_train_arguments(sub)
    return parser


# --- checks that need no weights ------------------------------------------------------------


def read_prompt(args: argparse.Namespace) -> str:
    """--prompt, --prompt - (stdin) or --prompt-file, checked to be non-empty UTF-8."""
    if args.prompt_file is not None:
        try:
            data = args.prompt_file.read_bytes()
        except OSError as e:
            raise InvalidInputError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None
        text = utf8(data, f"--prompt-file {args.prompt_file}").removesuffix("\n")  # a file's last newline
    elif args.prompt == "-":
        text = utf8(sys.stdin.buffer.read(), "the prompt on stdin").removesuffix("\n")  # `echo` adds one
    else:  # argv arrives with undecodable bytes as surrogates
        text = utf8(args.prompt.encode("utf-8", "surrogateescape"), "--prompt")
    if not text.strip():
        raise InvalidInputError("the prompt is empty")
    return text


def check_prompt_fits(text: str, messages: list[dict[str, str]] | None, path: Path, limit: int,
                      allow_special_tokens: bool = False) -> None:
    """A prompt that cannot fit fails now. Each token spells at least one byte, and a template
    adds fewer than MARGIN tokens, so only a prompt near the limit is tokenized here."""
    margin = 512
    if len(text.encode()) + margin < limit:
        return
    tokenizer = load_tokenizer(path)
    if messages is not None:
        n = len(tokenizer.encode_chat(messages, allow_special_tokens=allow_special_tokens))
    else:
        n = len(tokenizer.encode(text))
    if n >= limit:
        raise PromptTooLongError(f"prompt has {n} tokens; the context holds {limit} "
                                 "(prompt plus at least one generated token)")


# --- commands -------------------------------------------------------------------------------


def summary(out: RequestOutput, load_s: float) -> str:
    """generate's one line on stderr: tokens, speed, time to the first token, acceptance."""
    n = len(out.token_ids)
    timing = out.timing
    parts = [f"{n} token{'s' if n != 1 else ''}"]
    if timing is not None and timing.first_token is not None and timing.finished is not None:
        decode_s = timing.finished - timing.first_token
        if n > 1 and decode_s > 0:
            parts.append(f"{(n - 1) / decode_s:.1f} tok/s")
        parts.append(f"first token {timing.first_token - timing.arrival:.2f}s")
    parts.append(f"load {load_s:.1f}s")
    stats = out.stats or {}
    if stats.get("num_draft_tokens"):
        parts.append(f"acceptance {stats['num_accepted_tokens'] / stats['num_draft_tokens']:.0%} "
                     f"({stats['num_accepted_tokens']}/{stats['num_draft_tokens']} drafts)")
    return f"speckernel: {', '.join(parts)} ({out.finish_reason})"


async def cmd_generate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        with waiting(loading_what(args.config)) if not args.quiet else contextlib.nullcontext():
            engine = await stack.enter_async_context(AsyncEngine(args.config))
        loaded = time.monotonic()
        if args.raw:
            stream = engine.generate(args.prompt_text, args.params)
        else:
            stream = engine.chat([{"role": "user", "content": args.prompt_text}], args.params)
        out = None
        try:
            async for out in stream:
                if not args.json:
                    sys.stdout.write(out.delta_text)
                    sys.stdout.flush()
        except InvalidSamplingParamsError as e:  # a constraint the core's compiler refused (with a tokenizer)
            raise structured_error(args, e) from None
        assert out is not None
        stats = await engine.stats()
    if not args.json:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if not args.quiet:
        print(summary(out, loaded - started), file=sys.stderr)
    if not args.json:
        return 0
    timing = out.timing
    assert timing is not None
    decode_s = (timing.finished or 0) - (timing.first_token or 0)
    print(json.dumps({
        "text": out.text,
        "token_ids": out.token_ids,
        "prompt_token_ids": out.prompt_token_ids,
        "finish_reason": out.finish_reason,
        "timing": {
            "load_s": loaded - started,
            "ttft_s": timing.ttft_s,
            "total_s": timing.total_s,
            "decode_tokens_per_s": (len(out.token_ids) - 1) / decode_s if decode_s > 0 else None,
        },
        "stats": {**(out.stats or {}), "engine": stats["spec"], "num_preemptions": stats["num_preemptions"]},
        "engine": {"platform": engine.info.platform, "dtype": engine.info.dtype,
                   "max_model_len": engine.info.max_model_len},
    }))
    return 0


def for_default_model(found: dict[str, dict[str, Any]]) -> None:
    """Speculators whose declarations depend on the target (the hidden layers a learned drafter
    reads) described for the default model, when it is on disk: listing plugins fetches nothing."""
    if not cached(BUILTIN_MODELS[DEFAULT_MODEL]):
        return
    # torch and the speculator classes: only here, where the capabilities for a target are computed.
    import torch

    from .. import registry
    from ..plugin import SpeculatorContext

    path = resolve(DEFAULT_MODEL)
    for name, entry in found.get("speculators", {}).items():
        try:
            cls = registry.load("speculator", name)
            if not hasattr(cls, "capabilities_for") or not hasattr(cls, "Options"):
                continue
            options = cls.Options()
            ctx = SpeculatorContext(target=read_config(path), target_path=path, device=torch.device("cpu"),
                                    dtype=torch.float32, block_size=16, max_model_len=2048, num_speculative_tokens=1,
                                    options=options)
            entry.update(msgspec.to_builtins(cls.capabilities_for(ctx)))
        except Exception:
            continue


def cmd_plugins(args: argparse.Namespace) -> int:
    found = describe()
    for_default_model(found)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    width = max(shutil.get_terminal_size().columns, 60)
    indent = " " * 19
    for kind, entries in found.items():
        print(f"{kind}:")
        for name, caps in entries.items():
            about = caps.get("description") or caps.get("error", "")
            print(f"  {name:<16} " + textwrap.shorten(about, max(width - 1 - len(indent), 20), placeholder="…"))
            details = ", ".join(f"{k}={v}" for k, v in caps.items() if k not in ("entry_point", "description"))
            print(textwrap.fill(details, width - 1, initial_indent=indent, subsequent_indent=indent,
                                break_on_hyphens=False))
    return 0


def run_engine_command(args: argparse.Namespace) -> int:
    """generate / chat: the weight-free checks, then the engine."""
    args.params = params_from(args)
    if args.command == "generate":
        args.prompt_text = read_prompt(args)
    checked = check(config_from(args), flag)
    args.config = checked.config
    if args.command == "generate":
        messages = None if args.raw else [{"role": "user", "content": args.prompt_text}]
        check_prompt_fits(args.prompt_text, messages, checked.path, checked.max_model_len,
                          checked.config.allow_special_tokens)
        return anyio.run(cmd_generate, args)
    from . import chat  # prompt_toolkit loads for `chat` alone

    return anyio.run(chat.run, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.configure(getattr(args, "log_level", "warning"))
    try:
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "bench":
            return bench_main(args)
        if args.command == "serve":
            return serve_main(args)
        if args.command == "serve-drafter":
            return serve_drafter_main(args)
        if args.command == "train-drafter":
            from .train.drafter import train  # training loads torch; every other command starts without it

            train(args)
            return 0
        return run_engine_command(args)
    except InvalidInputError as e:
        print(f"speckernel: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (msgspec.ValidationError, ValueError) as e:
        print(f"speckernel: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SpeckernelError as e:
        print(f"speckernel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
