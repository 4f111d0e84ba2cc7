"""The `speckernel` command: generate, chat, plugins.

Bad input (invalid sampling parameters, a prompt too long, an unknown model or plugin) exits
with code 2 and a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from typing import Any

import anyio
import msgspec

from . import log
from .errors import InvalidInputError, SpeckernelError

EXIT_BAD_INPUT = 2


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF file or safetensors folder")
    p.add_argument("--platform", default=None, help="cpu, cuda, ascend (default: best available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: platform's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--in-process", action="store_true", help="run the engine core in this process")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--speculator", default=None, help="a speculator name (see `speckernel plugins`)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K, drafts per step")
    p.add_argument("--draft-model", default=None, help="checkpoint for draft_model (default: the target)")
    p.add_argument("--no-skip-drafts", action="store_true", help="never run K=0 steps (for comparison)")
    p.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE",
                   help="speculator-specific option, e.g. num_layers=8 for draft_model (repeatable)")
    p.add_argument("--adaptive-speculation", action="store_true",
                   help="turn drafting off for batch sizes where measured steps show it does not pay")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay captured device graphs (they are captured at start on CUDA)")


def sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speckernel", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"speckernel {version('speckernel')}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    engine_args(gen)
    sampling_args(gen, 256)
    chat = sub.add_parser("chat", help="interactive chat (empty line or Ctrl-D ends it)")
    chat.add_argument("--system", default=None, help="system prompt")
    engine_args(chat)
    sampling_args(chat, 512)
    plugins = sub.add_parser("plugins", help="list discovered speculators, platforms and transports")
    plugins.add_argument("--json", action="store_true")
    from .bench_cli import add_arguments
    from .train_drafter import add_arguments as add_train_arguments

    add_arguments(sub)
    add_train_arguments(sub)
    return parser


def config_from(args: argparse.Namespace) -> Any:
    from .config import EngineConfig

    return EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype,
                        max_model_len=args.max_model_len, in_process=args.in_process,
                        log_level=args.log_level, speculator=args.speculator,
                        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
                        skip_drafts=not args.no_skip_drafts, enforce_eager=args.enforce_eager,
                        adaptive_speculation=args.adaptive_speculation,
                        speculator_options=parse_options(args.speculator_option))


def parse_options(items: list[str]) -> dict[str, str]:
    from .errors import InvalidInputError

    bad = [item for item in items if "=" not in item]
    if bad:
        raise InvalidInputError(f"--speculator-option: expected KEY=VALUE, got {bad[0]!r}")
    return dict(item.split("=", 1) for item in items)


def params_from(args: argparse.Namespace) -> Any:
    from .sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop)).validate()


async def cmd_generate(args: argparse.Namespace) -> int:
    from .async_engine import AsyncEngine

    params = params_from(args)  # invalid parameters fail before the model loads
    started = time.monotonic()
    async with AsyncEngine(config_from(args)) as engine:
        loaded = time.monotonic()
        if args.raw:
            stream = engine.generate(args.prompt, params)
        else:
            stream = engine.chat([{"role": "user", "content": args.prompt}], params)
        out = None
        async for out in stream:
            if not args.json:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
        assert out is not None
        stats = await engine.stats()
    if not args.json:
        sys.stdout.write("\n")
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


async def cmd_chat(args: argparse.Namespace) -> int:
    from .async_engine import AsyncEngine

    params = params_from(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    async with AsyncEngine(config_from(args)) as engine:
        print("speckernel chat: an empty line or Ctrl-D ends it.", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = ""
            async for out in engine.chat(messages, params):
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                reply = out.text
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import describe

    found = describe()
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for kind, entries in found.items():
        print(f"{kind}:")
        for name, caps in entries.items():
            details = ", ".join(f"{k}={v}" for k, v in caps.items() if k != "entry_point")
            print(f"  {name:<16} {details}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.configure(getattr(args, "log_level", "warning"))
    try:
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "bench":
            from .bench import main as bench_main

            return bench_main(args)
        if args.command == "train-drafter":
            from .train_drafter import train

            train(args)
            return 0
        command = cmd_generate if args.command == "generate" else cmd_chat
        return anyio.run(command, args)
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
        return 130


if __name__ == "__main__":
    sys.exit(main())
