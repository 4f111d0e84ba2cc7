"""The `speckernel` command: generate, chat, plugins, serve, bench, train-drafter.

Bad input (invalid sampling parameters, a prompt too long, an unknown model or plugin) exits
with code 2 and a one-line message on stderr, and every check that needs no weights runs
before the model loads. Ctrl-C exits with code 130.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import msgspec

from speckernel import log
from speckernel.errors import InvalidInputError, SpeckernelError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
"""platform.DTYPES' names, listed here so a bad --dtype fails without importing torch."""
CONTEXT_CAP = 4096
"""Where max_model_len=None caps a model's context (engine_core.DEFAULT_MAX_MODEL_LEN)."""
HELP_WIDTH = 80


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help (unless the help says it in words), wrapped to at most
    80 columns."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        kwargs["width"] = min(shutil.get_terminal_size().columns, HELP_WIDTH) - 2
        super().__init__(prog, **kwargs)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (exit 2), like the rest of the CLI's bad input."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> Any:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF file or safetensors folder")
    p.add_argument("--platform", default=None, help="cpu, cuda, ascend (default: the best available)")
    p.add_argument("--dtype", default=None, choices=DTYPES, metavar="DTYPE",
                   help=f"one of {', '.join(DTYPES[:3])} (default: the platform's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"context length (default: the model's, at most {CONTEXT_CAP})")
    p.add_argument("--in-process", action="store_true", help="run the engine core in this process")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS, metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)}")
    p.add_argument("--speculator", default=None, help="a speculator name (see `speckernel plugins`)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="drafts per step (with --speculator)")
    p.add_argument("--draft-model", default=None, help="checkpoint for the speculator (default: its own default)")
    p.add_argument("--no-skip-drafts", action="store_true", help="never run K=0 steps (for comparison)")
    p.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE",
                   help="speculator-specific option, e.g. num_layers=8 for draft_model (repeatable)")
    p.add_argument("--adaptive-speculation", action="store_true",
                   help="turn drafting off for batch sizes where measured steps show it does not pay")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay captured device graphs (they are captured at start on CUDA)")


def sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.7, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens; 0: all")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass")
    p.add_argument("--seed", type=int, default=None, help="seed of this request (default: fresh randomness)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="speckernel", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"speckernel {version('speckernel')}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt; - reads it from stdin")
    source.add_argument("--prompt-file", type=Path, metavar="PATH", help="read the prompt from a UTF-8 file")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    engine_args(gen)
    sampling_args(gen, 256)
    chat = sub.add_parser("chat", help="interactive chat (empty line or Ctrl-D ends it)")
    chat.add_argument("--system", default=None, help="system prompt (default: the model's default)")
    engine_args(chat)
    sampling_args(chat, 512)
    plugins = sub.add_parser("plugins", help="list discovered speculators, platforms and transports")
    plugins.add_argument("--json", action="store_true", help="print one JSON object")
    from speckernel.tools.bench.args import add_arguments
    from speckernel.tools.train.drafter import add_arguments as add_train_arguments

    add_arguments(sub)
    from speckernel.tools.serve.command import add_arguments as add_serve_arguments

    add_serve_arguments(sub)
    add_train_arguments(sub)
    return parser


def config_from(args: argparse.Namespace) -> Any:
    from speckernel.config import EngineConfig

    return EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype,
                        max_model_len=args.max_model_len, in_process=args.in_process,
                        log_level=args.log_level, speculator=args.speculator,
                        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
                        skip_drafts=not args.no_skip_drafts, enforce_eager=args.enforce_eager,
                        adaptive_speculation=args.adaptive_speculation,
                        speculator_options=parse_options(args.speculator_option))


def parse_options(items: list[str]) -> dict[str, str]:
    bad = [item for item in items if "=" not in item]
    if bad:
        raise InvalidInputError(f"--speculator-option: expected KEY=VALUE, got {bad[0]!r}")
    return dict(item.split("=", 1) for item in items)


def params_from(args: argparse.Namespace) -> Any:
    from speckernel.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop)).validate()


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


def utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") \
            from None


def check_engine_args(args: argparse.Namespace) -> Path:
    """Everything about the engine flags that can be known without weights; the model's path."""
    from speckernel import registry
    from speckernel.errors import PlatformUnavailableError, UnknownModelError, UnknownPluginError
    from speckernel.models.builtin import BUILTIN_MODELS, resolve

    options = parse_options(args.speculator_option)
    speculators = sorted(registry.discover("speculator"))
    if args.speculator is None:
        for flag, given in (("--draft-model", args.draft_model), ("--speculator-option", options)):
            if given:
                raise InvalidInputError(f"{flag} is read by a speculator: add --speculator NAME "
                                        f"(available: {', '.join(speculators)})")
    elif args.speculator not in speculators:
        raise UnknownPluginError("speculator", args.speculator, speculators)
    if args.platform is not None:
        if args.platform not in registry.discover("platform"):
            raise UnknownPluginError("platform", args.platform, list(registry.discover("platform")))
        if not registry.load("platform", args.platform).is_available():
            raise PlatformUnavailableError(f"platform {args.platform!r} is installed but not available here")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise InvalidInputError(f"--max-model-len: expected >= 2, got {args.max_model_len}")
    draft = args.draft_model
    if draft is not None and draft not in BUILTIN_MODELS and not draft.startswith("random:") \
            and not Path(draft).expanduser().exists():
        raise UnknownModelError(f"--draft-model {draft}: no such file or folder")
    if args.speculator is not None:
        from speckernel.engine.check import parse_options as parse_speculator_options

        cls = registry.load("speculator", args.speculator)
        k, max_k = args.num_speculative_tokens, cls.capabilities.max_k
        if not 1 <= k <= max_k:
            raise InvalidInputError(f"--num-speculative-tokens: speculator {args.speculator!r} drafts 1 to "
                                    f"{max_k} tokens per step; got {k}")
        parse_speculator_options(args.speculator, cls.Options, options)
    return resolve(args.model)


