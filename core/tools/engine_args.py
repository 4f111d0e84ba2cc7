"""The engine and sampling flags every command shares (generate, chat, serve, bench), the parser
they hang on, and the configs they spell (checked by `engine.check.check`, which names fields
by their flags through `flag`)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..config import CONTEXT_CAP, DTYPE_NAMES, EngineConfig
from ..errors import InvalidInputError, InvalidSamplingParamsError
from ..sampling_params import SamplingParams, StructuredOutput

EXIT_BAD_INPUT = 2

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
FLAGS = {"speculator_options": "--speculator-option"}
"""Fields whose flag is not `--` plus the field's name with dashes."""
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
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES, metavar="DTYPE",
                   help=f"one of {', '.join(DTYPE_NAMES[:3])} (default: the platform's)")
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
    p.add_argument("--no-grammar-drafts", action="store_true",
                   help="structured output: do not verify the tokens a grammar forces as drafts (for comparison)")
    p.add_argument("--no-grammar-graphs", action="store_true",
                   help="structured output: run steps with a grammar eagerly instead of capturing graphs for them")
    p.add_argument("--late-masks", action="store_const", const=True, default=None,
                   help="structured output: a constrained row runs ahead of its frame in flight, its step's sampling "
                        "waiting on the device for the mask the host computes while the forward runs (default: on "
                        "where the device runs apart from the host, off on the CPU)")
    p.add_argument("--no-late-masks", dest="late_masks", action="store_const", const=False,
                   help="structured output: a constrained row waits for its frame in flight before its next step")
    p.add_argument("--no-launch-on-loop", action="store_true",
                   help="launch steps on a runner thread even where launches never wait for the device")
    p.add_argument("--no-sampling-graphs", action="store_true",
                   help="run steps with penalties or logprobs eagerly instead of capturing graphs for them")
    p.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE",
                   help="speculator-specific option, e.g. num_layers=8 for draft_model (repeatable)")
    p.add_argument("--adaptive-speculation", action="store_const", const=True, default=None,
                   help="turn drafting off for batch sizes where measured steps show it does not pay "
                        "(default: where step graphs are timed at start)")
    p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_const", const=False,
                   help="always draft (no governor)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                   help="split the target's layers over N stage processes (they meet through an env:// rendezvous)")
    p.add_argument("--pipeline-transport", default=None, metavar="NAME",
                   help="transport of the links between pipeline stages (an installed transport plugin's "
                        "name; default: the first installed of the platform's preferred ones)")
    p.add_argument("--pipeline-host", default="127.0.0.1", metavar="ADDRESS",
                   help="address the pipeline stages and the engine core meet on")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine-core ranks behind one frontend, requests balanced by load")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay captured device graphs (they are captured at start on CUDA)")
    p.add_argument("--no-prompts-apart", action="store_true",
                   help="let prompts share decode steps where graphs are captured (those steps then run eagerly)")
    p.add_argument("--prompt-steps-per-decode", type=int, default=4, metavar="N",
                   help="with prompts apart, prompt steps that may run between two decode steps while several "
                        "prompts wait (default: 4; 1 alternates)")
    p.add_argument("--no-prompt-batches", action="store_true",
                   help="with prompts apart, capture no graphs of several-prompt steps: a burst of prompts "
                        "takes one step each")
    p.add_argument("--batch-invariant", action="store_true",
                   help="kernels whose results for a token do not depend on the rest of the batch: "
                        "speculative greedy output equals plain greedy output token for token, in bf16 too")
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="let chat message content spell control tokens such as <|im_end|> (trusted "
                        "callers only; by default such text is encoded as text)")


def sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.7, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens; 0: all")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass")
    p.add_argument("--seed", type=int, default=None, help="seed of this request (default: fresh randomness)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the prompt or output by this (1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this per occurrence in the output from a token's logit, in [-2, 2]")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token in the output, in [-2, 2]")


def structured_args(p: argparse.ArgumentParser) -> None:
    """The constraint generate's output must match (one at most, checked by `structured_from`: a
    mutually exclusive group's usage line would not fit 80 columns)."""
    group = p.add_argument_group("structured output (one at most)")
    group.add_argument("--json-schema", type=Path, metavar="FILE", help="output is JSON matching this JSON schema")
    group.add_argument("--json-object", action="store_true", help="output is a JSON object")
    group.add_argument("--regex", metavar="R", help="output matches this regular expression")
    group.add_argument("--grammar", type=Path, metavar="FILE",
                       help="output matches this Lark grammar (EBNF rules, /regex/ terminals)")
    group.add_argument("--choice", nargs="+", metavar="TEXT", help="output is exactly one of these strings")


STRUCTURED_FLAGS = {"json_schema": "--json-schema", "json_object": "--json-object", "regex": "--regex",
                    "grammar": "--grammar", "choice": "--choice"}


