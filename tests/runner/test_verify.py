"""Verification: the acceptance rule, Triton against torch, and lossless rejection sampling."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import msgspec
import numpy as np
import pytest
import torch

from speckernel.runner.sampler import SamplingTensors, sample, target_probs
from speckernel.runner.verify import accept_torch, accept_triton, verify
from speckernel.sampling_params import RowSampling

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(rows: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, 50, (rows, k), generator=g)
    drafts[torch.rand(rows, k, generator=g) < 0.15] = -1
    p_x = torch.rand(rows, k, generator=g)
    q_x = torch.rand(rows, k, generator=g) + 0.01
    u = torch.rand(rows, k, generator=g)
    final = torch.randint(0, 50, (rows, k + 1), generator=g)
    return tuple(t.to(DEVICE) for t in (drafts, p_x, q_x, u, final))


@pytest.mark.parametrize(("rows", "k"), [(1, 1), (7, 3), (33, 4), (5, 8), (3, 13)])
def test_triton_kernel_equals_torch_path(rows: int, k: int) -> None:
    for seed in range(5):
        case = random_case(rows, k, seed)
        want = accept_torch(*case)
        got = accept_triton(*case)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("temperature", [0.0, 1e-45])
@pytest.mark.parametrize("all_greedy", [True, False], ids=["argmax_only", "general_path"])
def test_greedy_accepts_the_matching_prefix_and_never_a_minus_one(temperature: float, all_greedy: bool) -> None:
    """A temperature too small to divide by is greedy too, on the argmax-only path and on the
    general one (a batch whose flags were set conservatively), without NaN."""
    v = 10
    target = torch.tensor([[3, 4, 5, 6], [3, 9, 5, 6], [1, 1, 1, 1]])  # argmax per position
    logits = torch.nn.functional.one_hot(target, v).float()[:, :, :] * 10
    drafts = torch.tensor([[3, 4, 5], [3, 4, 5], [-1, -1, -1]])
    st = SamplingTensors.from_rows([RowSampling(temperature, 0, 1.0, 0, 0)] * 3, DEVICE)
    assert st.all_greedy
    st.all_greedy = all_greedy
    q = torch.full((3, 3, v), 1.0 / v)
    for use_triton in (False, True):
        for probs in (None, q.to(DEVICE)):
            tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), st, probs, use_triton=use_triton)
            assert nacc.tolist() == [3, 1, 0]
            assert tokens.tolist() == [[3, 4, 5, 6], [3, 9, -1, -1], [1, -1, -1, -1]]


def test_bonus_token_when_every_draft_is_accepted() -> None:
    v = 5
    logits = torch.full((1, 3, v), -20.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 20.0  # p is (almost) one-hot
    drafts = torch.tensor([[1, 2]])
    q = torch.nn.functional.one_hot(drafts, v).float()
    tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), [RowSampling(1.0, 0, 1.0, 1, 0)], q.to(DEVICE))
    assert nacc.tolist() == [2] and tokens.tolist() == [[1, 2, 3]]


# --- Lossless rejection sampling, checked by Monte Carlo -------------------------------------------------------
#
# Each case fixes the target p_j at every position (the logits do not depend on the prefix) and a
# proposal q_j. Speculative sampling is lossless iff the emitted tokens are distributed exactly as
# plain sampling from p would emit them. Per position j, given position j is reached:
#   P(accept x_j = b)          = min(p_j(b), q_j(b))      (the draft is b, then kept)
#   P(reject, recovered = b)   = max(p_j(b) - q_j(b), 0)  (the residual, unnormalized)
# so t_j ~ p_j, the next position is reached with probability alpha_j = sum_b min(p_j, q_j), and the
# acceptances at different positions are independent. Every draw is one row of one batched `verify`
# call (rows are independent), each row with its own seed and position; the base seed is fixed, so
# the tests are deterministic. A check fails when its chi-square p-value is below ALPHA: with about
# ninety checks in the file, a correct `verify` fails one for an unlucky base seed with probability
# below 1e-5, while the effect of each known mutant is tens of standard deviations.

ALPHA = 1e-7
BASE_SEED = 20240917
N_ROWS = 6000
TEMPERATURE_1 = (1.0, 0, 1.0)
CASES: dict[str, tuple[np.ndarray, np.ndarray, tuple[float, int, float]]] = {
    # A drafter sampling from q != p. Most drafts are kept with probability 1/2 to 2/3, so acceptance
    # is random at every position, and each residual max(p - q, 0) is far from p.
    "sampled_q": (
        np.array([[0.10, 0.15, 0.15, 0.25, 0.35],
                  [0.30, 0.25, 0.10, 0.10, 0.25],
                  [0.20, 0.20, 0.20, 0.20, 0.20],
                  [0.50, 0.10, 0.10, 0.10, 0.20]]),  # softmax of the logits: [K+1, V]
        np.array([[0.20, 0.30, 0.30, 0.10, 0.10],
                  [0.10, 0.10, 0.15, 0.20, 0.45],
                  [0.40, 0.30, 0.10, 0.10, 0.10]]),  # q: [K, V]
        TEMPERATURE_1,  # (temperature, top_k, top_p)
    ),
    # A deterministic drafter (no draft_probs): q is one-hot at the fixed draft, so the draft is kept
    # with probability p_j(draft) and the residual is p_j without the draft.
    "fixed_draft": (
        np.array([[0.50, 0.20, 0.10, 0.10, 0.10],
                  [0.10, 0.60, 0.10, 0.10, 0.10],
                  [0.10, 0.10, 0.50, 0.20, 0.10],
                  [0.20, 0.10, 0.10, 0.20, 0.40]]),
        np.eye(5)[[0, 1, 2]],
        TEMPERATURE_1,
    ),
    # Temperature, top-k and top-p: the target is the filtered distribution (zeros where filtered),
    # so drafts of filtered-out tokens are never kept and the residual ignores them.
    "filtered": (
        np.array([[0.30, 0.25, 0.20, 0.15, 0.10],
                  [0.05, 0.40, 0.25, 0.20, 0.10],
                  [0.25, 0.25, 0.20, 0.20, 0.10],
                  [0.45, 0.05, 0.25, 0.15, 0.10]]),
        np.array([[0.20, 0.30, 0.20, 0.10, 0.20],
                  [0.15, 0.25, 0.15, 0.30, 0.15],
                  [0.40, 0.10, 0.30, 0.10, 0.10]]),
        (0.8, 4, 0.9),
    ),
}
K, V = 3, 5


class Outcome(NamedTuple):
    p: np.ndarray  # [K+1, V] target
    q: np.ndarray  # [K, V] proposal
    drafts: np.ndarray  # [N, K]
    tokens: np.ndarray  # [N, K+1], -1 padded
    nacc: np.ndarray  # [N]


@functools.cache
def outcome(case: str, use_triton: bool) -> Outcome:
    """One batched `verify` of N rows of `case`, each row with its own seed and position; both paths
    get the same inputs, so they can also be compared row by row."""
    softmax, q, (temperature, top_k, top_p) = CASES[case]
    n = N_ROWS
    g = torch.Generator().manual_seed(BASE_SEED)
    rng = np.random.default_rng(BASE_SEED)
    q_t = torch.tensor(q, dtype=torch.float32)
    sampled = case != "fixed_draft"
    if sampled:  # drafts from q with our own generator, independent of verify's randomness
        drafts = torch.stack([torch.multinomial(q_t[j], n, replacement=True, generator=g) for j in range(K)], 1)
    else:
        drafts = q_t.argmax(-1).expand(n, -1)
    seeds, positions = rng.integers(0, 2**63, n), rng.integers(0, 2**40, n)
    rows = [RowSampling(temperature, top_k, top_p, seed=int(s), position=int(pos))
            for s, pos in zip(seeds, positions, strict=True)]
    logits = torch.tensor(np.log(softmax), dtype=torch.float32)
    p = torch.stack([target_probs(logits[j], rows[0]) for j in range(K + 1)]).double().numpy()  # the reference
    probs = q_t.expand(n, -1, -1).contiguous().to(DEVICE) if sampled else None
    st = SamplingTensors.from_rows(rows, DEVICE)
    tokens, nacc = verify(logits.expand(n, -1, -1).contiguous().to(DEVICE), drafts.contiguous().to(DEVICE), st, probs,
                          use_triton=use_triton)
    return Outcome(p, q, drafts.numpy(), tokens.cpu().numpy(), nacc.cpu().numpy())


def chi2_pvalue(stat: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom >= stat), without scipy."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def assert_distributed_as(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    """Pearson chi-square goodness of fit of `counts` (any shape) to `probs` (same shape, normalized
    here). An outcome of probability zero must never occur; the rest must pass at level ALPHA."""
    counts, probs = counts.ravel(), probs.ravel() / probs.sum()
    n = int(counts.sum())
    possible = probs > 1e-9
    detail = f"n={n}, counts={counts.tolist()}, expected={np.round(n * probs, 1).tolist()}"
    assert counts[~possible].sum() == 0, f"{what}: outcomes of probability 0 occurred; {detail}"
    expected = n * probs[possible]
    assert expected.min() >= 5, f"{what}: too few samples for a chi-square test; {detail}"
    stat = float(((counts[possible] - expected) ** 2 / expected).sum())
    dof = int(possible.sum()) - 1
    pvalue = chi2_pvalue(stat, dof)
    assert pvalue > ALPHA, f"{what}: chi2={stat:.1f} with {dof} dof, p={pvalue:.2g} < {ALPHA}; {detail}"


paths = pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
cases = pytest.mark.parametrize("case", list(CASES))


@paths
@cases
@pytest.mark.parametrize("j", range(K + 1))
def test_each_emitted_token_follows_the_target(case: str, use_triton: bool, j: int) -> None:
    """Given position j is reached (every earlier draft kept), the token emitted there is ~ p_j."""
    o = outcome(case, use_triton)
    reached = o.nacc >= j
    assert_distributed_as(np.bincount(o.tokens[reached, j], minlength=V), o.p[j], f"token {j} given reached")


@paths
@cases
@pytest.mark.parametrize("j", range(K))
def test_consecutive_emitted_tokens_follow_the_product_of_targets(case: str, use_triton: bool, j: int) -> None:
    """Joint of (token j, token j+1 or stop) given position j is reached: accept-then-emit is
    min(p_j, q_j)(a) * p_{j+1}(b), stop is max(p_j - q_j, 0)(a). A uniform shared across positions
    makes the second acceptance depend on the first, and a wrong residual shifts the stop column."""
    o = outcome(case, use_triton)
    reached = o.nacc >= j
    first, cont = o.tokens[reached, j], o.nacc[reached] > j
    second = np.where(cont, o.tokens[reached, j + 1], V)  # column V: stopped after token j
    counts = np.zeros((V, V + 1), dtype=np.int64)
    np.add.at(counts, (first, second), 1)
    want = np.concatenate([np.outer(np.minimum(o.p[j], o.q[j]), o.p[j + 1]),
                           np.maximum(o.p[j] - o.q[j], 0)[:, None]], axis=1)
    assert_distributed_as(counts, want, f"(token {j}, token {j + 1} | stop) given position {j} reached")


@paths
@cases
@pytest.mark.parametrize("j", range(K))
def test_rejected_position_emits_a_residual_sample(case: str, use_triton: bool, j: int) -> None:
    """Where the draft at j is rejected, the emitted token is ~ max(p_j - q_j, 0) normalized, at every j."""
    o = outcome(case, use_triton)
    residual = np.maximum(o.p[j] - o.q[j], 0)
    stopped = o.nacc == j
    assert_distributed_as(np.bincount(o.tokens[stopped, j], minlength=V), residual, f"recovered token {j}")


@paths
@cases
def test_bonus_token_follows_the_last_target(case: str, use_triton: bool) -> None:
    """All drafts are kept with probability prod_j alpha_j; the bonus token after them is ~ p_K."""
    o = outcome(case, use_triton)
    all_kept = o.nacc == K
    alpha = np.minimum(o.p[:K], o.q).sum(-1)
    assert_distributed_as(np.bincount(all_kept, minlength=2), np.array([1 - alpha.prod(), alpha.prod()]),
                          "[some draft rejected, all kept]")
    assert_distributed_as(np.bincount(o.tokens[all_kept, K], minlength=V), o.p[K], "bonus token")


@paths
@cases
@pytest.mark.parametrize("j", range(K - 1))
def test_acceptances_at_consecutive_positions_are_independent(case: str, use_triton: bool, j: int) -> None:
    """Given position j is reached and the drafts at j, j+1 are (a, b), both are kept with probability
    min(1, p_j/q_j)(a) * min(1, p_{j+1}/q_{j+1})(b): one uniform per position, drawn independently.
    Rows are grouped by that probability (small groups pooled); each group's kept count is a sum of
    Bernoullis, and the squared z-scores of the groups add up to a chi-square."""
    o = outcome(case, use_triton)
    ratio = np.divide(np.minimum(o.p[:K], o.q), o.q, out=np.ones_like(o.q), where=o.q > 0)  # min(1, p/q)
    reached = o.nacc >= j
    drafts, both = o.drafts[reached], o.nacc[reached] >= j + 2
    pi = ratio[j, drafts[:, j]] * ratio[j + 1, drafts[:, j + 1]]
    assert both[pi >= 1].all(), f"drafts with p >= q at positions {j} and {j + 1} were rejected"

    def var(sel: np.ndarray) -> float:
        return float((pi[sel] * (1 - pi[sel])).sum())

    groups, pooled = [], np.zeros_like(pi, dtype=bool)
    for value in np.unique(pi[pi < 1]):
        sel = pi == value
        if var(sel) >= 10:
            groups.append(sel)
        else:
            pooled |= sel
    if pooled.any():
        groups.append(pooled)
    while len(groups) > 1 and var(groups[-1]) < 10:  # the pooled rest is too small on its own
        groups.append(groups.pop() | groups.pop())
    assert groups and var(groups[-1]) >= 10, "too few rows for a normal approximation"
    zs = [(both[sel].sum() - pi[sel].sum()) / np.sqrt(var(sel)) for sel in groups]
    stat = float(np.square(zs).sum())
    pvalue = chi2_pvalue(stat, len(zs))
    detail = ", ".join(f"{int(both[s].sum())} kept of {int(s.sum())} (want {pi[s].sum():.0f})" for s in groups)
    assert pvalue > ALPHA, (f"both drafts kept at {j}, {j + 1}: chi2={stat:.1f} with {len(zs)} dof, "
                            f"p={pvalue:.2g} < {ALPHA}; {detail}")


@cases
def test_triton_and_torch_paths_emit_the_same_tokens(case: str) -> None:
    """Same rows, same randomness: the accept kernel only decides, so both paths agree row by row."""
    o_torch, o_triton = outcome(case, False), outcome(case, True)
    assert np.array_equal(o_triton.tokens, o_torch.tokens) and np.array_equal(o_triton.nacc, o_torch.nacc)


@paths
def test_greedy_rows_and_missing_drafts_in_a_sampled_batch(use_triton: bool) -> None:
    """One batch mixing greedy rows (exact, whatever the seeds and q), sampled rows with one draft
    and a -1 tail whose q rows are zero (as the runner pads them: u * 0 <= p would accept a -1 if the
    id check were missing), and sampled rows without drafts (exactly what `sample` samples)."""
    p, q, _ = CASES["sampled_q"]
    n_greedy, n_one, n_none = 60, 800, 40
    n = n_greedy + n_one + n_none
    g = torch.Generator().manual_seed(BASE_SEED + 1)
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(n, 1, 1)
    logits[:n_greedy] = torch.randn(n_greedy, K + 1, V, generator=g) * 3
    best = logits[:n_greedy].argmax(-1)
    drafts = torch.full((n, K), -1, dtype=torch.int64)
    matched = torch.randint(0, K + 1, (n_greedy,), generator=g)  # greedy: a prefix of argmaxes, then a miss or -1
    for i in range(n_greedy):
        m = int(matched[i])
        drafts[i, :m] = best[i, :m]
        if m < K and i % 2:
            drafts[i, m] = (best[i, m] + 1) % V
    drafts[n_greedy:n_greedy + n_one, 0] = torch.multinomial(torch.tensor(q[0]), n_one, replacement=True, generator=g)
    probs = torch.zeros(n, K, V)
    probs[:, 0] = torch.tensor(q[0])
    seeds = np.random.default_rng(BASE_SEED + 1).integers(0, 2**62, n)
    rows = [RowSampling(0.0 if i < n_greedy else 1.0, 0, 1.0, int(s), i) for i, s in enumerate(seeds)]
    tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), rows, probs.to(DEVICE), use_triton=use_triton)
    tokens, nacc = tokens.cpu(), nacc.cpu()

    assert nacc[:n_greedy].tolist() == matched.tolist()
    for i in range(n_greedy):
        m = int(matched[i])
        assert tokens[i].tolist() == best[i, :m + 1].tolist() + [-1] * (K - m), f"greedy row {i}"

    one = slice(n_greedy, n_greedy + n_one)
    assert int(nacc[one].max()) <= 1, "a -1 draft was accepted"
    kept = nacc[one] == 1
    alpha0 = float(np.minimum(p[0], q[0]).sum())
    assert_distributed_as(np.bincount(kept.numpy(), minlength=2), np.array([1 - alpha0, alpha0]), "first draft kept")
    assert_distributed_as(np.bincount(tokens[one][:, 0].numpy(), minlength=V), p[0], "token 0")
    # No draft at position 1: the stop token there is a plain sample of p_1, not a residual.
    assert_distributed_as(np.bincount(tokens[one][kept, 1].numpy(), minlength=V), p[1], "token 1 after a -1 draft")

    none = slice(n_greedy + n_one, n)
    assert nacc[none].tolist() == [0] * n_none
    assert tokens[none][:, 0].tolist() == sample(logits[none, 0].to(DEVICE), rows[none])  # same device, same noise


# --- Same noise as plain sampling, whatever the batch ---------------------------------------------------------


def mixed_rows(n: int, seed: int) -> list[RowSampling]:
    """Greedy rows, plain sampling, top-k, top-p and both, each with its own seed and position."""
    rng = np.random.default_rng(seed)
    kinds = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.2, 0, 0.8), (0.9, 20, 0.9)]
    return [RowSampling(*kinds[i % len(kinds)], seed=int(rng.integers(0, 2**63)), position=int(rng.integers(0, 2**40)))
            for i in range(n)]


@paths
def test_position_j_draws_the_noise_sampling_draws_for_output_token_position_plus_j(use_triton: bool) -> None:
    """Row i keeps its first j drafts for sure (p is exactly one-hot there), has no draft at j, so
    the token at j is p_j's plain sample, and it must be exactly what `sample` draws for output
    token position + j. A noise stream keyed by the step (not by position + j) fails this."""
    n, v = 40, 100
    rows = mixed_rows(n, seed=21)
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(n, K + 1, v, generator=g) * 2
    drafts = torch.full((n, K), -1, dtype=torch.int64)
    stop = torch.arange(n) % (K + 1)  # the column where row i has its first missing draft
    for i in range(n):
        for j in range(int(stop[i])):
            drafts[i, j] = (7 * i + j) % v
            logits[i, j] = float("-inf")
            logits[i, j, drafts[i, j]] = 0.0  # p_j is one-hot at the draft: kept whatever u is
    tokens, nacc = verify(logits.to(DEVICE), drafts.to(DEVICE), SamplingTensors.from_rows(rows, DEVICE),
                          use_triton=use_triton)
    assert torch.equal(nacc.cpu(), stop)
    at_stop = tokens.cpu()[torch.arange(n), stop]
    shifted = [msgspec.structs.replace(s, position=s.position + int(stop[i])) for i, s in enumerate(rows)]
    assert at_stop.tolist() == sample(logits[torch.arange(n), stop].to(DEVICE), shifted)


@paths
def test_rows_without_drafts_sample_what_sample_samples_with_any_filter(use_triton: bool) -> None:
    n, v = 50, 300
    rows = mixed_rows(n, seed=22)
    logits = torch.randn(n, K + 1, v, generator=torch.Generator().manual_seed(22)) * 3
    tokens, nacc = verify(logits.to(DEVICE), torch.full((n, K), -1, device=DEVICE), rows, use_triton=use_triton)
    assert not nacc.any() and (tokens[:, 1:] == -1).all()
    assert tokens[:, 0].tolist() == sample(logits[:, 0].to(DEVICE), rows)


@paths
def test_a_row_verifies_the_same_whatever_shares_its_batch(use_triton: bool) -> None:
    """Each row alone, and the rows shuffled among other rows with greedy padding and
    conservative flags: the same tokens and acceptance counts."""
    n, v = 30, 64
    g = torch.Generator().manual_seed(23)
    rows = mixed_rows(2 * n, seed=23)
    logits = torch.randn(2 * n, K + 1, v, generator=g)
    drafts = torch.randint(-1, v, (2 * n, K), generator=g)
    drafts[:, 0] = logits[:, 0].argmax(-1)  # some drafts that greedy rows keep
    q = torch.rand(2 * n, K, v, generator=g).softmax(-1)
    alone = [verify(logits[i : i + 1].to(DEVICE), drafts[i : i + 1].to(DEVICE), [rows[i]], q[i : i + 1].to(DEVICE),
                    use_triton=use_triton) for i in range(n)]
    order = torch.randperm(2 * n, generator=g)
    st = SamplingTensors.from_rows([rows[i] for i in order.tolist()], DEVICE, pad_to=2 * n + 5)
    st.all_greedy, st.any_filter = False, True
    pad = 5

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[order], t[:pad]]).to(DEVICE)

    tokens, nacc = verify(padded(logits), padded(drafts), st, padded(q), use_triton=use_triton)
    where = order.argsort()[:n]
    assert tokens[where].tolist() == [t[0].tolist() for t, _ in alone]
    assert nacc[where].tolist() == [int(a[0]) for _, a in alone]
