"""What the kernel derives at start from declarations alone: the speculation policy from the
speculator's capabilities and the backend's `device_planned`, the KV plan from the config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speckernel.config import EngineConfig
from speckernel.errors import InvalidInputError
from speckernel.kernel.kv_plan import KvPlan, plan_kv_cache
from speckernel.kernel.spec_policy import lookahead_slots, spec_policy
from speckernel.plugin import SpeculatorCapabilities

VARIABLE_DEVICE = SpeculatorCapabilities(draft_width="variable", supports_k0=True, max_k=16)
"""Of a speculator that drafts inside the step (`in_step`)."""
FIXED_HOST = SpeculatorCapabilities(draft_width="fixed", supports_k0=True, max_k=16, lookahead_slots_per_draft=1)
DEVICE_PLANNED, HOST_PLANNED = SimpleNamespace(device_planned=True), SimpleNamespace(device_planned=False)


def test_no_speculator_no_policy() -> None:
    assert spec_policy(None, DEVICE_PLANNED, EngineConfig()) is None  # type: ignore[arg-type]
    assert lookahead_slots(None, 4) == 0


@pytest.mark.parametrize(("caps", "backend", "async_scheduling", "variable_width", "run_ahead"), [
    (VARIABLE_DEVICE, DEVICE_PLANNED, True, False, True),  # padded with -1 on the device; runs ahead
    (VARIABLE_DEVICE, DEVICE_PLANNED, False, False, False),  # run-ahead needs async scheduling
    (VARIABLE_DEVICE, HOST_PLANNED, True, True, False),  # the IDs must reach the host: no run-ahead
    (FIXED_HOST, DEVICE_PLANNED, True, False, False),  # drafts after the step: waits for its frame
])
def test_policy_follows_the_declarations(caps: SpeculatorCapabilities, backend: object, async_scheduling: bool,
                                         variable_width: bool, run_ahead: bool) -> None:
    config = EngineConfig(speculator="x", num_speculative_tokens=3, async_scheduling=async_scheduling,
                          skip_drafts=False)
    policy = spec_policy(caps, backend, config, in_step=caps is VARIABLE_DEVICE)  # type: ignore[arg-type]
    assert policy is not None
    assert (policy.variable_width, policy.run_ahead) == (variable_width, run_ahead)
    assert policy.num_speculative_tokens == 3 and not policy.skip_drafts
    assert policy.lookahead_slots == caps.lookahead_slots(3) == lookahead_slots(caps, 3)


def plan(config: EngineConfig, context: int = 100, budget: int = 10**9) -> KvPlan:
    return plan_kv_cache(config, context=context, target_bytes_per_block=1000, lookahead_slots=4,
                         draft_kv_bytes_per_token=10, budget_bytes=lambda: budget)


def test_kv_plan_counts_blocks_from_the_config_or_the_budget() -> None:
    by_count = plan(EngineConfig(num_kv_blocks=20, block_size=16))
    assert by_count.num_blocks == 20 and by_count.max_model_len == 100
    assert by_count.draft_kv_bytes == 20 * 16 * 10
    assert by_count.blocks_per_request(3) == -(-(100 + 4 + 3 + 1) // 16)
    by_budget = plan(EngineConfig(block_size=16), budget=11600)  # 1000 + 16 * 10 bytes a block
    assert by_budget.num_blocks == 10 and by_budget.max_model_len == 100


def test_kv_plan_shrinks_a_default_context_and_refuses_one_the_user_asked_for() -> None:
    shrunk = plan(EngineConfig(block_size=16), context=200, budget=5 * 1160)
    assert shrunk.max_model_len == 5 * 16 - 4
    with pytest.raises(InvalidInputError, match=r"5 blocks holds 76 tokens per request, below max_model_len 200; "
                                                r"give it 13 blocks"):
        plan(EngineConfig(block_size=16, max_model_len=200), context=200, budget=5 * 1160)
