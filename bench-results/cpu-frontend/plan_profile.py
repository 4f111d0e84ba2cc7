"""Host time of the runner's step plan (`ModelRunner.plan`: plan columns, host tokens and the
attention backend's prepare) for a decode frame of ROWS rows, on the CPU, with the plan buffer laid
out as the Triton backend lays it on a GPU (its prepare plans nothing on the host beyond the shared
buffer). Run with the tree to measure first on PYTHONPATH."""
import sys
import time

from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.ops.paged_attention import TritonPagedAttention
from speckernel.sampling_params import SamplingParams
from speckernel.wire.messages import AddRequest

core = EngineCore(EngineConfig(platform="cpu", max_model_len=512, max_num_seqs=64, adaptive_speculation=False))
for rows in (1, 16, 64):
    keys = [1000 * rows + key for key in range(rows)]
    for key in keys:
        core.add_request(AddRequest(key, [1 + (key * 37 + i * 11) % 400 for i in range(20)],
                                    SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)))
    for _ in range(3):
        core.step()
    frame = core.scheduler.schedule()
    runner = core.runner
    eager = runner.attention.__class__
    runner.attention.__class__ = TritonPagedAttention  # the GPU's layout, for the timing only
    n = 3000 if rows < 64 else 1000
    for _ in range(100):
        runner.plan(frame, None)
    t = time.perf_counter()
    for _ in range(n):
        runner.plan(frame, None)
    print(f"rows={rows} plan {(time.perf_counter() - t) / n * 1e6:.1f} us", file=sys.stdout)
    runner.attention.__class__ = eager
    core.ledger.submit(frame)
    core._apply(core.execute(frame), frame, 0.0)
    core.abort(keys)
    for _ in range(2):
        core.step()
