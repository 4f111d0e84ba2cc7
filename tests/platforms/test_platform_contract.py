"""The platform contract the kernel is written against: the attention backend, hidden-state
capture, the host gate, the KV budget, graph capture, and every platform implementing it all."""

from __future__ import annotations

import inspect
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from speckernel import registry
from speckernel.attention import AttentionMetadata
from speckernel.model_config import ModelConfig
from speckernel.models.llama import LlamaModel
from speckernel.models.paged import new_kv_cache
from speckernel.ops.paged_attention import SHORT_QUERY, TorchPagedAttention
from speckernel.platform import GraphCaptureUnsupportedError, Platform, PlatformCapabilities
from speckernel.platforms.accelerator import TorchAcceleratorPlatform
from speckernel.platforms.ascend import AscendPlatform
from speckernel.platforms.cpu import CpuPlatform
from speckernel.platforms.cuda import CudaPlatform
from speckernel.platforms.gate import HostWaitGate

CPU = torch.device("cpu")
PLATFORMS = [CpuPlatform, CudaPlatform, AscendPlatform]
BLOCK = 4
NH, NKV, HD = 4, 2, 8


def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                    scale: float) -> torch.Tensor:
    """Plain causal softmax attention of one sequence in float64: q [n, NH, HD] are positions
    start..start+n-1, keys/values [start+n, NKV, HD] its whole context."""
    n, ctx = q.shape[0], keys.shape[0]
    group = NH // NKV
    k = keys.double().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def slots_of(block_ids: list[int], positions: range) -> list[int]:
    return [block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def test_paged_attention_matches_dense_causal_attention_on_a_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    # (start_pos, num_new): decode rows, verify rows (1 + K), a fresh and a continued long
    # prefill chunk; blocks handed out in shuffled order so tables are not contiguous.
    rows = [(9, 1), (0, 1), (13, 1 + 3), (5, 1 + 2), (0, SHORT_QUERY + 7), (11, SHORT_QUERY + 2), (30, 1)]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for start, n in rows:
        need = -(-(start + n) // BLOCK)
        tables.append([free.pop() for _ in range(need)])
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "some table must be non-contiguous"

    kv = torch.randn(2, num_blocks * BLOCK, NKV, HD, generator=gen)  # garbage wherever nothing was written
    history = []
    for (start, _), table in zip(rows, tables, strict=True):
        hk, hv = torch.randn(start, NKV, HD, generator=gen), torch.randn(start, NKV, HD, generator=gen)
        kv[0, slots_of(table, range(start))], kv[1, slots_of(table, range(start))] = hk, hv
        history.append((hk, hv))
    total = sum(n for _, n in rows)
    q = torch.randn(total, NH, HD, generator=gen)
    k, v = torch.randn(total, NKV, HD, generator=gen), torch.randn(total, NKV, HD, generator=gen)

    backend = TorchPagedAttention(BLOCK, 8, CPU)
    meta = backend.prepare([(start, n, table) for (start, n), table in zip(rows, tables, strict=True)])
    assert len(meta.groups) == 3, "decode and verify rows share one group; each long chunk has its own"
    scale = 0.3  # not SDPA's default 1/sqrt(head_dim), so a dropped scale shows
    out = backend.forward(q, k, v, kv, meta, scale)

    offset = 0
    for (start, n), table, (hk, hv) in zip(rows, tables, history, strict=True):
        new = slice(offset, offset + n)
        assert meta.positions[new].tolist() == list(range(start, start + n))
        assert meta.slot_mapping[new].tolist() == slots_of(table, range(start, start + n))
        assert torch.equal(kv[0, slots_of(table, range(start, start + n))], k[new])
        assert torch.equal(kv[1, slots_of(table, range(start, start + n))], v[new])
        expected = dense_reference(q[new], torch.cat([hk, k[new]]), torch.cat([hv, v[new]]), start, scale)
        torch.testing.assert_close(out[new].double(), expected, rtol=1e-5, atol=1e-5)
        offset += n


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_positions_and_slots_live_in_one_persistent_buffer_that_grows() -> None:
    backend = TorchPagedAttention(BLOCK, 8, CPU)
    first = backend.prepare([(0, 3, [5]), (6, 1, [2, 7])])
    buffer = storage(first.positions)
    assert storage(first.slot_mapping) == buffer
    second = backend.prepare([(2, 2, [1]), (0, 4, [3])])
    assert storage(second.positions) == storage(second.slot_mapping) == buffer
    assert second.positions.tolist() == [2, 3, 0, 1, 2, 3]
    assert second.slot_mapping.tolist() == [6, 7, 12, 13, 14, 15]
    assert first.positions.tolist() == [2, 3, 0, 1], "documented: the next prepare() overwrites metadata"

    big = backend.prepare([(0, 20, [0, 1, 2, 3, 4])])
    assert backend.capacity >= 20 and storage(big.positions) != buffer
    assert big.positions.tolist() == list(range(20)) and big.slot_mapping.tolist() == list(range(20))
    again = backend.prepare([(4, 1, [9, 8])])
    assert storage(again.positions) == storage(big.positions), "the grown buffer is the new persistent one"
    assert again.slot_mapping.tolist() == [32]


TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=NH, num_kv_heads=NKV,
                   head_dim=HD, max_position=64)


class CountingBackend(TorchPagedAttention):
    """Proves the model runs attention through the backend its metadata names."""

    calls = 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return super().forward(*args)


CHUNKS = [(0, 5, [3, 0]), (0, 2, [1])]


def tiny_model() -> tuple[LlamaModel, torch.Tensor]:
    torch.manual_seed(0)
    return LlamaModel(TINY, 64).eval(), torch.randint(0, TINY.vocab_size, (7,))


def fresh_cache() -> torch.Tensor:
    return new_kv_cache(TINY, 4, BLOCK, torch.float32, CPU)


@torch.inference_mode()
def test_forward_with_hidden_returns_exactly_the_layers_asked() -> None:
    model, ids = tiny_model()
    outputs: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, out))
    backend = CountingBackend(BLOCK, 8, CPU)
    final, hidden = model.forward_with_hidden(ids, fresh_cache(), backend.prepare(CHUNKS), (2, 0))
    assert backend.calls == TINY.num_layers, "attention runs through the metadata's backend"
    assert set(hidden) == {0, 2}
    for i in (0, 2):
        assert torch.equal(hidden[i], outputs[i]), f"layer {i}: the residual stream right after the layer"
    assert not torch.equal(model.norm(outputs[TINY.num_layers - 1]), outputs[TINY.num_layers - 1])
    assert torch.equal(final, model.norm(outputs[TINY.num_layers - 1])), "final hidden is after the norm"

    def meta() -> AttentionMetadata:
        return TorchPagedAttention(BLOCK, 8, CPU).prepare(CHUNKS)

    assert torch.equal(model(ids, fresh_cache(), meta()), final)
    assert model.forward_with_hidden(ids, fresh_cache(), meta(), ())[1] == {}
    with pytest.raises(IndexError, match="out of range"):
        model.forward_with_hidden(ids, fresh_cache(), meta(), (TINY.num_layers,))


