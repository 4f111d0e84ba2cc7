"""Token sampling on the device: greedy, temperature, top-k, top-p, for a whole batch at once.

Every row's parameters are device tensors (`SamplingTensors`), so one fixed sequence of kernels
serves any mix of rows: no Python loop over rows, no host sync, no data-dependent shape, which
is what lets a step be captured in a CUDA graph. Two host-known flags only choose which kernels
run (argmax alone for an all-greedy batch; the sort for top-k/top-p only when some row filters);
they never change a row's result, so a caller may set them conservatively. A third,
`any_penalty`, runs the penalties (`penalties`) on the raw logits first; rows without any are left
as they were, but the counts they need must be given (`TokenCounts`).

Randomness is counter-based: the noise for vocabulary entry v of a row's output token number
`position` is a hash of (seed, position, v), computed with 64-bit integer ops (a splitmix64
finaliser). A seeded request therefore draws the same tokens whatever else shares its batch, in
any order, after preemption, and on CPU and GPU alike: the hash and the uniforms are exact on
every device, and the noise E = -log(u) is a float64 log rounded to float32, which agreed bit for
bit between CPU and CUDA for all 2**23 possible u (a float32 log did not). A token is the winner
of an exponential race, argmax_v p(v) / E(v), which is an exact sample of p; `race_triton` fuses
noise and race into one pass and picks the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling_params import MIN_TEMPERATURE, RowSampling
from .penalties import TokenCounts, apply_penalties
from .step_plan import ROW_SAMPLING, Col, DevicePlan, Scheme

MIX = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch accepts (same bits)."""
    return x - 2**64 if x >= 2**63 else x


_GOLDEN = _signed(MIX)  # splitmix64's Weyl increment
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_UNIT_BITS = 23
"""Bits per uniform: (m + 0.5) / 2**23 with m < 2**23 is exact in float32, so u is bit-identical
on every device and strictly inside (0, 1), which keeps -log(u) finite and positive."""


