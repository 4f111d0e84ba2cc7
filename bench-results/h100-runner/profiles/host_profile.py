"""cProfile of EngineCore.step at ROWS rows on the GPU (no frontend): where launch's host time goes."""
import cProfile
import io
import pstats
import sys
import time

import torch

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest

spec, k, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = dict(platform="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=64, adaptive_speculation=False)
if spec != "none":
    cfg |= dict(speculator=spec, num_speculative_tokens=k)
core = EngineCore(EngineConfig(**cfg))
for key in range(rows):
    core.add_request(AddRequest(key, [1 + (key * 37 + i * 11) % 400 for i in range(40)],
                                SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)))
for _ in range(40):
    core.step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(100):
    core.step()
torch.cuda.synchronize()
print(spec, rows, "wall ms a step %.3f" % ((time.perf_counter() - t) * 10))
pr = cProfile.Profile()
pr.enable()
for _ in range(100):
    core.step()
pr.disable()
s = io.StringIO()
st = pstats.Stats(pr, stream=s)
st.sort_stats("tottime").print_stats(35)
st.sort_stats("cumtime").print_stats(45)
print(s.getvalue())