@pytest.mark.timing  # held at least 0.2 s
def test_cpu_gate_holds_work_until_open() -> None:
    gate = CpuPlatform().host_gate(timeout_s=10)
    ran = threading.Event()

    def issue() -> None:
        gate.wait()
        ran.set()

    gate.enqueue()
    worker = threading.Thread(target=issue)
    worker.start()
    assert not ran.wait(0.2), "gated work ran before open()"
    gate.open()
    assert ran.wait(5)
    worker.join()
    assert not gate.timed_out
    # When the work reached the gate, when the host opened it and when the work went on: what
    # the remote speculator reports as the time a step waited for its drafter's reply.
    assert 0 < gate.blocked_at < gate.opened_at <= gate.passed_at
    assert gate.opened_at - gate.blocked_at >= 0.2


@pytest.mark.timing  # under a second
def test_cpu_gate_opened_early_or_never_enqueued_does_not_block() -> None:
    early = CpuPlatform().host_gate(timeout_s=10)
    early.enqueue()
    early.open()
    started = time.monotonic()
    early.wait()
    CpuPlatform().host_gate(timeout_s=10).wait()  # nothing gated: nothing to wait for
    assert time.monotonic() - started < 1


@pytest.mark.timing  # the timeout, and 40 ms once open
def test_cpu_gate_opens_itself_on_timeout() -> None:
    gate = CpuPlatform().host_gate(timeout_s=0.05)
    gate.enqueue()
    started = time.monotonic()
    gate.wait()
    assert 0.04 <= time.monotonic() - started < 2 and gate.timed_out
    started = time.monotonic()
    gate.wait()
    assert time.monotonic() - started < 0.04, "a timed-out gate stays open"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_copy_queued_behind_a_shut_stream_gate_leaves_the_host_free() -> None:
    """The runner queues a deferred reply's copy and the step behind a stream gate, then the
    host goes on: every copy it issues there must be one the host does not wait for. A copy
    from pageable memory waits for its stream, so for the gate, so for the reply."""
    from speckernel.runner.host_copy import to_device

    platform = CudaPlatform()
    gate = platform.host_gate(timeout_s=10)
    if type(gate) is HostWaitGate:
        pytest.skip("cuda-bindings is not installed: the host itself waits at the gate")
    gate.enqueue()
    opener = threading.Timer(0.5, gate.open)
    opener.start()
    started = time.monotonic()
    pinned = to_device(np.arange(4), platform.device)
    queued = time.monotonic() - started
    pageable = torch.from_numpy(np.arange(4)).to(platform.device)
    held = time.monotonic() - started
    opener.join()
    assert queued < 0.25 <= held, (queued, held)
    assert pinned.tolist() == pageable.tolist() == [0, 1, 2, 3] and not gate.timed_out


def test_cuda_gate_falls_back_to_host_waiting_without_cuda_bindings() -> None:
    try:
        import cuda.bindings.runtime  # noqa: F401
    except ImportError:
        assert type(CudaPlatform().host_gate()) is HostWaitGate
    else:
        pytest.skip("cuda-bindings is installed")


