"""fa4dist.models.attention: the model's cp-size-1 attention takes and refuses the plans and inputs a cp group's
attention module takes and refuses at cp size 1, and keeps its device copy of cu_seqlens per device."""

from __future__ import annotations

import pytest
import torch

from fa4dist.context_parallel import ShardPlan, make_plan
from fa4dist.data import SingleRankPlan
from fa4dist.models.attention import LocalPackedAttention
from fa4dist.modules import FA4ContextParallelAttention


def _qkv(*shape):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3)]


def _outcome(module, q, k, v, plan):
    try:
        return module(q, k, v, plan)
    except (TypeError, ValueError) as e:
        return e


@pytest.mark.parametrize("plan, shape", [
    (make_plan(16, 1), (16,)),  # a one-sequence plan with packed input: was taken as one document
    (make_plan(16, 1), (1, 16)),  # a one-sequence plan with its own layout: was refused ("q must be 3-D")
    (make_plan([0, 6, 16], 1), (1, 16)),  # a packed plan with one-sequence input
    (make_plan([0, 6, 16], 1), (16,)),
    (make_plan([0, 6, 16], 1), (12,)),  # fewer tokens than the plan covers
    (SingleRankPlan([0, 6, 16]), (1, 16)),
    (SingleRankPlan([0, 6, 16]), (16,)),
    (make_plan([0, 6, 16], 2), (16,)),  # a plan of more ranks
    ([0, 6, 16], (16,)),  # cu_seqlens where the plan goes
])
def test_the_model_attention_takes_and_refuses_what_the_module_does_at_cp_1(plan, shape):
    """LocalPackedAttention (the model's attention without a cp group) ran a one-sequence ShardPlan with packed 3-D
    input as one document, which FA4ContextParallelAttention at cp size 1 refuses by name ("q must be 4-D"), and
    refused that plan's own 4-D input: the same plan and input failed or ran depending on which module got them."""
    q, k, v = _qkv(*shape)
    local = _outcome(LocalPackedAttention(backend="reference"), q, k, v, plan)
    module = _outcome(FA4ContextParallelAttention(backend="reference"), q, k, v, plan)
    if isinstance(module, Exception):
        assert type(local) is type(module) and str(local) == str(module), (local, module)
    else:
        assert isinstance(local, torch.Tensor), local
        torch.testing.assert_close(local, module, rtol=0, atol=0)
    if isinstance(plan, ShardPlan) and plan.cp_size == 1 and not plan.packed and len(shape) == 1:
        assert isinstance(local, ValueError) and "q must be 4-D" in str(local), local


def test_the_device_copy_of_cu_seqlens_follows_the_inputs_device():
    """The copy was kept per plan only: the same plan after the model (or its inputs) moved to another device gave
    the copy on the old device (a device-mismatch error in the kernel call). 'meta' stands in for a second device."""
    attention, plan = LocalPackedAttention(), make_plan([0, 6, 16], 1)
    cpu = attention._cu_seqlens(plan, torch.device("cpu"))
    moved = attention._cu_seqlens(plan, torch.device("meta"))
    assert cpu.device.type == "cpu" and moved.device.type == "meta", (cpu.device, moved.device)
    assert moved.shape == cpu.shape and moved.dtype == cpu.dtype == torch.int32
    again = attention._cu_seqlens(plan, torch.device("cpu"))
    assert again.device.type == "cpu" and again.tolist() == [0, 6, 16]
    assert attention._cu_seqlens(plan, torch.device("cpu")) is again  # kept while plan and device stay
