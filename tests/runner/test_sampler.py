"""Sampling: greedy, filters, seeded reproducibility, the distribution it draws from, and the
device contract (one batch of kernels for every row, no host sync, graph capture)."""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speckernel.errors import InvalidSamplingParamsError
from speckernel.runner import sampler
from speckernel.runner.sampler import (
    SamplingTensors,
    exponential_from_bits,
    exponential_noise,
    filter_logits,
    filtered_logits,
    probs_on_device,
    race,
    sample,
    sample_on_device,
    stream_key,
    uniform,
)
from speckernel.runner.verify import verify
from speckernel.sampling_params import RowSampling, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton needs a GPU or TRITON_INTERPRET=1")


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def random_rows(n: int, seed: int, greedy: float = 0.2, filtered: float = 0.5) -> list[RowSampling]:
    """Rows with mixed parameters: greedy (some with a tiny temperature), top-k, top-p, both."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        t = 0.0 if rng.random() < greedy else float(rng.uniform(0.3, 2.0))
        if t == 0.0 and rng.random() < 0.5:
            t = 1e-45
        k = int(rng.choice([1, 2, 5, 40, 10_000])) if rng.random() < filtered else 0
        p = float(rng.uniform(0.05, 0.99)) if rng.random() < filtered else 1.0
        rows.append(RowSampling(t, k, p, seed=int(rng.integers(0, 2**63)), position=int(rng.integers(0, 2**40))))
    return rows


# --- Greedy and the distribution ----------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100)
    rows = [RowSampling(0.0, 0, 1.0, seed=i, position=0) for i in range(5)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_sampled_batch_take_the_argmax() -> None:
    logits = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * 4
    rows = random_rows(200, seed=1, greedy=0.5)
    got = torch.tensor(sample(logits, rows))
    greedy = torch.tensor([r.temperature < 1e-5 for r in rows])
    assert greedy.sum() > 50
    assert torch.equal(got[greedy], logits.argmax(-1)[greedy])


GROUPS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8), (0.9, 4, 0.7), (2.0, 1, 1.0)]
N_PER_GROUP = 6000


@functools.cache
def mixed_draws() -> np.ndarray:
    """[groups, N] tokens from ONE batch where each group of rows has its own temperature, top-k
    and top-p, all drawn at once: per-row filters from one sort."""
    rows = [RowSampling(t, k, p, seed=s, position=7) for t, k, p in GROUPS for s in range(N_PER_GROUP)]
    logits = LOGITS.expand(len(rows), -1).clone()
    return np.array(sample(logits, rows)).reshape(len(GROUPS), N_PER_GROUP)


@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_samples_follow_the_filtered_distribution(group: int) -> None:
    temperature, top_k, top_p = GROUPS[group]
    counts = np.bincount(mixed_draws()[group], minlength=len(LOGITS))
    probs = filter_logits(LOGITS / temperature, top_k, top_p).softmax(-1).numpy()
    assert np.all(counts[probs == 0] == 0), "a filtered-out token was sampled"
    dof = int((probs > 0).sum()) - 1
    # 99.9% quantile of chi-square with <= 5 degrees of freedom is about 20.5.
    assert chi_square(counts, probs) < 20.5 + 2 * dof


@pytest.mark.parametrize("stream", ["positions", "large_seeds"])
def test_one_seed_across_positions_and_the_largest_seeds_follow_the_distribution(stream: str) -> None:
    """One request's successive tokens (seed fixed, position varies) and seeds at the top of the
    int64 range are as random as seeds 0..N at one position."""
    n = 6000
    if stream == "positions":
        rows = [RowSampling(1.0, 0, 1.0, seed=7, position=p) for p in range(n)]
    else:
        rows = [RowSampling(1.0, 0, 1.0, seed=2**63 - 1 - s, position=0) for s in range(n)]
    counts = np.bincount(sample(LOGITS.expand(n, -1).clone(), rows), minlength=len(LOGITS))
    assert chi_square(counts, LOGITS.softmax(-1).numpy()) < 20.5 + 10


def test_top_p_keeps_smallest_prefix() -> None:
    probs = filter_logits(LOGITS, 0, 0.5).softmax(-1)
    assert (probs > 0).sum() == 1  # the top token alone has p > 0.5
    probs = filter_logits(LOGITS, 0, 0.7).softmax(-1)
    assert (probs > 0).sum() == 2


def test_batched_filters_keep_what_the_per_row_reference_keeps() -> None:
    """Per-row temperature, top-k (off, 1, small, >= V) and top-p from one sort, against
    `filter_logits` row by row."""
    g = torch.Generator().manual_seed(3)
    rows = random_rows(300, seed=3, greedy=0.0, filtered=0.6)
    logits = torch.randn(len(rows), 500, generator=g) * 3
    got = filtered_logits(logits, SamplingTensors.from_rows(rows, "cpu"))
    for i, s in enumerate(rows):
        want = filter_logits(logits[i] / s.temperature, s.top_k, s.top_p)
        assert torch.equal(got[i].isfinite(), want.isfinite()), f"row {i}: {s}"
        assert torch.allclose(got[i][want.isfinite()], want[want.isfinite()])


def test_top_k_keeps_every_tie_of_the_kth_value() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0], [3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    rows = [RowSampling(1.0, 2, 1.0, 0, 0), RowSampling(1.0, 0, 1.0, 0, 0)]
    kept = filtered_logits(logits, SamplingTensors.from_rows(rows, "cpu")).isfinite()
    assert kept.tolist() == [[True, False, True, True, False, True], [True] * 6]
    assert torch.equal(kept[0], filter_logits(logits[0], 2, 1.0).isfinite())


# --- Reproducibility -----------------------------------------------------------------------------------------


def test_seeded_draws_repeat_and_depend_on_position() -> None:
    logits = torch.randn(1, 1000)
    a = [sample(logits, [RowSampling(1.0, 0, 1.0, seed=7, position=p)])[0] for p in range(20)]
    b = [sample(logits, [RowSampling(1.0, 0, 1.0, seed=7, position=p)])[0] for p in range(20)]
    c = [sample(logits, [RowSampling(1.0, 0, 1.0, seed=8, position=p)])[0] for p in range(20)]
    assert a == b and a != c and len(set(a)) > 1


def test_a_row_draws_the_same_token_whatever_shares_its_batch() -> None:
    """Same (seed, position, logits, parameters): same token alone, in a shuffled batch with
    other kinds of rows, with greedy padding, and with conservative flags."""
    g = torch.Generator().manual_seed(4)
    rows = random_rows(64, seed=4, greedy=0.1)
    logits = torch.randn(len(rows), 400, generator=g) * 2
    alone = [sample(logits[i : i + 1], [s])[0] for i, s in enumerate(rows)]
    others = random_rows(64, seed=5)
    other_logits = torch.randn(len(others), 400, generator=g) * 2
    order = torch.randperm(2 * len(rows), generator=g)
    batch = torch.cat([logits, other_logits])[order]
    batch_rows = [(rows + others)[i] for i in order.tolist()]
    st = SamplingTensors.from_rows(batch_rows, "cpu", pad_to=160)
    st.all_greedy, st.any_filter = False, True
    padded = torch.cat([batch, torch.randn(160 - len(batch_rows), 400, generator=g)])
    got = sample_on_device(padded, st)[: len(batch_rows)]
    where = order.argsort()[: len(rows)]
    assert got[where].tolist() == alone


def test_flags_choose_kernels_not_results() -> None:
    """all_greedy=False and any_filter=True are always safe: they change no row's token."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(100, 300, generator=g)
    for rows in (random_rows(100, seed=6, filtered=0.0), [RowSampling(0.0, 3, 0.5, i, i) for i in range(100)]):
        st = SamplingTensors.from_rows(rows, "cpu")
        want = sample_on_device(logits, st)
        st.all_greedy, st.any_filter = False, True
        assert torch.equal(sample_on_device(logits, st), want)


