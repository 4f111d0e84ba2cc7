"""The `speckernel bench` command line: every scenario's flags, defined without importing the
scenarios (so the CLI starts without torch); `bench.main` imports the one that runs."""

from __future__ import annotations

import argparse
import math
from typing import Any, NamedTuple

from ... import registry
from ...sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE

SCENARIOS = {
    "accept": "acceptance per speculator on HumanEval",
    "decode": "decode speed at batch 1 and under concurrency, per speculator, next to HF transformers",
    "grammar": "structured output (JSON schemas, json_object, regex, choice) against free text, with and without "
               "speculators and forced drafts",
    "hostsync": "a fixed-width speculator with and without copying draft IDs to the host",
    "invariant": "the batch-invariant mode against the default: tokens/s and outputs equal to plain greedy",
    "loop": "the kernel's host work a step and a row (schedule + apply, a stand-in runner), on the CPU",
    "frontend": "the serving path's host work a step beyond the runner (in-process frontend and core loop, a "
                "stand-in runner), on the CPU",
    "kernels": "each small-batch kernel against the fused path's launches, by shape and rows; --sweep tunes tiles",
    "pp": "pipeline (PP=1,2,4) and data (DP=2) parallelism, with and without a speculator",
    "prefill": "prefill-only requests with and without K=0 steps",
    "remote": "a drafter served in a second process, deferred vs synchronous vs local, with injected round trips",
    "scale": "one decode step of a Llama-3-8B-shaped model against the weight-read floor",
    "startup": "time to the first token of a fresh process, by phase (import, load, first token)",
}


MODES = ("inprocess", "process")


def names_from(allowed: tuple[str, ...], text: str, what: str = "modes") -> list[str]:
    """A comma-separated list of names from `allowed`, in the order given (argparse type)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in allowed for m in names):
        raise argparse.ArgumentTypeError(f"expected {what} from {', '.join(allowed)}, got {text!r}")
    return names


def mode_list(text: str) -> list[str]:
    return names_from(MODES, text)


VLLM_PEERS = ("vllm", "vllm_ngram")
"""vLLM without speculation and with its ngram speculator (bench decode's vLLM peers)."""


def vllm_peer_list(text: str) -> list[str]:
    return names_from(VLLM_PEERS, text, "vLLM peers")


def engine_flags(p: argparse.ArgumentParser, *, model: str | None = "smollm2-135m", max_num_seqs: int = 64,
                 max_model_len: int | None = 2048, dtype: str | None = None, process: bool = True) -> None:
    p.add_argument("--model", default=model,
                   help="built-in name, GGUF file, safetensors folder or random:PRESET")
    p.add_argument("--platform", default=None, help="cpu, cuda, ascend (default: the best available)")
    p.add_argument("--dtype", default=dtype, help="float32 makes speculative and plain greedy runs "
                   "bit-comparable; None: the platform's")
    p.add_argument("--enforce-eager", action="store_true", help="never replay captured device graphs")
    p.add_argument("--no-prompts-apart", action="store_true",
                   help="let prompts share decode steps (which then run eagerly)")
    p.add_argument("--prompt-steps-per-decode", type=int, default=4, metavar="N",
                   help="prompt steps between two decode steps while several prompts wait (default: 4)")
    p.add_argument("--no-prompt-batches", action="store_true",
                   help="no several-prompt steps: a burst of prompts takes one step each")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels (speculative greedy output equals plain greedy output)")
    p.add_argument("--no-launch-on-loop", action="store_true",
                   help="launch steps on a runner thread even where launches never wait for the device")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="requests decoded at once")
    p.add_argument("--max-model-len", type=int, default=max_model_len,
                   help="context length, 0 for the model's own" if max_model_len else
                   "context length (default: the model's)")
    if process:
        p.add_argument("--process", action="store_true",
                       help="run the engine core in its own process (default: in-process)")


