"""dflash:K (or SPEC) on the GPU through EngineCore.step: wall ms a step at 16 then 64 rows; with
PROF=1 a torch.profiler window at 16 rows (device kernels and host ops by count)."""
import collections
import os
import sys
import time

import torch

import speckernel
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest

spec = sys.argv[1] if len(sys.argv) > 1 else "dflash"
k = int(sys.argv[2]) if len(sys.argv) > 2 else 7
print("tree:", speckernel.__file__, spec, k, flush=True)
torch.manual_seed(0)
cfg = dict(platform="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=64, adaptive_speculation=False)
if spec != "none":
    cfg |= dict(speculator=spec, num_speculative_tokens=k)
t0 = time.perf_counter()
core = EngineCore(EngineConfig(**cfg))
print("start s %.1f" % (time.perf_counter() - t0), flush=True)


def add(lo, hi):
    for key in range(lo, hi):
        core.add_request(AddRequest(key, [1 + (key * 37 + i * 11) % 400 for i in range(40)],
                                    SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)))


def walls(rows):
    for _ in range(30):
        core.step()
    torch.cuda.synchronize()
    g0 = core.stats().get("num_graph_steps", 0)
    ws, hs = [], []
    for _ in range(5):
        t = time.perf_counter()
        host = 0.0
        for _ in range(40):
            h = time.perf_counter()
            core.step()
            host += time.perf_counter() - h
        torch.cuda.synchronize()
        ws.append((time.perf_counter() - t) / 40 * 1e3)
        hs.append(host / 40 * 1e3)
    g = core.stats().get("num_graph_steps", 0) - g0
    print(f"rows {rows}: wall ms a step {' '.join(f'{w:.3f}' for w in ws)} median {sorted(ws)[2]:.3f}"
          f" | in step() {sorted(hs)[2]:.3f} | graph steps {g}/200", flush=True)


add(0, 16)
walls(16)
if os.environ.get("PROF"):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            core.step()
        torch.cuda.synchronize()
    cuda, cpu = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" or (dev and not e.key.startswith(("aten::", "cuda", "Memcpy"))):
            cuda[e.key] = (e.count, dev / 1e3)
        else:
            cpu[e.key] = (e.count, e.self_cpu_time_total / 1e3)
    print("== device kernels over 20 steps: count, ms")
    for name, (n, ms) in sorted(cuda.items(), key=lambda kv: -kv[1][1])[:45]:
        print(f"{n:6d} {ms:9.3f}  {name[:120]}")
    print("TOTAL kernels", sum(n for n, _ in cuda.values()), "device ms", round(sum(ms for _, ms in cuda.values()), 3))
    print("== host ops over 20 steps: count, self ms")
    for name, (n, ms) in sorted(cpu.items(), key=lambda kv: -kv[1][1])[:45]:
        print(f"{n:6d} {ms:9.3f}  {name[:120]}")
    print("TOTAL host ops", sum(n for n, _ in cpu.values()))
add(16, 64)
walls(64)