# --- Edge values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 9.99e-6])
def test_a_tiny_temperature_samples_greedily_without_nan(temperature: float) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(8)) * 100
    rows = [RowSampling(temperature, k, p, seed=i, position=i) for i, (k, p) in
            enumerate([(0, 1.0), (5, 1.0), (0, 0.5), (3, 0.9)] * 2)]
    st = SamplingTensors.from_rows(rows, "cpu")
    assert st.all_greedy and bool(st.greedy.all())
    assert sample(logits, rows) == logits.argmax(-1).tolist()
    st.all_greedy = False  # the general path must agree, and compute nothing undefined
    assert not probs_on_device(logits, st).isnan().any()
    assert torch.equal(sample_on_device(logits, st), logits.argmax(-1))
    tokens, nacc = verify(logits[:, None], torch.empty(8, 0, dtype=torch.int64), st)
    assert torch.equal(tokens[:, 0], logits.argmax(-1)) and not nacc.any()


def test_the_smallest_sampling_temperature_is_finite() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9)) * 30
    st = SamplingTensors.from_rows([RowSampling(1e-5, 0, 0.9, seed=i, position=0) for i in range(4)], "cpu")
    assert not st.all_greedy and not st.greedy.any()
    assert probs_on_device(logits, st).isfinite().all()
    assert torch.equal(sample_on_device(logits, st), logits.argmax(-1))