def target_noise(seed: int, position: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] the Exp(1) noise the target's sampler races with for output token `position` of a
    request with `seed`. A drafter that draws its draft there as argmax q / noise couples its
    draft with the target's sample: verification keeps the draft exactly when the target draws
    the same token, so tokens never depend on the drafts (and q close to p keeps most of them)."""
    s = torch.tensor([seed], dtype=torch.int64, device=device)
    return exponential_noise(s, torch.tensor([position], dtype=torch.int64, device=device), vocab_size)[0]


# --- Counter-based random numbers ----------------------------------------------------------------------------


def _lshr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask off the copied sign bits)."""
    return torch.bitwise_right_shift(x, s).bitwise_and_((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection of 64-bit ints (int64 multiply wraps, as it must)."""
    x = (x ^ _lshr(x, 30)) * _M1
    x = (x ^ _lshr(x, 27)) * _M2
    return x ^ _lshr(x, 31)


def _top_bits(x: torch.Tensor) -> torch.Tensor:
    """The top 23 bits of _mix(x), in [0, 2**23); x is consumed (in place). The last xor-shift of
    _mix leaves the top 33 bits alone, so it is skipped."""
    x ^= _lshr(x, 30)
    x *= _M1
    x ^= _lshr(x, 27)
    x *= _M2
    return _lshr(x, 64 - _UNIT_BITS)


def exponential_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 -log(u) for u = (bits + 0.5) / 2**23. The log runs in float64 and is rounded once to
    float32: float32 logs differ between CPU and CUDA in the last bit for about 8% of the u, while
    the rounded float64 logs agreed for every one of the 2**23 (torch CPU against an H200; the
    CUDA test checks it again on whatever GPU runs it)."""
    return bits.double().add_(0.5).mul_(2.0**-_UNIT_BITS).log_().neg_().float()


def stream_key(seed: torch.Tensor, position: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """int64 key of the random stream for output token `position` of a request (broadcasts)."""
    return _mix(_mix(seed ^ salt) + position * _GOLDEN)


def uniform(seed: torch.Tensor, position: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """One float32 uniform in (0, 1) per (seed, position) (entry 0 of that stream)."""
    return _top_bits(stream_key(seed, position, salt) + _GOLDEN).float().add_(0.5).mul_(2.0**-_UNIT_BITS)


def exponential_noise(seed: torch.Tensor, position: torch.Tensor, vocab_size: int, salt: int = 0) -> torch.Tensor:
    """[N, V] float32 Exp(1) noise; entry v is -log(u) of entry v of stream (seed[n], position[n], salt)."""
    key = stream_key(seed, position, salt)
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device) * _GOLDEN
    return exponential_from_bits(_top_bits(key[:, None] + index[None, :]))


_RACE_KERNEL = None
RACE_BLOCK = 1024
RACE_PROGRAMS = 2048
"""The fused race splits each row's vocabulary so that about this many programs run."""


def _race_kernel():  # type: ignore[no-untyped-def]
    """Hash, noise, p / E and a running argmax in one pass over p: the torch race writes and reads
    [N, V] int64 temporaries a dozen times. Same integer ops, float64 log rounded to float32, and
    correctly rounded division, so it picks exactly the token `race` picks."""
    global _RACE_KERNEL
    if _RACE_KERNEL is None:
        import triton  # triton is optional (Linux x86-64): imported where its kernels are built
        import triton.language as tl

        @triton.jit(do_not_specialize=["N", "CHUNK"])  # both move with the row count
        def race_kernel(p_ptr, stride, key_ptr, best_ptr, index_ptr, N, V, CHUNK,  # type: ignore[no-untyped-def]  # @triton.jit reads annotations itself
                        GOLDEN: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
            # A [ROWS, BLOCK] tile: ROWS rows (many when V is small) over one vocabulary split.
            row_ids = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
            rows = row_ids[:, None]
            split = tl.program_id(1)
            key = tl.load(key_ptr + rows, mask=rows < N, other=0)
            best = tl.full((ROWS,), -1.0, tl.float32)
            best_index = tl.full((ROWS,), 0, tl.int64)
            lo = split * CHUNK
            hi = tl.minimum(lo + CHUNK, V)
            for start in range(lo, hi, BLOCK):
                v = start + tl.arange(0, BLOCK)[None, :]
                live = (v < hi) & (rows < N)
                p = tl.load(p_ptr + rows * stride + v, mask=live, other=0.0)
                x = key + (v + 1).to(tl.int64) * GOLDEN
                x = x ^ ((x >> 30) & 0x3FFFFFFFF)
                x = x * M1
                x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
                x = x * M2
                u = (((x >> 41) & 0x7FFFFF).to(tl.float64) + 0.5) * 1.1920928955078125e-07
                e = (-tl.log(u)).to(tl.float32)
                score = tl.where(live, tl.math.div_rn(p, e), -1.0)
                block_best = tl.max(score, 1)
                better = block_best > best  # strict: the first maximum wins, as in torch.argmax
                best_index = tl.where(better, tl.argmax(score, 1).to(tl.int64) + start, best_index)
                best = tl.where(better, block_best, best)
            out = row_ids * tl.num_programs(1) + split
            tl.store(best_ptr + out, best, mask=row_ids < N)
            tl.store(index_ptr + out, best_index, mask=row_ids < N)

        _RACE_KERNEL = race_kernel
    return _RACE_KERNEL


def race_triton(probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """`race` as one Triton kernel (plus an argmax over the vocabulary splits)."""
    import triton  # triton is optional (Linux x86-64): imported where its kernels are built

    n, v = probs.shape
    block = min(RACE_BLOCK, triton.next_power_of_2(v))
    rows = RACE_BLOCK // block  # > 1 only for a small vocabulary (tests)
    splits = max(1, min(triton.cdiv(RACE_PROGRAMS * rows, max(n, 1)), triton.cdiv(v, block)))
    chunk = triton.cdiv(triton.cdiv(v, splits), block) * block
    splits = triton.cdiv(v, chunk)
    probs = probs.float()
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    best = torch.empty((n, splits), dtype=torch.float32, device=probs.device)
    index = torch.empty((n, splits), dtype=torch.int64, device=probs.device)
    if n:
        _race_kernel()[(triton.cdiv(n, rows), splits)](
            probs, probs.stride(0), stream_key(seed, position).contiguous(), best, index, n, v, chunk,
            GOLDEN=_GOLDEN, M1=_M1, M2=_M2, ROWS=rows, BLOCK=block)
    return index.gather(-1, best.argmax(-1, keepdim=True))[:, 0]


# --- Per-row parameters as tensors ---------------------------------------------------------------------------


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors, so one batch of kernels serves every row."""

    temperature: torch.Tensor
    """[R] float32; below MIN_TEMPERATURE (0 included) the row is greedy."""
    top_k: torch.Tensor
    """[R] int64, 0 = off (so is k >= V)."""
    top_p: torch.Tensor
    """[R] float32, 1.0 = off."""
    seed: torch.Tensor
    """[R] int64, any value in [0, 2**63)."""
    position: torch.Tensor
    """[R] int64: index of the output token this row samples (its first, when verifying)."""
    all_greedy: bool
    """Host-known: every row is greedy, so only argmax runs. False is always safe."""
    any_filter: bool
    """Host-known: some sampled row has top_k > 0 or top_p < 1, so the sort runs. True is always safe."""
    repetition_penalty: torch.Tensor | None = None
    """[R] float32, 1.0 = off; None: every row's is off (so are the two below)."""
    frequency_penalty: torch.Tensor | None = None
    """[R] float32, 0.0 = off."""
    presence_penalty: torch.Tensor | None = None
    """[R] float32, 0.0 = off."""
    any_penalty: bool = False
    """Host-known: some row has a penalty, so the counts are read and the penalties run (the three
    tensors above are then set). True is always safe, given the counts."""

    @classmethod
    def from_plan(cls, plan: DevicePlan, scheme: Scheme, all_greedy: bool, any_filter: bool,
                  any_penalty: bool) -> SamplingTensors:
        """The sampling columns of a step plan on the device (`step_plan`), and what the host
        knows of its rows."""
        return cls(temperature=scheme.of(plan, Col.TEMPERATURE), top_k=scheme.of(plan, Col.TOP_K),
                   top_p=scheme.of(plan, Col.TOP_P), seed=scheme.of(plan, Col.SEED),
                   position=scheme.of(plan, Col.POSITION), all_greedy=all_greedy, any_filter=any_filter,
                   repetition_penalty=scheme.of(plan, Col.REPETITION),
                   frequency_penalty=scheme.of(plan, Col.FREQUENCY), presence_penalty=scheme.of(plan, Col.PRESENCE),
                   any_penalty=any_penalty)

    @classmethod
    def from_rows(cls, rows: Sequence[RowSampling], device: torch.device | str,
                  pad_to: int | None = None) -> SamplingTensors:
        """Packs the rows into a host plan (its int and float columns) and sends it without
        blocking. Rows past len(rows), up to pad_to, are greedy padding: harmless, and they keep
        the shape fixed."""
        plan = ROW_SAMPLING.empty(max(len(rows), pad_to or 0))  # padding: greedy, every filter and penalty off
        ROW_SAMPLING.put_sampling(plan, slice(0, len(rows)), rows)
        sampled = [s for s in rows if not is_greedy(s.temperature)]
        return cls.from_plan(plan.to(torch.device(device)), ROW_SAMPLING, all_greedy=not sampled,
                             any_filter=any(s.top_k > 0 or s.top_p < 1.0 for s in sampled),
                             any_penalty=any(s.penalized for s in rows))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy(self) -> torch.Tensor:
        """[R] bool: rows that take the argmax (temperature 0, or so small that dividing by it overflows)."""
        return self.temperature < MIN_TEMPERATURE

    def columns(self, n: int) -> SamplingTensors:
        """R * n rows: row r's n consecutive output tokens (position + j), r-major, as verification
        samples them. Each is exactly the row plain sampling would use for that output token."""
        def rep(t: torch.Tensor) -> torch.Tensor:
            return t[:, None].expand(-1, n).contiguous().view(-1)

        def rep_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else rep(t)

        offsets = torch.arange(n, dtype=torch.int64, device=self.position.device)
        return SamplingTensors(temperature=rep(self.temperature), top_k=rep(self.top_k), top_p=rep(self.top_p),
                               seed=rep(self.seed), position=(self.position[:, None] + offsets).reshape(-1),
                               all_greedy=self.all_greedy, any_filter=self.any_filter,
                               repetition_penalty=rep_or_none(self.repetition_penalty),
                               frequency_penalty=rep_or_none(self.frequency_penalty),
                               presence_penalty=rep_or_none(self.presence_penalty), any_penalty=self.any_penalty)

    def copy_(self, src: SamplingTensors) -> None:
        """Fills these (static, e.g. graph-captured) tensors from src of the same row count. A graph
        captured with flags (all_greedy, any_filter) serves src when src.all_greedy or not
        all_greedy, and not src.any_filter or any_filter."""
        for name in ("temperature", "top_k", "top_p", "seed", "position", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            mine, theirs = getattr(self, name), getattr(src, name)
            if mine is not None and theirs is not None:
                mine.copy_(theirs, non_blocking=True)

    def penalize(self, logits: torch.Tensor, counts: TokenCounts | None) -> torch.Tensor:
        """logits [R, V] with each row's penalties applied (float32), or as given when no row has any."""
        if not self.any_penalty:
            return logits
        if counts is None or self.repetition_penalty is None or self.frequency_penalty is None \
                or self.presence_penalty is None:
            raise ValueError("a step with penalties needs their values and the token counts")
        return apply_penalties(logits, counts, self.repetition_penalty, self.frequency_penalty,
                               self.presence_penalty)


def is_greedy(temperature: float) -> bool:
    return temperature < MIN_TEMPERATURE


def as_sampling_tensors(sampling: SamplingTensors | Sequence[RowSampling], device: torch.device) -> SamplingTensors:
    """Callers may still pass a list of RowSampling (a host-side convenience; not graph-capturable)."""
    return sampling if isinstance(sampling, SamplingTensors) else SamplingTensors.from_rows(sampling, device)


# --- The distribution each row samples from -----------------------------------------------------------------


def filtered_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[N, V] logits / temperature with the tokens top-k and top-p drop at -inf, all rows from one
    sort (only when st.any_filter). Greedy rows are scaled by 1: their values are not used.
    Matches `filter_logits` row by row: ties at the k-th value are kept, then top-p keeps the
    smallest prefix (in sorted order, of the top-k survivors) whose mass reaches top_p."""
    temperature = torch.where(st.greedy, 1.0, st.temperature)
    scaled = logits.float() / temperature[:, None]
    if not st.any_filter:
        return scaled
    v = scaled.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    k = torch.where((st.top_k > 0) & (st.top_k < v), st.top_k, v).long()
    kth = ordered.gather(-1, (k - 1)[:, None])
    keep = ordered >= kth  # a prefix of the sorted row: the top k and every tie of the k-th
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ahead: the prefix reaching top_p ends where it >= top_p
    keep &= ~((before >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None])
    keep[:, 0] = True  # the top token always stays (guards a top_p of 0 against an empty row)
    return scaled.masked_fill(~torch.zeros_like(keep).scatter_(-1, order, keep), float("-inf"))


def probs_on_device(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[N, V] float32: the distribution each sampled row draws from (and verification compares
    drafts against). Greedy rows get the unscaled softmax: callers use their argmax instead."""
    return filtered_logits(logits, st).softmax(-1)


def race(probs: torch.Tensor, st: SamplingTensors, use_triton: bool = False) -> torch.Tensor:
    """[N] exact samples of probs [N, V] (any non-negative weights): the exponential race
    argmax p / E with each row's (seed, position) noise. Both paths pick the same token."""
    if use_triton:
        return race_triton(probs, st.seed, st.position)
    return (probs / exponential_noise(st.seed, st.position, probs.shape[-1])).argmax(-1)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [..., W] -> bool [..., V]: bit v % 32 of word v // 32 allows token v (the
    layout grammar engines write). An all-ones word (-1) allows all 32 of its tokens."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[..., None] >> bits) & 1).bool().flatten(-2)[..., :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """logits [..., V] with the tokens a structured-output grammar forbids at -inf (bitmask
    [..., W], one row per sampled position); None leaves them as they are."""
    if bitmask is None:
        return logits
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def sample_on_device(logits: torch.Tensor, st: SamplingTensors | Sequence[RowSampling],
                     use_triton: bool = False, bitmask: torch.Tensor | None = None,
                     counts: TokenCounts | None = None) -> torch.Tensor:
    """logits [R, V] -> [R] int64 tokens on the device; graph-capturable when st is SamplingTensors.
    use_triton fuses the noise into the race (one pass over p instead of a dozen); bitmask [R, W]
    restricts each row to the tokens its grammar allows; counts: what the rows said so far, needed
    when st.any_penalty. Penalties change the raw logits first; a forbidden token stays at -inf."""
    st = as_sampling_tensors(st, logits.device)
    logits = apply_token_bitmask(st.penalize(logits, counts), bitmask)
    greedy = logits.argmax(-1)
    if st.all_greedy:
        return greedy
    return torch.where(st.greedy, greedy, race(probs_on_device(logits, st), st, use_triton))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] raw model logits, tokens [...] the tokens chosen there (-1: none, any
    value comes back) -> ([..., 1 + n] float32: the chosen token's logprob, then the n largest;
    [..., n] int64: their ids). Raw, as vLLM reports by default: log_softmax of the model's
    logits, before penalties, temperature, top-k/top-p and grammar, so the numbers do not depend
    on how the token was drawn, and a verified position gives what a plain decode step gives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens.clamp(min=0)[..., None])
    top = logprobs.topk(n, dim=-1)
    return torch.cat([chosen, top.values], dim=-1), top.indices


def sample(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[int]:
    """logits: [R, V], one row per sampling request; the tokens reach the host."""
    return sample_on_device(logits, rows).tolist()


# --- Per-row references (host-driven, for tests and one-off use) ---------------------------------------------


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] already divided by the temperature. The reference `filtered_logits` matches."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """[V]: the distribution one row samples from; one-hot at the argmax for a greedy row."""
    if is_greedy(s.temperature):
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits.float() / s.temperature, s.top_k, s.top_p).softmax(-1)
