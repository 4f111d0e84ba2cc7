"""grammar: what structured output costs. The same JSON requests free, under a JSON schema and
under json_object, each without and with each speculator, at each concurrency: tokens/s, TPOT,
acceptance, drafts the grammar cut, the share of outputs that parse (and, under the schema,
have its fields with their types), and whether the speculative output equals the same
constraint's output without speculation token for token.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ... import registry
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams, StructuredOutput
from .command import base_config, cell, device_name, header, preamble, ratio, with_speculator
from .streams import identical, run_streams, warm_up

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
TYPES = {"string": str, "integer": int, "array": list}

REQUESTS = (
    "Describe a fictional person as JSON with their name, age, city and hobbies.",
    "Invent a character for a novel and give their name, age, home city and hobbies in JSON.",
    "Give me a JSON record of a made-up customer: name, age, city and a list of hobbies.",
    "Create a JSON profile of a retired teacher who lives by the sea.",
    "Make up a JSON entry for a student with name, age, city and hobbies.",
    "Write a JSON object describing an imaginary chef: name, age, city, hobbies.",
    "Return JSON about a fictional astronaut: name, age, city and hobbies.",
    "Describe, in JSON, a person who has just moved to a new city, with their hobbies.",
)
MODES = ("free", "json_schema", "json_object")


def constraint(mode: str) -> StructuredOutput | None:
    if mode == "json_schema":
        return StructuredOutput.of_schema(SCHEMA)
    if mode == "json_object":
        return StructuredOutput(json_object=True)
    return None


def valid(text: str, mode: str) -> bool:
    """Parses as JSON; under the schema, an object with exactly its fields, of their types."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if mode == "json_schema":
        props = SCHEMA["properties"]
        return (isinstance(value, dict) and set(value) == set(props)
                and all(isinstance(value[k], TYPES[p["type"]]) and not isinstance(value[k], bool)
                        for k, p in props.items())
                and all(isinstance(h, str) for h in value["hobbies"]))
    return mode == "free" or isinstance(value, dict)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    reference: dict[tuple[str, int], list[list[int]]] = {}
    info: Any = None
    for name in [None, *(args.speculator or ["ngram", "mtp", "dflash"])]:
        config = with_speculator(base_config(args), args, name)
        async with AsyncEngine(config) as engine:
            info = engine.info
            prompts = [engine.encode_chat([{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}])
                       for i in range(args.num_prompts)]
            await warm_up(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0), tuple(args.concurrency))
            for mode in MODES:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=constraint(mode))
                for c in args.concurrency:
                    before = await engine.stats()
                    r = await run_streams(engine, prompts, params, c, f"grammar {name or 'none'} {mode} c={c}")
                    after = await engine.stats()
                    outputs = r.pop("outputs")
                    r.pop("requests")
                    texts = [engine.tokenizer.decode(o) for o in outputs]
                    key = (mode, c)
                    reference.setdefault(key, outputs)
                    runs.append({"speculator": config.speculator or "none", "mode": mode,
                                 "num_invalid_drafts": after["spec"].get("num_invalid_drafts", 0)
                                 - before["spec"].get("num_invalid_drafts", 0),
                                 "valid_outputs": sum(valid(t, mode) for t in texts),
                                 "identical_to_none": identical(outputs, reference[key])} | r)
    for r in runs:
        free = next(x for x in runs if x["speculator"] == r["speculator"] and x["mode"] == "free"
                    and x["concurrency"] == r["concurrency"])
        r["ratio_to_free"] = ratio(r["tokens_per_s"], free["tokens_per_s"])
    return header("grammar") | {
        "platform": info.platform, "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "num_speculative_tokens": args.num_speculative_tokens, "schema": SCHEMA, "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Structured output: {report['num_prompts']} JSON requests, greedy, max_tokens "
                             f"{report['max_tokens']}, K={report['num_speculative_tokens']} unless the speculator says")
    lines += [
        "free: no constraint; json_schema: the schema below (llguidance); json_object: any JSON object. "
        "vs free: tokens/s over the same speculator's free run at the same concurrency. Valid: parses, and under "
        "the schema has exactly its fields with their types. Identical: token for token the output of the same "
        "constraint without speculation. Device gaps: the device waiting for the host between two steps with "
        "nothing else in flight (a constrained row waits for its step's tokens before its next mask), from the "
        "result to the return of the next launch: the mean gap and the gaps' share of the run (on the CPU a "
        "launch runs the step itself, so there a gap includes the step).",
        "",
        "| speculator | constraint | concurrency | tokens/s | vs free | TPOT p50 ms | mean acceptance length "
        "| drafts cut by the grammar | graph steps | device gap ms | device gap share | valid | identical to none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['speculator']} | {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
            f"{cell(r['ratio_to_free'])} | {cell(r['tpot_p50_ms'])} | {cell(r['spec'].get('mean_acceptance_length'))} "
            f"| {r['num_invalid_drafts']} | {r['num_graph_steps']}/{r['num_steps']} "
            f"| {cell(r['device_gap_ms'], '.2f')} | {cell(r['device_gap_share'], '.0%')} "
            f"| {r['valid_outputs']}/{r['num_requests']} | "
            f"{r['identical_to_none']}/{r['num_requests']} |")
    lines += ["", f"Schema: `{json.dumps(report['schema'])}`"]
    return lines


def plot(report: dict[str, Any], plt: Any) -> Any:
    concurrencies = report["concurrency"]
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4), squeeze=False)
    for ax, c in zip(axes[0], concurrencies, strict=True):
        specs = list(dict.fromkeys(r["speculator"] for r in report["runs"]))
        width = 0.8 / len(MODES)
        for j, mode in enumerate(MODES):
            values = [next(r["tokens_per_s"] for r in report["runs"] if r["speculator"] == s and r["mode"] == mode
                           and r["concurrency"] == c) for s in specs]
            ax.bar([i + j * width for i in range(len(specs))], values, width, label=mode)
        ax.set_xticks([i + width for i in range(len(specs))], specs)
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{report['platform']} {report['dtype']}, concurrency {c}")
        ax.legend(fontsize="small")
    return fig
