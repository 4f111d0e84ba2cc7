"""grammar: what structured output costs. The same requests free and under each constraint (a
JSON schema, a schema full of boilerplate: nested objects, enums and fixed keys, json_object, a
regex, a choice), without and with each speculator, with and without the grammar's forced tokens
verified as drafts, at each concurrency: tokens/s, TPOT, acceptance, forced drafts, drafts the
grammar cut, graph steps, the device's gaps, the share of outputs that match their constraint,
and whether the output equals the same constraint's output without speculation and without
forced drafts, token for token.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import msgspec

from ... import registry
from ...frontend.async_engine import AsyncEngine
from ...sampling_params import SamplingParams, StructuredOutput
from .args import GRAMMAR_MODES
from .command import MISSING, base_config, cell, device_name, header, preamble, ratio, with_speculator
from .streams import identical, run_streams, warm_up

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
ADDRESS: dict[str, Any] = {
    "type": "object",
    "properties": {"street_address": {"type": "string"}, "city_name": {"type": "string"},
                   "country_code": {"enum": ["FR", "DE", "IT", "ES", "GB", "US"]}},
    "required": ["street_address", "city_name", "country_code"],
    "additionalProperties": False,
}
BOILERPLATE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "record_type": {"enum": ["person_profile"]},
        "schema_version": {"enum": ["2024-01-01"]},
        "person": {
            "type": "object",
            "properties": {"full_name": {"type": "string"}, "age_in_years": {"type": "integer"},
                           "home_address": ADDRESS,
                           "employment_status": {"enum": ["employed", "self_employed", "student", "retired"]}},
            "required": ["full_name", "age_in_years", "home_address", "employment_status"],
            "additionalProperties": False,
        },
    },
    "required": ["record_type", "schema_version", "person"],
    "additionalProperties": False,
}
"""Long fixed keys, enums with one value, nested objects: most of its tokens are forced."""
REGEX = r"[A-Z][a-z]+ is [0-9]{2} years old and lives in [A-Z][a-z]+\."
CHOICES = ("a teacher", "a chef", "an astronaut", "a student")
TYPES = {"string": str, "integer": int, "array": list, "object": dict}

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


def constraint(mode: str) -> StructuredOutput | None:
    return {"json_schema": StructuredOutput.of_schema(SCHEMA), "boilerplate": StructuredOutput.of_schema(BOILERPLATE),
            "json_object": StructuredOutput(json_object=True), "regex": StructuredOutput(regex=REGEX),
            "choice": StructuredOutput(choice=CHOICES)}.get(mode)


def matches(value: Any, schema: dict[str, Any]) -> bool:
    """value against the subset of JSON schema the bench's schemas use (objects with exactly their
    properties, enums, strings, integers, arrays of strings)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return isinstance(value, dict) and set(value) == set(props) and all(
            matches(value[k], p) for k, p in props.items())
    if kind == "array":
        return isinstance(value, list) and all(matches(v, schema["items"]) for v in value)
    return isinstance(value, TYPES[kind]) and not isinstance(value, bool)


