"""HF transformers peers for `bench decode`: the engine's weights (read from the same checkpoint
by transformers' own loader), dtype, device and prompt token ids through `generate`, greedy,
batch 1, one prompt after another:

- hf_eager: the default dynamic cache, eager PyTorch;
- hf_static_compiled: a static cache with transformers compiling the decode step (torch.compile,
  CUDA graphs on CUDA). Compilation happens on a warm-up generate over the longest prompt, which
  also sizes the static cache for every later prompt, so no measured call recompiles; its time
  is reported apart as setup_s;
- hf_prompt_lookup: prompt lookup decoding (`prompt_lookup_num_tokens`), the HF counterpart of
  the ngram speculator.

Time to first token is timed with a separate generate of one token; time per output token is
(whole generate - that) / (n - 1). Only local files are read.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from ...models.checkpoint import resolve
from .command import ms, percentile

PEERS = ("hf_eager", "hf_static_compiled", "hf_prompt_lookup")


def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def load(model: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM  # optional: the HF peers run where it is installed
    from transformers.utils import logging

    logging.set_verbosity_error()  # generate's notes on unused flags would drown the progress bars
    path = resolve(model)
    if path.is_file():  # a GGUF file: transformers dequantizes it itself
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                  local_files_only=True)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return hf.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to as a decorator's wrapper


def generation_config(peer: str, max_tokens: int, eos_ids: tuple[int, ...], k: int, device: torch.device) -> Any:
    from transformers import CompileConfig, GenerationConfig  # optional, as in load()

    extra: dict[str, Any] = {}
    if peer == "hf_static_compiled":
        compile_config = CompileConfig(fullgraph=True)
        if device.type != "cuda":
            # transformers compiles the decode step by itself on CUDA only; elsewhere it must be told.
            compile_config._compile_all_devices = True  # type: ignore[assignment]  # a private flag, typed None
        extra = {"cache_implementation": "static", "compile_config": compile_config}
    elif peer == "hf_prompt_lookup":
        extra = {"prompt_lookup_num_tokens": k}
    return GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=list(eos_ids) or None,
                            pad_token_id=eos_ids[0] if eos_ids else None, **extra)


@torch.inference_mode()
def timed_generate(model: Any, prompt: list[int], config: Any, device: torch.device) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=device)
    synchronize(device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    synchronize(device)
    return out[0, len(prompt):].tolist(), time.perf_counter() - started


def run_peer(model: Any, peer: str, prompts: list[list[int]], max_tokens: int, eos_ids: tuple[int, ...], k: int,
             device: torch.device) -> dict[str, Any]:
    full = generation_config(peer, max_tokens, eos_ids, k, device)
    first = copy.deepcopy(full)
    first.max_new_tokens = 1
    started = time.perf_counter()
    if peer == "hf_static_compiled":
        timed_generate(model, max(prompts, key=len), full, device)  # compiles; sizes the static cache
    timed_generate(model, prompts[0], first, device)
    timed_generate(model, prompts[0], full, device)  # warm: allocator, kernels, CUDA graphs recorded
    setup_s = time.perf_counter() - started
    outputs, ttft, tpot, total = [], [], [], 0.0
    for prompt in tqdm(prompts, desc=peer, unit="req", file=sys.stderr, disable=None):
        _, first_s = timed_generate(model, prompt, first, device)
        out, elapsed = timed_generate(model, prompt, full, device)
        outputs.append(out)
        total += elapsed
        ttft.append(first_s)
        if len(out) > 1:
            tpot.append(max(elapsed - first_s, 0.0) / (len(out) - 1))
    generated = sum(len(o) for o in outputs)
    return {
        "peer": peer,
        "num_requests": len(prompts),
        "generated_tokens": generated,
        "elapsed_s": total,
        "tokens_per_s": generated / total,
        "tpot_p50_ms": ms(percentile(tpot, 50)),
        "tpot_p99_ms": ms(percentile(tpot, 99)),
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "setup_s": setup_s,
        "outputs": outputs,
    }


def run_peers(model_name: str, prompts: list[list[int]], max_tokens: int, eos_ids: tuple[int, ...], k: int,
              dtype: torch.dtype, device: torch.device) -> dict[str, dict[str, Any]]:
    print(f"bench decode: HF transformers peers on {len(prompts)} prompts ({device}, {dtype})", file=sys.stderr)
    started = time.perf_counter()
    model = load(model_name, dtype, device)
    load_s = time.perf_counter() - started
    try:
        peers = {peer: run_peer(model, peer, prompts, max_tokens, eos_ids, k, device) for peer in PEERS}
    finally:
        del model
        torch._dynamo.reset()  # compiled code holds the model
        gc.collect()
        if device.type != "cpu":
            torch.get_device_module(device.type).empty_cache()
    for p in peers.values():
        p["load_s"] = load_s
    return peers
