"""The learned drafters end to end: `speckernel train-drafter` on a target's own answers, then
serving the checkpoint it wrote. A drafter trained on what a small random target says must
predict it when served (training and serving compute the same thing), and output stays the
target's own, token for token. Plus the checkpoint contract: shapes checked against the target,
capabilities declared for `speckernel plugins`."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from speckernel import registry
from speckernel.config import EngineConfig
from speckernel.engine.core import EngineCore
from speckernel.errors import InvalidInputError
from speckernel.sampling_params import SamplingParams
from speckernel.speculators.learned import use_fused_kernels
from speckernel.tools.cli import build_parser
from speckernel.tools.train.args import trainable
from speckernel.tools.train.data import Sequences
from speckernel.tools.train.drafter import train
from tests.conftest import run_to_completion

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds the module's fixtures

TARGET = "random:tiny,num_layers=6"
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
K = {"mtp": 3, "eagle3": 3, "dflash": 3, "dspark": 3, "causal_cascade": 3}
BUILTIN = {n for n, ep in registry.discover("speculator").items() if ep.value.startswith("speckernel.")}
LEARNED = [n for n in trainable() if n in BUILTIN]
"""The built-in learned drafters, found as `train-drafter` finds them: trainable in their capabilities."""


def core_for(speculator: str | None = None, **kw) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(EngineConfig(model=TARGET, platform="cpu", max_model_len=256, speculator=speculator, **kw))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, size=int(rng.integers(4, 12))).tolist() for _ in range(12)]


@pytest.fixture(scope="module")
def plain(prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return run_to_completion(core_for(), prompts, GREEDY)


@pytest.fixture(scope="module")
def data(prompts, plain, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("data") / "data.npz"
    Sequences.pack(list(zip(prompts, plain, strict=True))).save(path)
    return path


SHALLOW = ["--set", "dflash.num_layers=2", "--set", "dspark.num_layers=2"]
NARROW = ["--set", "intermediate_size=128"]
"""The tiny target's own MLP width instead of the drafters' default 1024: training, serving and the
fused kernels run the same code at any width (silu_mul takes a row in one block at either), and
a step costs a third to a half less."""
SHORT_BLOCKS = [x for m in ("dflash", "dspark", "causal_cascade") for x in ("--set", f"{m}.block_size=5")]
"""Block drafters trained on blocks of at most 5 positions (the default 8): fewer positions to train
per anchor, and still more than the K + 1 = 4 a step serves, so serving still runs a block shorter
than the longest trained."""


def train_args(method: str, data: Path, out: Path, steps: int) -> list[str]:
    return ["train-drafter", "--method", method, "--target", TARGET, "--data", str(data), "--out", str(out),
            "--steps", str(steps), "--batch-size", "8", "--seq-len", "40", "--lr", "3e-3", "--warmup", "5",
            "--save-every", "20", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Callable[[str], Path]:  # type: ignore[no-untyped-def]
    """A drafter of each method trained on the target's answers, once per module: the end-to-end
    test serves it, and the tests of --init start from it instead of training one of their own."""
    folders: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in folders:
            out = tmp_path_factory.mktemp("trained") / method
            # Two decoder layers where the architecture stacks them (the default is deeper), the
            # target's MLP width, shorter blocks: training and serving run the same code at any
            # size; at a higher learning rate, the smaller drafter learns as much in 120 steps.
            summary = train(build_parser().parse_args([*train_args(method, data, out, 120), *SHALLOW, *NARROW,
                                                       *SHORT_BLOCKS, "--lr", "1e-2"]))
            assert summary["steps"] == 120
            folders[method] = out
        return folders[method]

    return get


FUSED_TOKENS = 12
"""Tokens of the fused kernels' comparison: its property holds step by step (each draft the
torch layers' own), and Triton's interpreter pays for every drafted position."""


@pytest.mark.parametrize("method", LEARNED)
def test_a_trained_drafter_predicts_its_target_and_changes_no_token(  # type: ignore[no-untyped-def]
        method, trained, prompts, plain) -> None:
    out = trained(method)
    assert (out / "model.safetensors").is_file() and (out / "train_log.json").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").is_file()
    core = core_for(method, num_speculative_tokens=K[method], draft_model=str(out))
    assert run_to_completion(core, prompts, GREEDY) == plain
    spec = core.stats()["spec"]
    # An untrained drafter accepts next to nothing here; one that learned the target's answers
    # (and is served the way it was trained) accepts most of its drafts.
    assert spec["mean_acceptance_length"] > 2.0, spec
    # The fused kernels a GPU platform switches on (run here by Triton's interpreter, slowly: on
    # the first steps of a few prompts) draft the same tokens as the torch layers they replace.
    short = SamplingParams(max_tokens=FUSED_TOKENS, temperature=0, ignore_eos=True)
    figures = []
    for fuse in (False, True):
        served = core_for(method, num_speculative_tokens=K[method], draft_model=str(out))
        use_fused_kernels(served.speculator.module, fuse)
        assert run_to_completion(served, prompts[:3], short) == [p[:FUSED_TOKENS] for p in plain[:3]]
        spec = served.stats()["spec"]
        figures.append({k: spec[k] for k in ("num_drafts", "num_accepted_tokens", "acceptance_per_position")})
    torch_layers, fused = figures
    assert torch_layers["num_drafts"] >= 6, torch_layers  # a few steps of each prompt
    assert fused == torch_layers


def test_training_resumes_where_it_stopped(data, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "mtp"
    train(build_parser().parse_args([*train_args("mtp", data, out, 20), *NARROW]))
    first = json.loads((out / "train_log.json").read_text())["log"]
    summary = train(build_parser().parse_args([*train_args("mtp", data, out, 30), *NARROW]))
    assert summary["steps"] == 30
    log = json.loads((out / "train_log.json").read_text())["log"]
    assert [e["step"] for e in log] == list(range(1, 31)) and log[:20] == first


def test_methods_trained_together_learn_what_each_learns_alone(data, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One target forward per batch for several methods (hidden states for one, KV rows for the
    other): each ends with the weights and the loss curve it reaches when trained by itself."""
    from safetensors.torch import load_file

    together = tmp_path / "together"
    summary = train(build_parser().parse_args([*train_args("eagle3", data, together, 6), "--method", "causal_cascade",
                                               *NARROW]))
    assert {m: s["steps"] for m, s in summary["methods"].items()} == {"eagle3": 6, "causal_cascade": 6}
    for method in ("eagle3", "causal_cascade"):
        alone = tmp_path / method
        train(build_parser().parse_args([*train_args(method, data, alone, 6), *NARROW]))
        want, got = (load_file(str(d / "model.safetensors")) for d in (alone, together / method))
        assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want), method
        logs = [json.loads((d / "train_log.json").read_text())["log"] for d in (alone, together / method)]
        assert logs[0] == logs[1]