def test_largest_seeds_and_positions_travel_exactly() -> None:
    rows = [RowSampling(1.0, 0, 1.0, seed=s, position=p)
            for s, p in [(2**63 - 1, 2**62), (2**63 - 2, 0), (0, 2**63 - 1), (1, 1)]]
    st = SamplingTensors.from_rows(rows, "cpu")
    assert st.seed.tolist() == [r.seed for r in rows] and st.position.tolist() == [r.position for r in rows]
    noise = exponential_noise(st.seed, st.position, 1000)
    assert noise.isfinite().all() and (noise > 0).all()
    assert len({tuple(row) for row in noise.tolist()}) == 4


def test_no_rows_and_empty_batches() -> None:
    assert sample(torch.zeros(0, 10), []) == []
    st = SamplingTensors.from_rows([], "cpu", pad_to=3)
    assert st.all_greedy and st.num_rows == 3 and st.greedy.all()


# --- The random stream --------------------------------------------------------------------------------------

MASK = 2**64 - 1


def splitmix64(x: int) -> int:
    x &= MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_uniform(seed: int, position: int, index: int, salt: int = 0) -> float:
    """Entry `index` of the stream (seed, position): a plain-Python statement of the hash. The
    value is exact in float32 and float64 alike."""
    key = splitmix64((splitmix64(seed ^ salt) + position * 0x9E3779B97F4A7C15) & MASK)
    bits = splitmix64(key + (index + 1) * 0x9E3779B97F4A7C15) >> 41
    return (bits + 0.5) / 2**23


def test_the_stream_is_the_documented_hash() -> None:
    """Pins the stream (changing it changes every seeded output) and checks torch's int64 ops
    wrap and shift as the hash needs, on whatever device runs the test."""
    device = "cuda" if CUDA else "cpu"
    cases = [(0, 0), (1, 0), (0, 1), (2**63 - 1, 2**63 - 1), (123456789, 42), (2**62 + 5, 10**12)]
    seed = torch.tensor([s for s, _ in cases], device=device)
    position = torch.tensor([p for _, p in cases], device=device)
    noise = exponential_noise(seed, position, 7)
    u = uniform(seed, position, salt=0x5EED)
    for n, (s, p) in enumerate(cases):
        want = torch.tensor([reference_uniform(s, p, v) for v in range(7)], dtype=torch.float64, device=device)
        assert torch.equal(noise[n], want.log().neg().float()), (s, p)
        assert u[n].item() == reference_uniform(s, p, 0, salt=0x5EED)
    key = stream_key(seed, position).cpu().tolist()
    assert [k & MASK for k in key] == [splitmix64((splitmix64(s) + p * 0x9E3779B97F4A7C15) & MASK) for s, p in cases]


