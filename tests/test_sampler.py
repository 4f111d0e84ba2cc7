"""Sampling: greedy, filters, seeded reproducibility and the distribution it draws from."""

from __future__ import annotations

import msgspec
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
