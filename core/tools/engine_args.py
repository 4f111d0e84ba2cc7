"""The engine and sampling flags every command shares (generate, chat, serve, bench), the parser
they hang on, and the checks of those flags that need no weights."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError

EXIT_BAD_INPUT = 2

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


def config_from(args: argparse.Namespace) -> Any:
    from ..config import EngineConfig

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
    from ..sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop)).validate()


def check_engine_args(args: argparse.Namespace) -> Path:
    """Everything about the engine flags that can be known without weights; the model's path."""
    from .. import registry
    from ..errors import PlatformUnavailableError, UnknownModelError, UnknownPluginError
    from ..models.builtin import BUILTIN_MODELS
    from ..models.checkpoint import resolve

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
        from ..engine.check import parse_options as parse_speculator_options

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
    from ..models.builtin import BUILTIN_MODELS

    known = BUILTIN_MODELS[args.model].context_length if args.model in BUILTIN_MODELS else None
    if known is None:
        from ..models.checkpoint import read_config

        known = read_config(path).max_position
    return min(args.max_model_len or min(known, CONTEXT_CAP), known)