def speculator_flags(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument("--speculator", action="append", default=None, type=speculator_spec,
                   help=f"speculator to measure, NAME[:K[:KEY=VALUE,...]] ({default_help})")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafts per step")
    p.add_argument("--draft-model", default=None, help="checkpoint for the speculator (default: its own default)")
    p.add_argument("--speculator-option", action="append", default=[], metavar="KEY=VALUE",
                   help="speculator-specific option (repeatable)")
    p.add_argument("--adaptive-speculation", action="store_const", const=True, default=None,
                   help="let measured step times turn drafting off where it does not pay "
                        "(default: where step graphs are timed at start)")
    p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_const", const=False,
                   help="always draft (no governor)")


class SpeculatorRun(NamedTuple):
    """One `--speculator NAME[:K[:KEY=VALUE,...]]`: the run's K and options where it gives them."""

    name: str
    k: int | None
    """None: --num-speculative-tokens."""
    options: list[str] | None
    """None: --speculator-option."""


def split_speculator(text: str) -> SpeculatorRun:
    """NAME[:K[:KEY=VALUE,...]]; ValueError where K is not a whole number."""
    name, _, rest = text.partition(":")
    k_text, _, option_text = rest.partition(":")
    if k_text and not k_text.isdigit():
        raise ValueError(f"{text!r}: K must be a whole number (NAME[:K[:KEY=VALUE,...]])")
    return SpeculatorRun(name, int(k_text) if k_text else None, option_text.split(",") if option_text else None)


def speculator_spec(text: str) -> str:
    """NAME[:K[:KEY=VALUE,...]] with a registered NAME and an integer K (argparse type): a bad one
    is refused before anything runs, not after the runs before it."""
    try:
        name = split_speculator(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    known = sorted(registry.discover("speculator"))
    if name == "none":
        raise argparse.ArgumentTypeError("no speculator always runs first: name only the speculators beside it")
    if name not in known:
        raise argparse.ArgumentTypeError(f"unknown speculator {name!r}; registered: {', '.join(known)}")
    return text


def repeats_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="runs of each configuration on its engine; the table shows the median run and the "
                        "min-max spread (default: 3: one run on a shared or CPU host can be off by 10%% or more)")


