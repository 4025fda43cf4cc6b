"""Next-token loss over a context-parallel shard, equal to the loss of the unsplit sequence.

Each rank computes the summed cross entropy of its local tokens and divides by the token count of the *whole*
sequence (all-reduced over the cp group).  The cp ranks' losses then add up to the mean over the sequence, and so
do their gradients: summing gradients over the cp group (what FSDP2 with divide factor dp, or DeepSpeed with our
cp group as its sequence-parallel group, does) gives exactly the single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fa4dist.data.packing import IGNORE


def _process_group(group):
    if group is not None and hasattr(group, "get_group"):  # DeviceMesh
        return group.get_group()
    return group


@dataclass
class CPLoss:
    loss: torch.Tensor  # this rank's share: backward through it; the shares add up to the sequence's mean
    tokens: torch.Tensor  # label tokens of the whole sequence (all cp ranks)
    local_tokens: int


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cp_group=None) -> CPLoss:
    """Token-mean cross entropy of the sequence that ``logits``/``labels`` are this rank's shard of."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    local_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    count = (labels != IGNORE).sum().to(logits.dtype)
    local_count = int(count)
    group = _process_group(cp_group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return CPLoss(local_sum / count.clamp(min=1.0), count, local_count)


def reduce_value(value: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A detached copy of ``value`` reduced over ``group`` (identity without one)."""
    value = value.detach().clone()
    group = _process_group(group)
    if dist.is_available() and dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
        if group is not None or dist.get_world_size() > 1:
            dist.all_reduce(value, op=op, group=group)
    return value