def context_limit(args: argparse.Namespace, path: Path) -> int:
    """The longest context the engine can give this model, as known before it loads (the KV
    cache's size may lower it further; the engine checks that)."""
    from speckernel.models.builtin import BUILTIN_MODELS

    known = BUILTIN_MODELS[args.model].context_length if args.model in BUILTIN_MODELS else None
    if known is None:
        from speckernel.models.loader import read_config

        known = read_config(path).max_position
    return min(args.max_model_len or min(known, CONTEXT_CAP), known)


def check_prompt_fits(text: str, messages: list[dict[str, str]] | None, path: Path, limit: int) -> None:
    """A prompt that cannot fit fails now. Each token spells at least one byte, and a template
    adds fewer than MARGIN tokens, so only a prompt near the limit is tokenized here."""
    margin = 512
    if len(text.encode()) + margin < limit:
        return
    from speckernel.errors import PromptTooLongError
    from speckernel.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(path)
    if messages is not None:
        n = len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                 add_special_tokens=False))
    else:
        n = len(tokenizer.encode(text))
    if n >= limit:
        raise PromptTooLongError(f"prompt has {n} tokens; the context holds {limit} "
                                 "(prompt plus at least one generated token)")


# --- commands -------------------------------------------------------------------------------


async def cmd_generate(args: argparse.Namespace) -> int:
    from speckernel.frontend.async_engine import AsyncEngine

    started = time.monotonic()
    async with AsyncEngine(config_from(args)) as engine:
        loaded = time.monotonic()
        if args.raw:
            stream = engine.generate(args.prompt_text, args.params)
        else:
            stream = engine.chat([{"role": "user", "content": args.prompt_text}], args.params)
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


class StdinLines:
    """Lines typed at the chat prompt, read in the event loop (no thread): Ctrl-C at an idle
    prompt ends the process at once, where a thread blocked in input() would hold its exit."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.pending = b""
        self.eof = False
        self.regular_file = stat.S_ISREG(os.fstat(self.fd).st_mode)  # never "not ready": no wait

    async def read(self, prompt: str) -> bytes | None:
        """The next line without its newline, None at the end of input."""
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self.pending and not self.eof:
            if not self.regular_file:
                await anyio.wait_readable(self.fd)
            chunk = os.read(self.fd, 1 << 16)
            self.eof = not chunk
            self.pending += chunk
        if not self.pending:
            return None
        line, _, self.pending = self.pending.partition(b"\n")
        return line.rstrip(b"\r")


def fit_history(messages: list[dict[str, str]], count: Any, limit: int) -> int:
    """Drops the oldest turns (a system prompt stays) until count(messages) < limit; the number
    of messages dropped. The newest message always stays: if it alone is too long, the caller's
    count check raises."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while len(messages) - first > 1 and count(messages) >= limit:
        del messages[first]
        dropped += 1
        while len(messages) - first > 1 and messages[first]["role"] != "user":
            del messages[first]  # a turn starts with the user's message
            dropped += 1
    return dropped


async def cmd_chat(args: argparse.Namespace) -> int:
    from speckernel.errors import PromptTooLongError
    from speckernel.frontend.async_engine import AsyncEngine

    params = args.params
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    async with AsyncEngine(config_from(args)) as engine:
        # Room kept for the reply: the history is trimmed to leave it.
        reserve = max(1, min(params.max_tokens, engine.info.max_model_len // 4))
        limit = engine.info.max_model_len - reserve

        def count(history: list[dict[str, str]]) -> int:
            return len(engine.encode_chat(history))

        print("speckernel chat: an empty line or Ctrl-D ends it.", file=sys.stderr)
        stdin = StdinLines()
        while True:
            data = await stdin.read("> ")
            if data is None or not data.strip():
                break
            try:
                line = utf8(data, "the message")
            except InvalidInputError as e:
                print(f"speckernel: error: {e}", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            dropped = fit_history(messages, count, limit)
            if dropped:
                print(f"speckernel chat: dropped the {dropped} oldest message(s) to fit the "
                      f"{engine.info.max_model_len}-token context", file=sys.stderr)
            reply = ""
            try:
                async for out in engine.chat(messages, params):
                    sys.stdout.write(out.delta_text)
                    sys.stdout.flush()
                    reply = out.text
            except PromptTooLongError as e:
                messages.pop()
                print(f"speckernel: error: this message alone is too long: {e}", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from speckernel.registry import describe

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


def run_engine_command(args: argparse.Namespace) -> int:
    """generate / chat: the weight-free checks, then the engine."""
    args.params = params_from(args)
    if args.command == "generate":
        args.prompt_text = read_prompt(args)
    path = check_engine_args(args)
    if args.command == "generate":
        messages = None if args.raw else [{"role": "user", "content": args.prompt_text}]
        check_prompt_fits(args.prompt_text, messages, path, context_limit(args, path))
        return anyio.run(cmd_generate, args)
    return anyio.run(cmd_chat, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.configure(getattr(args, "log_level", "warning"))
    try:
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "bench":
            from speckernel.tools.bench.command import main as bench_main

            return bench_main(args)
        if args.command == "serve":
            from speckernel.tools.serve.command import main as serve_main

            return serve_main(args)
        if args.command == "train-drafter":
            from speckernel.tools.train.drafter import train

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
