"""The vLLM peer for `bench decode`: where `vllm` is importable, vLLM runs the very prompt token
ids the engine ran, with the same settings (greedy, max_tokens, the model's weights in the same
dtype), without speculation and with its ngram speculator, at batch 1 and at each concurrency.

vLLM reads a Hugging Face folder, so a GGUF checkpoint is written out once as one (transformers
dequantizes it exactly as it does for the HF peers) and cached. Each vLLM configuration runs in
a child process of its own: vLLM keeps its GPU memory and compiled state until its process
exits, and the next configuration, or the engine, must not share it.

Concurrency C keeps C requests in flight as the engine's bench does: vLLM's engine is stepped by
hand and the next prompt is added as soon as a request finishes. Time to first token, time per
output token ((last - first) / (n - 1)) and the longest gap between two tokens of one request
are read on the host at each step's return, as the engine's bench reads them at each streamed
delta.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ...models.cache import cache_dir
from ...models.checkpoint import resolve
from .args import VLLM_PEERS as PEERS
from .command import ms, percentile

PEER_TIMEOUT_S = 1800.0
"""A whole configuration (start-up with compilation and graphs, then every concurrency)."""


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def hf_folder(model: str, dtype: str) -> Path:
    """A Hugging Face folder of the model, for vLLM: the checkpoint's own folder when it is one,
    else (a GGUF file) a folder written once from it by transformers and cached."""
    path = resolve(model)
    if path.is_dir():
        return path
    out = cache_dir() / "hf" / f"{path.stem}-{dtype}"
    if (out / "config.json").is_file():
        return out
    import torch  # the parent only: the child imports vLLM, which brings its own
    from transformers import AutoTokenizer  # optional: the peers need it

    from .hf import load  # the HF peers' loader: the same dequantized weights

    print(f"bench decode: writing {path.name} as a Hugging Face folder for vLLM ({dtype})", file=sys.stderr)
    partial = Path(tempfile.mkdtemp(prefix=".hf-", dir=out.parent if out.parent.exists() else None))
    hf = load(model, getattr(torch, dtype), torch.device("cpu"))
    hf.hf_quantizer = None  # dequantized already: written as plain weights, which vLLM reads
    hf.config.__dict__.pop("quantization_config", None)
    hf.save_pretrained(partial)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True).save_pretrained(partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, out)
    return out


def run_peers(model: str, dtype: str, prompts: list[list[int]], sizes: dict[int, int], max_tokens: int,
              k: int, max_num_seqs: int, max_model_len: int,
              names: Sequence[str] = PEERS) -> dict[str, dict[str, Any]]:
    """{peer: {"runs": [one per concurrency], "start_s": ...}}; a peer that fails is reported
    with its error, and the engine's figures stand on their own."""
    try:
        folder = hf_folder(model, dtype)
    except Exception as e:  # transformers cannot write this checkpoint: the engine's figures still stand
        print(f"bench decode: no Hugging Face folder for vLLM: {e}", file=sys.stderr)
        return {peer: {"error": f"no Hugging Face folder: {e}", "runs": []} for peer in names}
    peers: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="speckernel-vllm-") as tmp:
        for peer in names:
            spec = {"model": str(folder), "dtype": dtype, "prompts": prompts, "sizes": sizes,
                    "max_tokens": max_tokens, "k": k if peer == "vllm_ngram" else 0,
                    "max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
            job, out = Path(tmp) / f"{peer}.json", Path(tmp) / f"{peer}.out.json"
            job.write_text(json.dumps(spec))
            print(f"bench decode: vLLM peer {peer} ({sum(sizes.values())} requests)", file=sys.stderr)
            try:
                subprocess.run([sys.executable, "-m", __name__, str(job), str(out)], check=True,
                               timeout=PEER_TIMEOUT_S)
                peers[peer] = json.loads(out.read_text())
            except (subprocess.SubprocessError, OSError, ValueError) as e:
                print(f"bench decode: vLLM peer {peer} failed: {e}", file=sys.stderr)
                peers[peer] = {"error": str(e), "runs": []}
    return peers


# --- the child: one vLLM engine ---------------------------------------------------------------


def run_concurrency(engine: Any, params: Any, prompts: list[list[int]], concurrency: int, desc: str,
                    counter: list[int]) -> dict[str, Any]:
    """Every prompt once, `concurrency` in flight: the next is added when one finishes."""
    outputs: list[list[int]] = [[] for _ in prompts]
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    index: dict[str, int] = {}
    ttft: list[float] = []
    tpot: list[float] = []
    longest_gap = 0.0
    pending = iter(range(len(prompts)))

    def add() -> None:
        i = next(pending, None)
        if i is None:
            return
        counter[0] += 1
        rid = str(counter[0])
        index[rid], arrival[rid] = i, time.monotonic()
        engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params)

    bar = tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr, disable=None)
    started = time.monotonic()
    for _ in range(min(concurrency, len(prompts))):
        add()
    with bar:
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.monotonic()
            for out in outs:
                rid = out.request_id
                new = list(out.outputs[0].token_ids) if out.outputs else []
                if new:
                    if rid not in first:
                        first[rid] = now
                        ttft.append(now - arrival[rid])
                    else:
                        longest_gap = max(longest_gap, now - last[rid])
                    last[rid] = now
                    outputs[index[rid]] += new
                if out.finished:
                    n = len(outputs[index[rid]])
                    if n > 1:
                        tpot.append((last[rid] - first[rid]) / (n - 1))
                    bar.update(1)
                    add()
    elapsed = time.monotonic() - started
    generated = sum(len(o) for o in outputs)
    return {
        "concurrency": concurrency, "num_requests": len(prompts), "generated_tokens": generated,
        "elapsed_s": elapsed, "tokens_per_s": generated / elapsed,
        "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "longest_stall_ms": ms(longest_gap), "outputs": outputs,
    }


def child(job: Path, out: Path) -> None:
    for key, value in (("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"), ("HF_HUB_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # greedy never needs it; it is imported eagerly
    from vllm import LLM, SamplingParams  # the child only: vLLM is the optional peer
    from vllm.sampling_params import RequestOutputKind

    spec = json.loads(job.read_text())
    ngram = ({"method": "ngram", "num_speculative_tokens": spec["k"], "prompt_lookup_max": 4,
              "prompt_lookup_min": 1} if spec["k"] else None)
    started = time.monotonic()
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"], gpu_memory_utilization=0.5,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"], speculative_config=ngram,
              seed=0)
    start_s = time.monotonic() - started
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], output_kind=RequestOutputKind.DELTA)
    warm = SamplingParams(temperature=0.0, max_tokens=8, output_kind=RequestOutputKind.DELTA)
    prompts, counter = spec["prompts"], [0]
    sizes = {int(c): n for c, n in spec["sizes"].items()}
    for c in sorted(sizes):  # as the engine's warm_up: short requests at each measured concurrency
        run_concurrency(engine, warm, prompts[:c], c, f"vllm warm-up c={c}", counter)
    name = "vllm_ngram" if ngram else "vllm"
    runs = [run_concurrency(engine, params, prompts[:n], c, f"{name} c={c}", counter) for c, n in sizes.items()]
    import vllm  # for its version

    out.write_text(json.dumps({"start_s": start_s, "version": vllm.__version__, "runs": runs,
                               "speculative_config": ngram}))


if __name__ == "__main__":
    child(Path(sys.argv[1]), Path(sys.argv[2]))
