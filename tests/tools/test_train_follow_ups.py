"""Follow-ups in the drafters' data (`train-drafter --follow-ups`): a second user turn after the
target's whole answer, answered with the first answer in the context, and kept on the same side
of the held-out split as its first answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speckernel.config import EngineConfig
from speckernel.tools.train.data import Sequences, generate
from speckernel.tools.train.follow_ups import choose, follow_ups


def test_the_follow_ups_are_chosen_by_the_seed() -> None:
    assert choose(50, 0.0, 1) == [None] * 50
    assert all(t in follow_ups() for t in choose(50, 1.0, 1))
    some = choose(400, 0.3, 7)
    assert some == choose(400, 0.3, 7) and some != choose(400, 0.3, 8)
    assert 80 < sum(t is not None for t in some) < 160
    with pytest.raises(ValueError, match="share"):
        choose(3, 1.5, 0)


def conversations(n: int, rng: np.random.Generator) -> Sequences:
    """n first answers, then a second one for each whose prompt is the first's prompt, its answer
    and a follow-up (what `generate` makes), split with its first."""
    firsts = [(rng.integers(3, 500, int(rng.integers(4, 9))).tolist(), rng.integers(3, 500, 6).tolist())
              for _ in range(n)]
    seconds = [(p + a + rng.integers(3, 500, 3).tolist(), rng.integers(3, 500, 5).tolist()) for p, a in firsts]
    return Sequences.pack(firsts + seconds, [len(p) for p, _ in firsts] * 2)


def test_a_second_answer_is_held_out_with_its_first(tmp_path: Path) -> None:
    data = conversations(40, np.random.default_rng(0))
    data.save(tmp_path / "d.npz")
    loaded = Sequences.load(tmp_path / "d.npz")
    assert loaded.split_lens is not None and np.array_equal(loaded.split_lens, data.split_lens)
    kept, held = loaded.split(0.5)
    assert 0 < len(held) < len(loaded) and len(held) % 2 == 0
    for side in (kept, held):  # every first answer's prompt opens exactly one second answer's prompt beside it
        prompts = [side.get(i)[0][: side.prompt_lens[i]].tolist() for i in range(len(side))]
        firsts = [p for p, n in zip(prompts, [side.split_len(i) for i in range(len(side))], strict=True) if len(p) == n]
        assert len(firsts) * 2 == len(side)
        assert all(sum(q[: len(p)] == p and len(q) > len(p) for q in prompts) == 1 for p in firsts)


def test_data_with_and_without_follow_ups_concatenate(tmp_path: Path) -> None:
    plain = Sequences.pack([([1, 2, 3], [4, 5]), ([6, 7], [8])])
    both = Sequences.concat([plain, conversations(3, np.random.default_rng(1))])
    assert both.split_lens is not None and both.split_lens[:2].tolist() == [3, 2]
    assert Sequences.concat([plain, plain]).split_lens is None


@pytest.mark.slow
def test_generate_answers_the_follow_up_with_the_first_answer_in_context(model_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(model_path), platform="cpu", max_model_len=512, log_level="warning")
    chats = [[{"role": "user", "content": "Say hello in one short sentence."}],
             [{"role": "user", "content": "Name one color."}]]
    data = generate(config, chats, max_tokens=40, concurrency=2, follow_ups=["Now say it in French.", None])
    assert len(data) == 3, "two first answers and one second"
    assert data.split_lens is not None
    second, prompt_len = data.get(2)
    first, first_len = data.get(0)
    assert data.split_lens[2] == first_len, "the second answer splits with its first"
    context = tokenizer.decode(second[:prompt_len].tolist())
    assert "Now say it in French." in context and tokenizer.decode(first[first_len:].tolist()).strip() in context
