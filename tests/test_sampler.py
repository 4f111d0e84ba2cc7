"""Sampling: greedy, filters, seeded reproducibility and the distribution it draws from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speckernel.errors import InvalidSamplingParamsError
from speckernel.frame import RowSampling
from speckernel.sampler import filter_logits, sample
from speckernel.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draw(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    rows = [RowSampling(temperature, top_k, top_p, seed=s, position=0) for s in range(n)]
    return np.array(sample(LOGITS.expand(n, -1).clone(), rows))


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100)
    rows = [RowSampling(0.0, 0, 1.0, seed=i, position=0) for i in range(5)]
    assert sample(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8)]
)
def test_samples_follow_the_filtered_distribution(temperature: float, top_k: int, top_p: float) -> None:
    n = 6000
    counts = np.bincount(draw(n, temperature, top_k, top_p), minlength=len(LOGITS))
    probs = filter_logits(LOGITS / temperature, top_k, top_p).softmax(-1).numpy()
    assert np.all(counts[probs == 0] == 0), "a filtered-out token was sampled"
    dof = int((probs > 0).sum()) - 1
    # 99.9% quantile of chi-square with <= 5 degrees of freedom is about 20.5.
    assert chi_square(counts, probs) < 20.5 + 2 * dof


def test_top_p_keeps_smallest_prefix() -> None:
    probs = filter_logits(LOGITS, 0, 0.5).softmax(-1)
    assert (probs > 0).sum() == 1  # the top token alone has p > 0.5
    probs = filter_logits(LOGITS, 0, 0.7).softmax(-1)
    assert (probs > 0).sum() == 2


def test_seeded_draws_repeat_and_depend_on_position() -> None:
    logits = torch.randn(1, 1000)
    a = [sample(logits, [RowSampling(1.0, 0, 1.0, seed=7, position=p)])[0] for p in range(20)]
    b = [sample(logits, [RowSampling(1.0, 0, 1.0, seed=7, position=p)])[0] for p in range(20)]
    c = [sample(logits, [RowSampling(1.0, 0, 1.0, seed=8, position=p)])[0] for p in range(20)]
    assert a == b and a != c and len(set(a)) > 1


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