def test_kv_budget() -> None:
    cpu = CpuPlatform()
    free, total = cpu.memory_info()
    assert 0 < cpu.kv_budget_bytes() <= min(free, total)
    gib = 1 << 30
    for platform, free, budget in [(CpuPlatform(), 100 * gib, gib), (CpuPlatform(), 2 * gib, gib // 2),
                                   (CudaPlatform(), 80 * gib, 40 * gib), (AscendPlatform(), 30 * gib, 15 * gib)]:
        platform.memory_info = lambda free=free: (free, 2 * free)  # type: ignore[method-assign]
        assert platform.kv_budget_bytes() == budget, type(platform).__name__


KERNEL_API = {"name", "capabilities", "is_available", "device", "default_dtype", "device_count", "on_device",
              "memory_info", "kv_budget_bytes",
              "attention_backend", "graph_capture", "host_gate", "synchronize"}


def protocol_members() -> set[str]:
    return {n for n in vars(Platform) if not n.startswith("_")} | set(Platform.__annotations__)


def test_protocol_is_what_the_kernel_uses() -> None:
    assert protocol_members() == KERNEL_API
    assert set(PlatformCapabilities.__struct_fields__) == {
        "device_type", "default_dtype", "dist_backend", "supports_graphs", "triton", "priority",
        "preferred_transports", "packed_weights"}


@pytest.mark.parametrize("cls", PLATFORMS, ids=lambda c: c.name)
def test_preferred_transports_are_installed_and_cross_processes(cls: type) -> None:
    """What a platform prefers carries stages (processes) and ships with speckernel."""
    assert cls.capabilities.preferred_transports
    for name in cls.capabilities.preferred_transports:
        assert registry.load("transport", name).capabilities.cross_process, name


@pytest.mark.parametrize("cls", PLATFORMS, ids=lambda c: c.name)
def test_platform_implements_every_protocol_member(cls: type) -> None:
    assert isinstance(cls.capabilities, PlatformCapabilities) and isinstance(cls.name, str)
    for member in protocol_members() - {"name", "capabilities"}:
        declared, implemented = inspect.getattr_static(Platform, member), inspect.getattr_static(cls, member, None)
        assert type(implemented) is type(declared), f"{cls.__name__}.{member}: {type(implemented)}"
        if isinstance(declared, property):
            continue
        want = list(inspect.signature(getattr(Platform, member)).parameters)
        got = list(inspect.signature(getattr(cls, member)).parameters)
        assert got == want, f"{cls.__name__}.{member}{got} differs from the protocol's {want}"
    assert cls().default_dtype() in (torch.float32, torch.bfloat16)


def test_cpu_graph_capture_is_a_typed_error() -> None:
    with pytest.raises(GraphCaptureUnsupportedError, match="cannot capture") as err:
        CpuPlatform().graph_capture()
    assert isinstance(err.value, NotImplementedError)


class FakeGraph:
    def replay(self) -> None: ...

    def pool(self) -> object:
        return "pool"


def fake_accelerator(**module: Any) -> TorchAcceleratorPlatform:
    class Fake(TorchAcceleratorPlatform):
        name = "fake"
        capabilities = PlatformCapabilities(device_type="fake", default_dtype="bfloat16", dist_backend="gloo")
        graph_class = "FakeGraph"

        @classmethod
        def module(cls) -> Any:
            return SimpleNamespace(**module)

    return Fake(index=1)


def test_accelerator_graph_capture_uses_the_device_module_or_says_it_cannot() -> None:
    with pytest.raises(GraphCaptureUnsupportedError, match="has no FakeGraph"):
        fake_accelerator(graph=None).graph_capture()
    seen: list[Any] = []

    @contextmanager
    def capture(graph: FakeGraph, pool: object | None) -> Any:
        seen.append(("capture", graph, pool))
        yield

    @contextmanager
    def device(index: int) -> Any:
        seen.append(("device", index))
        yield

    platform = fake_accelerator(FakeGraph=FakeGraph, graph=capture, device=device)
    with platform.graph_capture(pool="shared") as graph:
        assert isinstance(graph, FakeGraph)
    assert seen == [("device", 1), ("capture", graph, "shared")]


def test_on_device_picks_a_device_of_the_host_or_names_the_ones_it_has() -> None:
    platform = fake_accelerator(device_count=lambda: 2)
    assert platform.device_count() == 2
    moved = platform.on_device(1)
    assert type(moved) is type(platform) and moved.index == 1
    with pytest.raises(ValueError, match="no device 2 \\(this host has 2\\)"):
        platform.on_device(2)
    cpu = CpuPlatform()
    assert cpu.device_count() == 1 and cpu.on_device(3).device == CPU


def test_metadata_names_its_backend() -> None:
    meta = TorchPagedAttention(BLOCK, 4, CPU).prepare([(0, 1, [0])])
    assert isinstance(meta, AttentionMetadata) and isinstance(meta.backend, TorchPagedAttention)