def structured_from(args: argparse.Namespace) -> StructuredOutput | None:
    """The constraint the flags give, compiled once here (no tokenizer needed) so that a bad one
    fails in one line that names its flag, before the model loads."""
    given = [flag for dest, flag in STRUCTURED_FLAGS.items() if getattr(args, dest, None) not in (None, False, [])]
    if len(given) > 1:
        raise InvalidInputError(f"{' and '.join(given)}: give one structured-output constraint at most")
    if getattr(args, "json_schema", None) is not None:
        schema = read_text(args.json_schema, "--json-schema")
        try:
            json.loads(schema)
        except ValueError as e:
            raise InvalidInputError(f"--json-schema {args.json_schema}: not valid JSON ({e})") from None
        structured = StructuredOutput(json_schema=schema)
    elif getattr(args, "grammar", None) is not None:
        structured = StructuredOutput(grammar=read_text(args.grammar, "--grammar"))
    elif getattr(args, "json_object", False):
        structured = StructuredOutput(json_object=True)
    elif getattr(args, "regex", None) is not None:
        structured = StructuredOutput(regex=args.regex)
    elif getattr(args, "choice", None):
        structured = StructuredOutput(choice=tuple(args.choice))
    else:
        return None
    try:
        return structured.check()
    except InvalidSamplingParamsError as e:
        raise structured_error(args, e) from None


STRUCTURED_WHAT = {"json_schema": "invalid JSON schema", "regex": "invalid regular expression",
                   "grammar": "invalid grammar"}
"""What a constraint that does not compile is called, by kind."""
WHERE = re.compile(r"(?:at )?(\d+)\((\d+)\): ")
"""llguidance's position in a grammar's text: "at LINE(COLUMN): "."""
REGEX_INDENT = "    "
"""The regex crate's indent of the pattern and the carets under it, in its parse errors."""


def structured_error(args: argparse.Namespace, error: InvalidSamplingParamsError) -> InvalidInputError:
    """A constraint the compiler refused, said in one line that names the flag (and file): the
    compiler's message spans lines (the source again, carets under the fault), which the rest of
    the command line's errors never do. For the frontend's check and for a refusal by the core."""
    kind, _, message = str(error).partition(": ")
    kind = kind.removeprefix("structured.")
    if kind not in STRUCTURED_FLAGS:  # not a compiler message about a constraint: said as it came
        return InvalidInputError(" ".join(str(error).split()))
    name = STRUCTURED_FLAGS[kind]
    if kind in ("json_schema", "grammar"):
        name += f" {getattr(args, kind)}"
    lines = message.strip().splitlines() or [""]
    reasons = [line.removeprefix("error: ").strip() for line in lines[1:] if line.startswith("error: ")]
    if kind == "regex" and reasons:
        pattern = getattr(args, "regex", None) or ""
        at = ""
        if len(lines) > 2 and lines[1] == REGEX_INDENT + pattern and "^" in lines[2]:
            at = f" (at character {lines[2].index('^') - len(REGEX_INDENT) + 1})"
        return InvalidInputError(f"{name}: {STRUCTURED_WHAT[kind]} {pattern!r}: {'; '.join(reasons)}{at}")
    head = lines[0]
    where = WHERE.match(head)
    if where is not None:  # a place in the grammar a --regex or a schema was turned into says nothing
        head = head[where.end():] if kind != "grammar" else f"line {where[1]}, column {where[2]}: {head[where.end():]}"
    head = head.replace(" (in regex)", "").removesuffix(" regex parse error:").rstrip(": ")
    what = STRUCTURED_WHAT.get(kind)
    return InvalidInputError(": ".join(part for part in (name, what, head, *reasons) if part))


def read_text(path: Path, what: str) -> str:
    try:
        return utf8(path.read_bytes(), f"{what} {path}")
    except OSError as e:
        raise InvalidInputError(f"{what}: cannot read {path} ({e.strerror})") from None


def config_from(args: argparse.Namespace) -> EngineConfig:
    """The engine config the flags spell, unchecked (`engine.check.check(config, flag)` checks it)."""
    return EngineConfig(model=args.model, platform=args.platform, dtype=args.dtype,
                        max_model_len=args.max_model_len, in_process=args.in_process,
                        log_level=args.log_level, speculator=args.speculator,
                        num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
                        skip_drafts=not args.no_skip_drafts, grammar_drafts=not args.no_grammar_drafts,
                        grammar_graphs=not args.no_grammar_graphs, sampling_graphs=not args.no_sampling_graphs,
                        late_masks=args.late_masks, launch_on_loop=not args.no_launch_on_loop,
                        enforce_eager=args.enforce_eager,
                        prompts_apart=not args.no_prompts_apart,
                        prompt_steps_per_decode=args.prompt_steps_per_decode,
                        prompt_batches=not args.no_prompt_batches,
                        batch_invariant=args.batch_invariant,
                        adaptive_speculation=args.adaptive_speculation,
                        speculator_options=parse_options(args.speculator_option),
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        pipeline_transport=args.pipeline_transport, pipeline_host=args.pipeline_host,
                        data_parallel_size=args.data_parallel_size,
                        allow_special_tokens=args.allow_special_tokens)


def flag(field: str) -> str:
    """An EngineConfig field as the command line spells it, for `check`'s messages."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def parse_options(items: list[str]) -> dict[str, str]:
    bad = [item for item in items if "=" not in item]
    if bad:
        raise InvalidInputError(f"--speculator-option: expected KEY=VALUE, got {bad[0]!r}")
    return dict(item.split("=", 1) for item in items)


def params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                          structured=structured_from(args), repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty).validate()


def utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") \
            from None