class DeviceReads:
    """Counts what reads a tensor's value back to the host during a block: on a GPU each such
    read waits for every kernel queued before it (a host sync). ATen calls through a dispatch
    mode (a scalar read: item, float(), int(), bool(); nonzero; masked_select; indexing by a
    boolean mask; repeat_interleave without its output size; equal), and the Python methods
    that copy values out without an ATen call (tolist, numpy)."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        reads = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.unique_consecutive,
                 aten._unique2, aten.unique_dim}
        indexing = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
        self.calls: list[str] = []
        calls = self.calls

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                packet = func.overloadpacket
                masks = packet in indexing and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                                   for i in args[1] if i is not None)
                unsized = packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) \
                    and kwargs.get("output_size") is None and len(args) < 3
                if packet in reads or masks or unsized:
                    calls.append(str(func))
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self) -> DeviceReads:
        import torch

        self.saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, real in self.saved.items():
            def read(tensor, *args, name=name, real=real, **kwargs):  # type: ignore[no-untyped-def]
                self.calls.append(name)
                return real(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, read)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self.mode.__exit__(*exc)
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, real)


def test_a_training_step_never_waits_for_the_device(data, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every method trained at once (chained, block and cascade losses, the target's forward, the
    optimizer): nothing in a step reads the device back, so on a GPU the host queues step after
    step and the device never idles waiting for it. The figures are read at the log points
    only, and the log still has every step's."""
    import torch

    from speckernel.tools.train import drafter

    reads, steps = DeviceReads(), []
    real_step = drafter.train_step

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        with reads:
            out = real_step(*args, **kwargs)
        steps.append(out)
        return out

    monkeypatch.setattr(drafter, "train_step", counted)
    with reads:  # the counter sees what it must
        torch.ones(3).nonzero()
        float(torch.ones(()))
        torch.ones(2)[torch.tensor([True, False])]
        torch.ones(2).tolist()
    assert len(reads.calls) == 4, reads.calls
    reads.calls.clear()
    others = [x for m in LEARNED[1:] for x in ("--method", m)]
    summary = train(build_parser().parse_args([*train_args(LEARNED[0], data, tmp_path, 4), *others, "--log-every", "3",
                                               "--holdout", "0.3", "--eval-every", "2", "--save-every", "3",
                                               *SHALLOW, *NARROW]))
    assert len(steps) == 4 and all(s > 0 for s in steps)
    assert reads.calls == [], reads.calls
    for method in LEARNED:
        assert summary["methods"][method]["throughput"]["tokens_per_s"] > 0
        log = json.loads((tmp_path / method / "train_log.json").read_text())["log"]
        assert [e["step"] for e in log] == [1, 2, 3, 4] and all(e["loss"] > 0 for e in log), method
        assert [e["step"] for e in log if "val_loss" in e] == [2, 4]