@needs_triton
@pytest.mark.parametrize("programs", [1, 2048], ids=["one_split", "many_splits"])
@pytest.mark.parametrize(("n", "v"), [(16, 3000), (300, 5), (3, 1024)])
def test_the_fused_triton_race_picks_the_torch_race_token(n: int, v: int, programs: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Same noise bits, same float64 log, same rounding and division, first maximum on ties:
    token for token equal, with the vocabulary in one split (several blocks per program) or
    many, in row tiles, with zeros in p."""
    monkeypatch.setattr(sampler, "RACE_PROGRAMS", programs)
    g = torch.Generator().manual_seed(n + v)
    rows = random_rows(n, seed=n + v, greedy=0.0, filtered=0.7)
    st = SamplingTensors.from_rows(rows, DEVICE)
    p = probs_on_device((torch.randn(n, v, generator=g) * 3).to(DEVICE), st)
    assert (p == 0).any()
    assert torch.equal(race(p, st, use_triton=True), race(p, st))
    tied = torch.ones(n, v, device=DEVICE)  # every score is 1 / E: the noise alone decides
    assert torch.equal(race(tied, st, use_triton=True), race(tied, st))
    zero = torch.zeros(n, v, device=DEVICE)  # all scores tie at 0: the first index wins, across splits too
    assert race(zero, st, use_triton=True).tolist() == race(zero, st).tolist() == [0] * n
    logits = (torch.randn(n, v, generator=g) * 2).to(DEVICE)
    assert torch.equal(sample_on_device(logits, st, use_triton=True), sample_on_device(logits, st))


def test_uniforms_are_inside_the_open_interval_and_unbiased() -> None:
    u = uniform(torch.tensor([5]), torch.arange(200_000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert len(set(u.tolist())) > 195_000


# --- The device contract -------------------------------------------------------------------------------------

SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item",
               "repeat_interleave", "masked_scatter_"}


class OpLog(TorchDispatchMode):
    """Every aten op a call issues, and whether any would make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        lists = [a for a in args if isinstance(a, list | tuple)]
        bool_index = name.startswith("index") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for a in lists for t in a)
        if name in SYNCING_OPS or bool_index:
            self.syncing.append(str(func))
        return func(*args, **(kwargs or {}))


def op_log(fn: Callable[[], object]) -> OpLog:
    with OpLog() as log:
        fn()
    return log


def device_calls(rows: int, k: int, device: str) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(rows)
    st = SamplingTensors.from_rows(random_rows(rows, seed=rows, greedy=0.3), device)
    st.all_greedy, st.any_filter = False, True
    logits = torch.randn(rows, k + 1, 64, generator=g).to(device)
    drafts = torch.randint(-1, 64, (rows, k), generator=g).to(device)
    q = torch.rand(rows, k, 64, generator=g).softmax(-1).to(device)
    return {"sample": lambda: sample_on_device(logits[:, 0], st),
            "verify": lambda: verify(logits, drafts, st),
            "verify_q": lambda: verify(logits, drafts, st, q),
            "sample_triton": lambda: sample_on_device(logits[:, 0], st, use_triton=True),
            "verify_q_triton": lambda: verify(logits, drafts, st, q, use_triton=True)}


@pytest.mark.parametrize("call", ["sample", "verify", "verify_q"])
def test_one_batch_of_kernels_for_any_number_of_rows_and_no_host_sync(call: str) -> None:
    """The same ops, as many times, for 1 row as for 64 (no loop over rows), and none that
    reads a device value on the host (item, nonzero, boolean-mask indexing...)."""
    one, many = (op_log(device_calls(n, 3, "cpu")[call]) for n in (1, 64))
    assert one.ops == many.ops
    assert not many.syncing, many.syncing


@needs_cuda
@pytest.mark.parametrize("call", ["sample", "verify", "verify_q", "sample_triton", "verify_q_triton"])
def test_no_host_sync_on_cuda(call: str) -> None:
    fn = device_calls(64, 3, "cuda")[call]
    fn()  # warm-up outside the check (lazy initialisation may sync once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("any_filter", [False, True])