def valid(text: str, mode: str) -> bool:
    """The output matches its constraint: free text always; a regex or choice exactly; JSON that
    parses, and under a schema has exactly its fields, with their types and enum values."""
    if mode in ("free", "regex", "choice"):
        return mode == "free" or (re.fullmatch(REGEX, text) is not None if mode == "regex" else text in CHOICES)
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if mode in ("json_schema", "boilerplate"):
        return matches(value, SCHEMA if mode == "json_schema" else BOILERPLATE)
    return isinstance(value, dict)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    outputs_of: dict[tuple[str, bool, bool, str, int], list[list[int]]] = {}
    info: Any = None
    variants = [(f, late) for f in args.forced_drafts for late in args.late_masks]
    for name in [None, *(args.speculator or ["ngram", "eagle3", "dflash"])]:
        for forced, late in variants if name is None else dict.fromkeys((f, args.late_masks[0]) for f, _ in variants):
            # late masks serve rows without a speculator's drafts: one setting beside a speculator
            config = msgspec.structs.replace(with_speculator(base_config(args), args, name),
                                             grammar_drafts=forced == "on", late_masks=late == "on")
            async with AsyncEngine(config) as engine:
                info = engine.info
                prompts = [engine.encode_chat([{"role": "user", "content": REQUESTS[i % len(REQUESTS)]}])
                           for i in range(args.num_prompts)]
                await warm_up(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0), tuple(args.concurrency))
                for mode in args.modes:
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=constraint(mode))
                    for c in args.concurrency:
                        desc = f"grammar {name or 'none'} forced={forced} late={late} {mode} c={c}"
                        r = await run_streams(engine, prompts, params, c, desc)
                        outputs = r.pop("outputs")
                        r.pop("requests")
                        spec = config.speculator or "none"
                        outputs_of[(spec, forced == "on", late == "on", mode, c)] = outputs
                        runs.append({"speculator": spec, "forced_drafts": forced == "on", "late_masks": late == "on",
                                     "mode": mode,
                                     **{k: r["spec"][k] for k in ("num_invalid_drafts", "num_forced_drafts",
                                                                 "num_forced_accepted")},
                                     "valid_outputs": sum(valid(engine.tokenizer.decode(o), mode) for o in outputs)}
                                    | r)
    for r in runs:
        spec, forced, late, mode, c = key = (r["speculator"], r["forced_drafts"], r["late_masks"], r["mode"],
                                             r["concurrency"])
        free = next(x for x in runs if (x["speculator"], x["forced_drafts"], x["late_masks"], x["mode"],
                                        x["concurrency"]) == (spec, forced, late, "free", c))
        r["ratio_to_free"] = ratio(r["tokens_per_s"], free["tokens_per_s"])
        late_none = late if ("none", forced, late, mode, c) in outputs_of else not late
        same = {"identical_to_none": ("none", forced, late_none, mode, c),
                "identical_to_no_forced": (spec, False, late, mode, c),
                "identical_to_no_late_masks": (spec, forced, False, mode, c)}
        for field, other in same.items():
            r[field] = identical(outputs_of[key], outputs_of[other]) if other in outputs_of else None
    return header("grammar") | {
        "platform": info.platform, "dtype": info.dtype,
        "device": device_name(registry.pick_platform(info.platform).device),
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "num_speculative_tokens": args.num_speculative_tokens, "schema": SCHEMA, "boilerplate_schema": BOILERPLATE,
        "regex": REGEX, "choices": list(CHOICES), "modes": args.modes, "runs": runs,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = preamble(report, f"Structured output: {report['num_prompts']} requests, greedy, max_tokens "
                             f"{report['max_tokens']}, K={report['num_speculative_tokens']} unless the speculator says")
    lines += [
        "free: no constraint; json_schema and boilerplate: the schemas below (llguidance); json_object: any JSON "
        "object; regex and choice: below. forced: the tokens a grammar forces are verified as drafts (on) or decoded "
        "one a step (off). vs free: tokens/s over the free run of the same speculator and forced setting at the "
        "same concurrency. Forced: forced drafts accepted / verified. Valid: matches its constraint (JSON that "
        "parses, with exactly a schema's fields, types and enum values). Identical: token for token the output of "
        "the same constraint without speculation (same forced setting), and without forced drafts (same "
        "speculator). Device gaps: the device waiting for the host between two steps with nothing else in flight "
        "(a constrained row that waits for its step's tokens before its next mask), from the result to the return "
        "of the next launch: the mean gap and the gaps' share of the run (on the CPU a launch runs the step itself, "
        "so there a gap includes the step). late: without a speculator, constrained rows run ahead and their masks "
        "come after launch (on), or they wait for their frames (off); late steps: steps whose masks came after "
        "launch, and the mean time their sampling waited for them (the device, behind the gate; on the CPU the "
        "runner's thread).",
        "",
        "| speculator | forced | late | constraint | concurrency | tokens/s | vs free | TPOT p50 ms "
        "| mean acceptance length | forced accepted | drafts cut by the grammar | graph steps | device gap ms "
        "| device gap share | late steps (wait ms) | valid | identical to none | identical to forced off "
        "| identical to late off |",
        "|---" * 19 + "|",
    ]
    for r in report["runs"]:
        n = r["num_requests"]
        late = r.get("late_masks", False)
        lines.append(
            f"| {r['speculator']} | {'on' if r['forced_drafts'] else 'off'} | {'on' if late else 'off'} "
            f"| {r['mode']} | {r['concurrency']} "
            f"| {r['tokens_per_s']:.1f} | {cell(r['ratio_to_free'])} | {cell(r['tpot_p50_ms'])} "
            f"| {cell(r['spec'].get('mean_acceptance_length'))} | {r['num_forced_accepted']}/{r['num_forced_drafts']} "
            f"| {r['num_invalid_drafts']} | {r['num_graph_steps']}/{r['num_steps']} "
            f"| {cell(r['device_gap_ms'], '.2f')} | {cell(r['device_gap_share'], '.0%')} "
            f"| {r.get('num_late_mask_steps', 0)} ({cell(r.get('late_mask_wait_ms'), '.3f')}) "
            f"| {r['valid_outputs']}/{n} "
            f"| {_of(r['identical_to_none'], n)} | {_of(r['identical_to_no_forced'], n)} "
            f"| {_of(r.get('identical_to_no_late_masks'), n)} |")
    lines += ["", f"json_schema: `{json.dumps(report['schema'])}`", "",
              f"boilerplate: `{json.dumps(report['boilerplate_schema'])}`", "",
              f"regex: `{report['regex']}`; choice: {', '.join(report['choices'])}"]
    return lines


def _of(count: int | None, n: int) -> str:
    return MISSING if count is None else f"{count}/{n}"


def plot(report: dict[str, Any], plt: Any) -> Any:
    concurrencies = report["concurrency"]
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4), squeeze=False)
    runs = [r for r in report["runs"] if (r["forced_drafts"] or not any(x["forced_drafts"] for x in report["runs"]))
            and (r.get("late_masks", True) or not any(x.get("late_masks") for x in report["runs"]))]
    for ax, c in zip(axes[0], concurrencies, strict=True):
        specs = list(dict.fromkeys(r["speculator"] for r in runs))
        modes = report.get("modes", GRAMMAR_MODES)
        width = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            values = [next(r["tokens_per_s"] for r in runs if r["speculator"] == s and r["mode"] == mode
                           and r["concurrency"] == c) for s in specs]
            ax.bar([i + j * width for i in range(len(specs))], values, width, label=mode)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(specs))], specs)
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{report['platform']} {report['dtype']}, concurrency {c}")
        ax.legend(fontsize="small")
    return fig
