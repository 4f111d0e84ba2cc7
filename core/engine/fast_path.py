"""What makes a runner the fast one, for the engine core's own runner and for every pipeline
stage alike: the model on the platform's kernels, its step graphs captured, every eager kernel
variant built before the first request. One place, so a stage is never a second, slower runner."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import log as logmod
from ..config import EngineConfig
from ..ops import packed_linear
from ..ops.jit_watch import WATCH as JIT_WATCH
from ..platform import Platform
from ..runner.step_graphs import StepGraphs, prefill_buckets, prompt_batch_buckets, warm_eager
from ..runner.step_shape import StepDevice

if TYPE_CHECKING:  # annotations only: the callers built them
    import torch

    from ..models.llama import LlamaModel

log = logmod.get("fast_path")


def use_kernels(model: LlamaModel, platform: Platform, config: EngineConfig, head: bool = True) -> None:
    """The model's layers on the platform's fused kernels (Triton where it runs), the small-batch
    kernels and the batch-invariant mode as configured, its weights packed where the platform asks
    for that (the LM head's too where this process runs it: `head`)."""
    if platform.capabilities.triton:
        model.use_triton_ops(True)
    model.use_small_batch_ops(config.small_batch_kernels)
    model.use_batch_invariant_ops(config.batch_invariant)
    pack_weights(model, platform, head)


def pack_weights(model: LlamaModel, platform: Platform, head: bool = True) -> None:
    """The model's linear weights (the LM head's with `head`) packed where the platform packs and
    their second copy fits the free memory; logged either way."""
    if not platform.capabilities.packed_weights:
        return
    weights = model.linear_weights(head)
    packed = packed_linear.worth_packing(weights, platform.memory_info()[0])
    model.use_packed_weights(packed, head)
    log.info("packed_weights", packed=packed, bytes=sum(w.numel() * w.element_size() for w in weights))


def capture_graphs(runner: StepDevice, platform: Platform, config: EngineConfig, max_model_len: int, k: int,
                   drafts_in_step: bool) -> StepGraphs | None:
    """Device graphs of decode and verification steps (verify width 0 or K) and of lone prompts,
    where the platform and the backend allow; None runs every step eagerly."""
    if not (platform.capabilities.supports_graphs and not config.enforce_eager
            and runner.attention.supports_padding and runner.attention.device_planned):
        return None
    max_tokens = min(config.max_num_batched_tokens, max_model_len)
    graphs = StepGraphs(runner, platform, config.max_num_seqs, verify_widths=(0, k),
                        propose_widths=(0, k) if drafts_in_step else (0,),
                        prefill_tokens=prefill_buckets(max_tokens),
                        prompt_batches=prompt_batch_buckets(config.max_num_seqs, config.max_num_batched_tokens)
                        if config.prompts_apart and config.prompt_batches else (),
                        constrained=runner.mask_widths if config.grammar_graphs else (),
                        full_sampling=(0, k) if config.sampling_graphs and runner.mask_widths else ())
    try:
        graphs.capture()
    except Exception:  # the engine still serves, eagerly; stats show no graph steps
        log.exception("graph_capture_failed")
        return None
    return graphs


def warm_kernels(runner: StepDevice, kv_layer: torch.Tensor, platform: Platform, num_heads: int, k: int,
                 max_tokens: int) -> int:
    """Builds every Triton kernel variant an eager step can launch (the graphs built theirs),
    then seals the watch: a variant built later is a stall while serving, counted in the stats
    and logged. kv_layer: one layer's KV cache. Returns the kernel builds so far (0 where Triton
    does not run)."""
    if not platform.capabilities.triton:
        return 0
    started = time.monotonic()
    launches = runner.attention.warm_up(kv_layer, num_heads)
    # An eager step verifies as many drafts as its rows hold (a grammar's forced ones included).
    steps = warm_eager(runner, range(max((k, *runner.mask_widths)) + 1), max_tokens)
    platform.synchronize()
    JIT_WATCH.seal()
    log.info("kernels_warm", attention_variants=launches, eager_steps=steps, kernel_builds=JIT_WATCH.num_compiles,
             seconds=round(time.monotonic() - started, 2))
    return JIT_WATCH.num_compiles