def int_at_least(text: str, least: int) -> int:
    """An integer >= least (the body of argparse types)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    return int_at_least(text, 1)


def int_list(text: str, least: int = 1) -> list[int]:
    """`1,4,16` → [1, 4, 16] (argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {text!r}")
    return values


def count_list(text: str) -> list[int]:
    """`0,3` → [0, 3] (argparse type; 0 allowed)."""
    return int_list(text, least=0)


def fraction(text: str) -> float:
    """A share in [0, 1) (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def accept_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: ngram and draft_model")
    p.add_argument("--label", default=None, help="name of the speculative runs in the table")
    p.add_argument("--dataset", choices=("humaneval", "chat"), default="humaneval",
                   help="HumanEval's 164 problems, or the 64 held-out general-chat requests (default: humaneval)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most")
    p.add_argument("--num-prompts", "--limit", dest="num_prompts", type=int, default=None,
                   help="the first N prompts only, as in the other scenarios (--limit: its old name) "
                        "(default: all of the dataset)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="requests in flight at once (0: all; 1 gives tokens/s at batch 1)")
    p.add_argument("--temperature", type=temperature_list, default=[0.0], metavar="T[,T...]",
                   help="temperatures, comma-separated: every run, none included, at each (0,1: greedy and "
                        "sampled tables side by side; default: 0)")
    p.add_argument("--seed", type=seed_value, default=0, metavar="S",
                   help="at a temperature above 0, request i samples with seed S+i, so a run repeats (default: 0)")
    engine_flags(p)


def temperature_list(text: str) -> list[float]:
    """`0,1` → [0.0, 1.0], each once, in the order given (argparse type): a bad one is refused
    before anything runs, not after the runs at the temperatures before it."""
    values: list[float] = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected temperatures (numbers >= 0) separated by commas, "
                                             f"got {text!r}") from None
        if not math.isfinite(value) or not 0.0 <= value <= MAX_TEMPERATURE:
            raise argparse.ArgumentTypeError(f"expected temperatures in [0, {MAX_TEMPERATURE:g}], got {part!r}")
        if 0.0 < value < MIN_TEMPERATURE:  # the engine samples these greedily: the row would say otherwise
            raise argparse.ArgumentTypeError(f"temperature {part!r} is below {MIN_TEMPERATURE:g}, which samples "
                                             "greedily: write 0")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected temperatures (numbers >= 0) separated by commas, got {text!r}")
    return list(dict.fromkeys(values))


def seed_value(text: str) -> int:
    """An integer >= 0 (argparse type): seeds are unsigned."""
    return int_at_least(text, 0)


def decode_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: ngram")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument("--num-prompts", type=int, default=10,
                   help="prompts at batch 1; concurrency C runs max(4 x C, this) prompts")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64],
                   help="comma-separated; 1 is batch 1 (default: 1,4,16,64)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peers")
    p.add_argument("--no-vllm", action="store_true",
                   help="skip the vLLM peers (they run where vllm is importable, on a GPU)")
    p.add_argument("--vllm-peers", type=vllm_peer_list, default=list(VLLM_PEERS),
                   help=f"the vLLM configurations to run, comma-separated (default: {','.join(VLLM_PEERS)})")
    p.add_argument("--modes", type=mode_list, default=None,
                   help="engine-core placements to measure, e.g. inprocess,process (default: inprocess, "
                        "or process with --process)")
    repeats_flag(p)
    engine_flags(p)


def hostsync_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculator", default="draft_model", help="a fixed-width speculator (default: draft_model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafts per step")
    p.add_argument("--draft-model", default=None, help="checkpoint for the speculator (default: the target)")
    p.add_argument("--speculator-option", action="append", default=None, metavar="KEY=VALUE",
                   help="repeatable (default for draft_model: num_layers=4, a cheap self-drafter)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--num-prompts", type=int, default=10,
                   help="prompts at batch 1; concurrency C runs max(C, this) prompts")
    p.add_argument("--concurrency", type=int_list, default=[1, 16], help="comma-separated (default: 1,16)")
    repeats_flag(p)
    engine_flags(p)


def loop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int_list, default=[1, 16, 64, 128],
                   help="requests in flight, comma-separated (default: 1,16,64,128)")
    p.add_argument("--loop-k", type=count_list, default=[0, 3], metavar="K",
                   help="drafts a row verifies, comma-separated; 0: no speculator (default: 0,3)")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per configuration")


def frontend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64, 128],
                   help="requests in flight, comma-separated (default: 1,16,64,128)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--num-prompts", type=int, default=8, help="concurrency C runs max(2C, this) requests")
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer and chat limits (its weights stay unread)")
    p.add_argument("--no-launch-on-loop", action="store_true",
                   help="launch on a runner thread, as where launches wait for the device")


def invariant_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: ngram:4, mtp:3, eagle3:3, dflash:7, dspark:4, causal_cascade:4")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most")
    p.add_argument("--num-prompts", type=int, default=164, help="the first N HumanEval prompts (default: all 164)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight next to batch 1 (default: 64)")
    engine_flags(p)


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def remote_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="eagle3", help="the served drafter (default: eagle3, fixed width)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K", help="drafts per step")
    p.add_argument("--draft-model", default=None, help="the drafter's checkpoint (default: the shipped one)")
    p.add_argument("--rtt-ms", type=float_list, default=[0.0, 0.5, 1.0, 2.0],
                   help="injected round trips, comma-separated (default: 0,0.5,1,2)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--num-prompts", type=int, default=1, help="prompts run at once")
    engine_flags(p, max_model_len=1024, process=False)


def prefill_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: ngram")
    p.add_argument("--prompt-tokens", type=int, default=1200, help="tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per run")
    p.add_argument("--concurrency", type=int_list, default=[1, 16], help="comma-separated (default: 1,16)")
    repeats_flag(p)
    engine_flags(p)


def grammar_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: ngram, eagle3 and dflash; runs next to none")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer at most")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run, at least the run's concurrency")
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64], help="comma-separated (default: 1,16,64)")
    p.add_argument("--modes", type=grammar_modes, default=list(GRAMMAR_MODES),
                   help="constraints to run, comma-separated (free always runs: the ratios' baseline; default: all of "
                        + ", ".join(GRAMMAR_MODES) + ")")
    p.add_argument("--forced-drafts", type=on_off_list, default=["on", "off"],
                   help="verify the tokens a grammar forces as drafts: on, off or both (default: on,off)")
    p.add_argument("--late-masks", type=on_off_list, default=["on"],
                   help="without a speculator, constrained rows run ahead and get their masks after launch (on), or "
                        "wait for their frames (off), or both, compared (default: on)")
    engine_flags(p, max_num_seqs=64, max_model_len=1024, process=False)


GRAMMAR_MODES = ("free", "json_schema", "boilerplate", "json_object", "regex", "choice")


def grammar_modes(text: str) -> list[str]:
    modes = names_from(GRAMMAR_MODES, text)
    return ["free", *(m for m in GRAMMAR_MODES[1:] if m in modes)]


def on_off_list(text: str) -> list[str]:
    return list(dict.fromkeys(names_from(("on", "off"), text, "values")))


def pp_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: mtp and dflash; runs next to none")
    p.add_argument("--pipeline-sizes", type=int_list, default=[1, 2, 4], help="comma-separated (default: 1,2,4)")
    p.add_argument("--data-parallel-sizes", type=int_list, default=[2], help="comma-separated (default: 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="requests per run, at least the run's concurrency (default: 16)")
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64],
                   help="requests in flight at once, comma-separated (default: 1,16,64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget per step (smaller: more prefill chunks to pipeline)")
    p.add_argument("--pipeline-transport", default=None, metavar="NAME",
                   help="transport between pipeline stages (default: the engine's)")
    p.add_argument("--dp-ranks", type=lambda text: text.split(","), default=["process", "in-process"],
                   help="where data-parallel ranks run, comma-separated: process (a process each, as "
                        "served), in-process (threads of this process) (default: both)")
    engine_flags(p, max_num_seqs=64, max_model_len=1024, process=False)


def scale_arguments(p: argparse.ArgumentParser) -> None:
    engine_flags(p, model=None, max_num_seqs=1, max_model_len=None, dtype="bfloat16", process=False)
    p.add_argument("--compare", action="append", default=None,
                   help="further models timed the same way (repeatable; default: smollm2-135m after the "
                        "default model, none after a --model)")
    p.add_argument("--layers", type=int, default=None,
                   help="override the layer count of random:... models (default: the preset's)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of context per decode step")
    p.add_argument("--batch", type=int_list, default=[1], help="rows per decode step, comma-separated (default: 1)")
    p.add_argument("--small-batch-kernels", choices=("on", "off", "both"), default="on",
                   help="time with the small-batch kernels, without, or both side by side (default: on)")
    p.add_argument("--warmup-steps", type=int, default=8, help="untimed steps first")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--copy-mib", type=int, default=None, help="size of the timed copy (default: 4096 MiB on "
                   "an accelerator, 256 on the CPU)")
    p.add_argument("--copy-repeats", type=int, default=10, help="timed copies")


KERNEL_NAMES = ("qkv", "o", "gate_up", "down", "head")


def name_list(text: str) -> list[str]:
    """`a,b` → ["a", "b"] (argparse type)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected names separated by commas, got {text!r}")
    return names


def kernel_list(text: str) -> list[str]:
    names = name_list(text)
    bad = [n for n in names if n not in KERNEL_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected kernels from {', '.join(KERNEL_NAMES)}, got {text!r}")
    return names


def kernels_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=name_list, default=["random:smollm2-135m", "random:llama3-8b"],
                   help="models whose shapes are timed, comma-separated (default: random:smollm2-135m,"
                        "random:llama3-8b; only the config is read)")
    p.add_argument("--kernels", type=kernel_list, default=list(KERNEL_NAMES),
                   help=f"comma-separated, from {','.join(KERNEL_NAMES)} (default: all)")
    p.add_argument("--rows", type=int_list, default=[1, 4, 16], help="token rows M, comma-separated, at most 16 "
                   "(default: 1,4,16)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the weights' dtype (default: bfloat16)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    p.add_argument("--bandwidth-gbs", type=float, default=4300.0,
                   help="bandwidth of the floor, GB/s (default: 4300, an H200's)")
    p.add_argument("--repeats", type=int, default=20, help="timed replays per variant (default: 20)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile of each kernel and shape")


def startup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="built-in name, GGUF file or safetensors folder")
    p.add_argument("--platform", default=None, help="cpu, cuda, ascend (default: the best available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the platform's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes timed per mode (after one untimed)")
    p.add_argument("--modes", type=mode_list, default=None,
                   help="engine-core placements, e.g. process,inprocess (default: process, as the CLI)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one fresh process may take")