def test_held_out_prompts_go_to_one_side_whatever_the_order() -> None:
    """Every answer to a prompt (greedy, sampled) is on the same side of the split, and file order
    does not move a prompt: a held-out figure measures prompts training never saw."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=6).tolist() for _ in range(200)]
    greedy = Sequences.pack([(p, [1, 2, 3]) for p in prompts])
    sampled = Sequences.pack([(p, rng.integers(3, 500, size=4).tolist()) for p in prompts[::-1]])
    kept, held = Sequences.concat([greedy, sampled]).split(0.25)
    assert len(kept) + len(held) == 400 and 60 < len(held) < 140

    def prompt_set(s: Sequences) -> set[tuple[int, ...]]:
        return {tuple(s.get(i)[0][: s.get(i)[1]].tolist()) for i in range(len(s))}

    assert not prompt_set(kept) & prompt_set(held)
    assert len(held) == 2 * len(prompt_set(held))  # both answers of each held-out prompt
    assert prompt_set(Sequences.concat([sampled, greedy]).split(0.25)[1]) == prompt_set(held)
    assert prompt_set(sampled.split(0.25)[1]) == prompt_set(held)
    kept0, held0 = greedy.split(0.0)
    assert len(held0) == 0 and kept0.tokens.tolist() == greedy.tokens.tolist()
    assert kept0.offsets.tolist() == greedy.offsets.tolist()


def test_held_out_figures_are_logged_and_measuring_changes_nothing(data, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """val_* figures every --eval-every steps and at the end, on prompts kept out of training; a
    run measured often ends with the weights of one measured only at the end (dflash draws random
    anchors and block lengths: measuring must not move training's random stream)."""
    from safetensors.torch import load_file

    often, rarely = tmp_path / "often", tmp_path / "rarely"
    extra = ["--holdout", "0.3", "--eval-batches", "2", *SHALLOW, *NARROW]
    summary = train(build_parser().parse_args([*train_args("dflash", data, often, 12), *extra, "--eval-every", "5"]))
    train(build_parser().parse_args([*train_args("dflash", data, rarely, 12), *extra, "--eval-every", "1000"]))
    held = Sequences.load(data).split(0.3)[1]
    assert summary["held_out"] == len(held) > 0 and summary["sequences"] + summary["held_out"] == 12
    log = json.loads((often / "train_log.json").read_text())["log"]
    assert [e["step"] for e in log if "val_loss" in e] == [5, 10, 12]
    assert {"val_loss", "val_acc", "val_acc_1"} <= set(log[4])
    assert log[-1]["val_loss"] == pytest.approx(summary["final"]["val_loss"], abs=1e-5) and log[-1]["val_loss"] > 0
    want, got = (load_file(str(d / "model.safetensors")) for d in (rarely, often))
    assert all((want[k] == got[k]).all() for k in want)
    assert json.loads((rarely / "train_log.json").read_text())["log"][-1]["val_loss"] == log[-1]["val_loss"]
    with pytest.raises(InvalidInputError, match="--holdout"):
        train(build_parser().parse_args([*train_args("mtp", data, tmp_path / "bad", 1), "--holdout", "1"]))


def test_training_can_start_from_a_checkpoint(data, trained, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    first, second = trained("eagle3"), tmp_path / "second"
    # lr 0: the weights it starts from are the ones it writes (draft vocabulary included).
    train(build_parser().parse_args([*train_args("eagle3", data, second, 1), "--init", str(first), "--lr", "0"]))
    want, got = (load_file(str(d / "model.safetensors")) for d in (first, second))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
    with pytest.raises(InvalidInputError, match="holds a eagle3 drafter"):
        train(build_parser().parse_args([*train_args("mtp", data, tmp_path / "mtp", 1), "--init", str(first)]))


def test_a_grown_drafter_starts_as_its_checkpoint(data, trained, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--init with --set METHOD.num_layers=N larger than the checkpoint's: the checkpoint's layers
    load and the added ones start as identities, so at lr 0 the grown drafter measures exactly the
    held-out loss of the one it grew from; only the named method grows."""
    from safetensors.torch import load_file

    first, grown = trained("dflash"), tmp_path / "grown"  # two decoder layers
    extra = ["--holdout", "0.3", "--eval-batches", "2"]
    # The checkpoint as saved (bf16), measured as it is: what the grown one must match.
    before = train(build_parser().parse_args([*train_args("dflash", data, tmp_path / "same", 1), *extra,
                                              "--init", str(first), "--lr", "0"]))
    after = train(build_parser().parse_args([*train_args("dflash", data, grown, 1), *extra, "--init", str(first),
                                             "--lr", "0", "--set", "dflash.num_layers=3", "--set", "mtp.num_layers=5"]))
    assert before["config"]["num_layers"] == 2 and after["config"]["num_layers"] == 3
    assert after["final"]["val_loss"] == pytest.approx(before["final"]["val_loss"], rel=1e-6)
    want, got = (load_file(str(d / "model.safetensors")) for d in (first, grown))
    assert all((want[k] == got[k]).all() for k in want)
    assert not got["layers.2.self_attn.o_proj.weight"].any() and got["layers.2.self_attn.q_proj.weight"].any()
    eagle = tmp_path / "eagle3"
    train(build_parser().parse_args(train_args("eagle3", data, eagle, 1)))
    with pytest.raises(InvalidInputError, match="cannot add decoder layers"):  # eagle3 has one mid layer
        train(build_parser().parse_args([*train_args("eagle3", data, tmp_path / "e2", 1), "--init", str(eagle),
                                         "--set", "num_layers=2"]))
    with pytest.raises(InvalidInputError, match="'medusa' is not a trainable method"):
        train(build_parser().parse_args([*train_args("dflash", data, tmp_path / "x", 1), "--set", "medusa.rank=2"]))


def test_a_checkpoint_for_another_target_is_refused(data, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "eagle3"
    train(build_parser().parse_args(train_args("eagle3", data, out, 1)))
    with pytest.raises(InvalidInputError, match="trained for a target"):
        EngineCore(EngineConfig(model="random:tiny,num_layers=6,hidden_size=128", platform="cpu",
                                max_model_len=256, speculator="eagle3", draft_model=str(out)))
    with pytest.raises(InvalidInputError, match="holds a eagle3 drafter"):
        core_for("mtp", draft_model=str(out))
    with pytest.raises(InvalidInputError, match="no config\\.json, nor a mtp/ folder"):
        core_for("mtp", draft_model=str(tmp_path))
    # A folder of checkpoints by method (train-drafter's --out for several): each finds its own.
    core = core_for("eagle3", draft_model=str(tmp_path))
    assert core.speculator.cfg.sha256 == json.loads((out / "config.json").read_text())["sha256"]


def test_train_drafter_methods_are_the_speculators_declared_trainable() -> None:
    """`--method` comes from the registry (capabilities.trainable plus the training protocol),
    in name order; a speculator without a trained drafter is refused before anything runs."""
    assert LEARNED == sorted(K)
    assert build_parser().parse_args(["train-drafter", "--method", "mtp", "--method", "dspark"]).method == \
        ["mtp", "dspark"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-drafter", "--method", "ngram"])


def test_plugins_json_declares_width_and_k0_pass() -> None:
    listed = registry.describe()["speculators"]
    assert {n for n, entry in listed.items() if entry["trainable"] and n in K} == set(LEARNED)
    assert not listed["ngram"]["trainable"] and not listed["draft_model"]["trainable"]
    assert {n for n in LEARNED if listed[n]["draft_width"] == "fixed"} == {"mtp", "eagle3"}
    assert {n for n in LEARNED if listed[n]["draft_width"] == "variable"} == {"dflash", "dspark", "causal_cascade"}
    assert all(listed[n]["supports_k0"] and listed[n]["drafting"] == "in_step" and listed[n]["k0_pass"]
               for n in LEARNED)


def test_triton_attend_takes_a_rows_length_repeated_per_query() -> None:
    """A block drafter's queries of one row carry that row's table and length as expanded views
    (stride 0 when there is one row); the Triton backend must read them as the torch one does."""
    import torch

    from speckernel.ops.paged_attention import TorchPagedAttention, TritonPagedAttention

    torch.manual_seed(0)
    bs, queries = 4, 8
    kv = torch.randn(2, 64, 2, 16)
    tables = torch.tensor([[3, 1, 7, 2, 5]])
    lens = torch.tensor([17])
    q_tables = tables[:, None].expand(1, queries, 5).reshape(queries, -1)
    q_lens = lens[:, None].expand(1, queries).reshape(-1)
    assert q_lens.stride(0) == 0 and q_tables.stride(0) == 0  # the case that read past the lengths
    q = torch.randn(queries, 4, 16)
    want = TorchPagedAttention(bs, 16, torch.device("cpu")).attend(q, kv, q_tables, q_lens, 0.25)
    got = TritonPagedAttention(bs, 16, torch.device("cpu")).attend(q, kv, q_tables, q_lens, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("extra,message", [(["--minutes", "-1"], "--minutes"), (["--shard", "2/2"], "--shard"),
                                           (["--kv-cache-gb", "0"], "kv_cache_bytes"),
                                           (["--concurrency", "0"], "max_num_seqs")])
def test_bad_data_arguments_are_refused_before_any_work(extra, message, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from speckernel.tools.train.corpus import write_corpus

    prompts = tmp_path / "prompts.jsonl"
    write_corpus(prompts, [[{"role": "user", "content": "Name a colour."}]])
    args = ["train-drafter", "--method", "mtp", "--prompts", str(prompts), "--data", str(tmp_path / "d.npz"),
            "--out", str(tmp_path / "mtp"), "--generate-only", "--platform", "cpu", *extra]
    with pytest.raises(InvalidInputError, match=message):
        train(build_parser().parse_args(args))
    assert not (tmp_path / "d.npz").exists()


@pytest.mark.slow
def test_data_is_the_targets_answers_through_the_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from speckernel.tools.train.corpus import write_corpus

    prompts = tmp_path / "prompts.jsonl"
    write_corpus(prompts, [[{"role": "user", "content": "Name a colour."}],
                           [{"role": "user", "content": "Write a haiku about rain."}]])

    def make(name: str, *extra: str) -> Sequences:
        args = ["train-drafter", "--method", "mtp", "--prompts", str(prompts), "--data", str(tmp_path / name),
                "--out", str(tmp_path / "mtp"), "--generate-only", "--max-tokens", "6", "--platform", "cpu", *extra]
        train(build_parser().parse_args(args))
        return Sequences.load(tmp_path / name)

    greedy = make("greedy.npz")
    assert len(greedy) == 2
    for i in range(2):
        tokens, prompt_len = greedy.get(i)
        assert 0 < len(tokens) - prompt_len <= 6 and prompt_len > 5  # the chat template wraps the prompt
    sampled = make("sampled.npz", "--shard", "1/2", "--temperature", "0.8")
    again = make("again.npz", "--shard", "1/2", "--temperature", "0.8")
    assert len(sampled) == 1 and sampled.get(0)[1] == greedy.get(1)[1]  # the second prompt only
    assert sampled.get(0)[0].tolist() == again.get(0)[0].tolist()  # seeded: the same answer
    # Corpora are concatenated; a small KV budget (several generators on one GPU) and one answer
    # at a time give the same greedy answers; past a time limit, prompts not started are left
    # out, not waited for; with nothing made, no file is written (the next run generates again).
    write_corpus(tmp_path / "more.jsonl", [[{"role": "user", "content": "Say hello in French."}]])
    three = make("three.npz", "--prompts", str(tmp_path / "more.jsonl"), "--kv-cache-gb", "0.2", "--concurrency", "1")
    assert len(three) == 3 and three.tokens[: three.offsets[2]].tolist() == greedy.tokens.tolist()
    with pytest.raises(FileNotFoundError):
        make("late.npz", "--minutes", "1e-9")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_served_first_drafts_are_the_dense_first_run_of_training(method, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The chain's feature shift, served as trained: the first draft of every step, made from the
    newest token and the target's feature of the position before it (carried across steps by
    the catch-up), is what training's first run predicts there over the whole sequence at once.
    So the served drafts accept exactly where the dense predictions equal the next token, along
    the path the steps take (a step starts 2 positions on after an accepted draft, 1 after a
    rejected one). A feature one position off, or a catch-up that left a stale carry, breaks it."""
    import torch

    from speckernel.speculators.learned import causal_mask, masked_attention
    from speckernel.tools.train.data import TargetFeatures
    from tests.conftest import PROMPTS

    core = EngineCore(EngineConfig(platform="cpu", max_model_len=512, speculator=method, num_speculative_tokens=1))
    prompt = tokenizer.encode(PROMPTS[0])
    out = run_to_completion(core, [prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    spec = core.stats()["spec"]
    tokens = torch.tensor(prompt + out)
    m = core.speculator.module
    cfg = m.config
    t = tokens.shape[0]
    with torch.inference_mode():
        batch = TargetFeatures(core.runner.model, cfg.target_layers, cfg.kv_layers).batch(
            tokens[None], torch.ones(1, t, dtype=torch.bool))
        target_feature = m.feature(batch.hidden)
        feature = torch.cat([torch.zeros_like(target_feature[:, :1]), target_feature[:, :-1]], dim=1)
        cos, sin = m.rope(torch.arange(t))
        mask = causal_mask(t, tokens.device)
        hidden = m.run(batch.target.embed(tokens[None]), feature, cos[None], sin[None],
                       lambda q, k, v: masked_attention(q, k, v, mask, m.scale))
        dense = m.to_target_ids(m.logits(hidden, batch.target).argmax(-1))[0].tolist()
    q, accepted = len(prompt), 0  # the first draft is made at the prompt's sampled token
    for _ in range(spec["num_drafts"]):
        if q + 1 >= t:  # served steps went further than the dense path allows: already wrong
            accepted = -1
            break
        hit = dense[q] == tokens[q + 1]
        accepted += int(hit)
        q += 2 if hit else 1
    assert spec["num_drafts"] >= 20 and 0 < spec["num_accepted_tokens"] < spec["num_drafts"], spec
    assert spec["num_accepted_tokens"] == accepted, (spec, accepted)