def test_sampling_and_verification_replay_in_a_cuda_graph(any_filter: bool) -> None:
    """Captured once on static buffers, replayed on new rows: the same tokens as eager calls."""
    r, k, v = 48, 3, 1000
    g = torch.Generator().manual_seed(11)

    def inputs(seed: int) -> tuple[SamplingTensors, torch.Tensor, torch.Tensor]:
        rows = random_rows(r, seed=seed, filtered=0.5 if any_filter else 0.0)
        st = SamplingTensors.from_rows(rows, "cuda")
        st.all_greedy, st.any_filter = False, any_filter
        return st, torch.randn(r, k + 1, v, generator=g).cuda(), torch.randint(-1, v, (r, k), generator=g).cuda()

    st, logits, drafts = inputs(0)
    q = torch.rand(r, k, v, generator=g).softmax(-1).cuda()

    def step() -> tuple[torch.Tensor, ...]:
        return (sample_on_device(logits[:, 0], st), sample_on_device(logits[:, 0], st, use_triton=True),
                *verify(logits, drafts, st, q), *verify(logits, drafts, st, q, use_triton=True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: Triton compiles, allocators settle
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        new_st, new_logits, new_drafts = inputs(seed)
        st.copy_(new_st)
        logits.copy_(new_logits)
        drafts.copy_(new_drafts)
        graph.replay()
        want = step()
        for got, w in zip(out, want, strict=True):
            assert torch.equal(got, w)


@needs_cuda
def test_noise_and_tokens_are_bit_identical_on_cpu_and_cuda() -> None:
    """The hash and the uniforms are integer/exact on any device; -log(u) goes through each
    device's float64 log, rounded to float32: compare it for every one of the 2**23 uniforms
    there are. Then whole draws, torch on CPU against torch and Triton on CUDA."""
    bits = torch.arange(2**23, dtype=torch.int64)
    assert torch.equal(exponential_from_bits(bits), exponential_from_bits(bits.cuda()).cpu())
    rng = np.random.default_rng(12)
    seed = torch.from_numpy(rng.integers(0, 2**63, 256))
    position = torch.from_numpy(rng.integers(0, 2**40, 256))
    assert torch.equal(uniform(seed, position), uniform(seed.cuda(), position.cuda()).cpu())
    on_cuda = exponential_noise(seed.cuda(), position.cuda(), 5000).cpu()
    assert torch.equal(exponential_noise(seed, position, 5000), on_cuda)
    st_cpu = SamplingTensors.from_rows(random_rows(256, seed=12, greedy=0.0, filtered=0.0), "cpu")
    st_cuda = SamplingTensors.from_rows(random_rows(256, seed=12, greedy=0.0, filtered=0.0), "cuda")
    p = torch.rand(256, 5000, generator=torch.Generator().manual_seed(12))  # the same p: only the noise can differ
    want = race(p, st_cpu)
    assert torch.equal(race(p.cuda(), st_cuda).cpu(), want)
    assert torch.equal(race(p.cuda(), st_cuda, use_triton=True).cpu(), want)


# --- Parameter validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=-0.1), SamplingParams(temperature=float("nan")), SamplingParams(max_tokens=0),
     SamplingParams(top_k=-1), SamplingParams(top_p=0.0), SamplingParams(top_p=1.01), SamplingParams(seed=-1),
     SamplingParams(stop=("",)), SamplingParams(stop_token_ids=(10**9,))],
)
def test_invalid_sampling_params_are_rejected_with_the_field_named(params: SamplingParams) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        params.validate(vocab_size=1000)
    field = str(info.value).split(":")[0]
    assert field in SamplingParams.__struct_fields__


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", True), ("max_tokens", 2**70), ("max_tokens", 3.0), ("top_k", True), ("seed", True),
     ("seed", 1.5), ("seed", 2**63), ("temperature", "0.5"), ("temperature", True), ("top_p", "1"),
     ("stop", (123,)), ("stop", "abc"), ("stop_token_ids", (1.0,)), ("stop_token_ids", (True,)),
     ("ignore_eos", 1)],
)
def test_values_the_core_could_not_decode_are_rejected_up_front(field: str, value: object) -> None:
    """Each of these once passed validate() and then hung the caller: the core could not
    decode the request and dropped it."""
    with pytest.raises(InvalidSamplingParamsError, match=f"^{field}: expected"):
        SamplingParams(**{field: value}).validate(vocab_size=1000)  # type: ignore[arg-type]


def test_validate_returns_exact_types_and_treats_a_tiny_temperature_as_greedy() -> None:
    got = SamplingParams(seed=np.int64(7), max_tokens=np.int32(5), temperature=np.float32(0.5),  # type: ignore[arg-type]
                         stop=["x"], stop_token_ids=[np.int64(3)]).validate(vocab_size=1000)  # type: ignore[arg-type]
    assert got == SamplingParams(seed=7, max_tokens=5, temperature=0.5, stop=("x",), stop_token_ids=(3,))
    assert type(got.seed) is int and type(got.max_tokens) is int and type(got.temperature) is float
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(got), type=SamplingParams) == got
    assert SamplingParams(temperature=1e-45).validate().temperature == 0.0