ARGUMENTS = {"accept": accept_arguments, "decode": decode_arguments, "grammar": grammar_arguments,
             "hostsync": hostsync_arguments, "invariant": invariant_arguments, "kernels": kernels_arguments,
             "loop": loop_arguments, "frontend": frontend_arguments, "prefill": prefill_arguments, "pp": pp_arguments,
             "remote": remote_arguments,
             "scale": scale_arguments, "startup": startup_arguments}


def serve_arguments(p: argparse.ArgumentParser) -> None:
    speculator_flags(p, "repeatable; default: ngram; runs next to none")
    p.add_argument("--url", default=None, help="measure this running server (default: start one per speculator)")
    p.add_argument("--label", default=None, help="name of the --url run in the table (default: server)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--num-prompts", type=int, default=16, help="concurrency C runs max(C, this) prompts")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 64], help="comma-separated (default: 1,4,16,64)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one HTTP request may take")
    p.add_argument("--hostile", type=fraction, default=0.0, metavar="F",
                   help="also run each load with this share of hostile requests (huge bodies and prompts, "
                        "many stop strings, disconnects, idle connections) added, next to it without "
                        "(0.25: a quarter; default: 0, none)")
    engine_flags(p, process=False)


SCENARIOS["serve"] = "HTTP load against `speckernel serve`, per speculator, next to none"
ARGUMENTS["serve"] = serve_arguments


def compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", action="append", required=True, metavar="DIR",
                   help="an --out folder of the baseline's runs (repeatable: one a round)")
    p.add_argument("--candidate", action="append", required=True, metavar="DIR",
                   help="an --out folder of the candidate's runs (repeatable, in the baseline's order)")
    p.add_argument("--scenario", dest="compare_scenario", default="decode", metavar="NAME",
                   choices=sorted(set(SCENARIOS) - {"compare"}),
                   help="the bench scenario the folders hold (default: decode)")
    p.add_argument("--key", default="tokens_per_s", help="the figure compared (default: tokens_per_s)")
    p.add_argument("--tolerance", type=fraction, default=0.05, metavar="F",
                   help="the share either way a row may differ and count as unchanged (default: 0.05)")


SCENARIOS["compare"] = "two sets of --out folders of one scenario (baseline, candidate), row by row, with a verdict"
ARGUMENTS["compare"] = compare_arguments


def add_arguments(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark scenarios (JSON, markdown table, plot)")
    scenarios = bench.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, help_text in SCENARIOS.items():
        p = scenarios.add_parser(name, help=help_text, description=help_text)
        ARGUMENTS[name](p)
        p.add_argument("--out", default=None,
                       help=f"folder for the JSON, markdown and PNG (default: a new bench-{name}-DATE-TIME "
                            "folder in the current one, so no run overwrites another or committed results)")
