"""A packed sample cut into this rank's context-parallel shard.

``make_sample_plan`` builds the LPT plan of a sample's document structure (``fa4dist.context_parallel.make_plan``);
``shard_sample`` returns the local tokens, labels and positions (the sample's own, for RoPE: a window's global
position within the document), the same values at every cp size.
A plan never pads: when the sample's length is not a multiple of the chunk count the last chunk is short and any
chunks past the end are empty, so every local token is a real token of the sample, with its own label (``IGNORE``
only where the sample has it), and the ranks' local lengths add up to the sample's (they may differ by rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..kernels.problem import check_int, type_name
from .packing import IGNORE, Sample, positions_from_cu_seqlens


class SingleRankPlan:
    """The plan of a sample that is not split (cp size 1): the identity, with the document structure.

    It answers the same questions as a context-parallel plan, so the model and the loss have one code path."""

    cp_size = 1

    def __init__(self, cu_seqlens):
        # a tensor or a list of document boundaries (as make_plan takes them, and checked as it checks them)
        from fa4dist.context_parallel import make_plan

        self._plan = make_plan(cu_seqlens, 1)
        self.cu_seqlens = self._plan.cu_seqlens_tensor()
        self.total = int(self.cu_seqlens[-1])

    @staticmethod
    def _check_rank(rank) -> None:
        # None: the one rank (the identity needs no rank); else an int as a ShardPlan takes it (0.0 and False were
        # taken here, refused at cp > 1)
        if rank is not None:
            check_int("rank", rank)
            if rank != 0:
                raise ValueError(f"a single-rank plan has only rank 0, got {rank!r}")

    def shard(self, x: torch.Tensor, seq_dim: int = 1, rank: Optional[int] = None) -> torch.Tensor:
        self._check_rank(rank)
        self._plan._check_seq(x, seq_dim, self.total, "x")  # a tensor of another sample fails as at cp > 1
        return x

    def unshard(self, x_local, seq_dim: int = 1) -> torch.Tensor:
        """As :meth:`ShardPlan.unshard`: a list of the one rank's local tensor, or the tensor itself."""
        if isinstance(x_local, (list, tuple)):
            if len(x_local) != 1:
                raise ValueError(
                    f"unshard needs 1 local tensor (one per rank) or their concatenation, got {len(x_local)}")
            x_local = x_local[0]
        self._plan._check_seq(x_local, seq_dim, self.total, "the local tensor of rank 0")
        return x_local

    def positions(self, rank: Optional[int] = None) -> torch.Tensor:
        self._check_rank(rank)
        return positions_from_cu_seqlens(self.cu_seqlens.cpu())

    def local_cu_seqlens(self, rank: Optional[int] = None) -> torch.Tensor:
        """As :meth:`ShardPlan.local_cu_seqlens`: the local segments, zero-length documents dropped (``cu_seqlens``
        keeps them: the sample's own boundaries)."""
        self._check_rank(rank)
        return self._plan.local_cu_seqlens(0)

    def balance_report(self):
        """As :meth:`ShardPlan.balance_report` (one rank: balanced by definition)."""
        return self._plan.balance_report()


def _check_sample(sample) -> None:
    if not isinstance(sample, Sample):
        raise TypeError(f"sample must be a fa4dist.data.Sample, got {type_name(sample)}")


def make_sample_plan(sample: Sample, cp_size: int, balancer: str = "lpt", num_chunks: Optional[int] = None):
    """The sharding plan of one packed sample over ``cp_size`` ranks (a :class:`SingleRankPlan` for one rank; the
    arguments are checked alike for every size)."""
    from fa4dist.context_parallel import make_plan

    _check_sample(sample)
    plan = make_plan(sample.cu_seqlens, cp_size, balancer=balancer, num_chunks=num_chunks)
    if plan.total_len != sample.tokens.numel():  # (shard_sample then blamed "x" against the sample's own plan)
        raise ValueError(f"sample.cu_seqlens ends at {plan.total_len} but sample.tokens holds "
                         f"{sample.tokens.numel()} tokens: its documents must cover its tokens")
    return SingleRankPlan(sample.cu_seqlens) if cp_size == 1 else plan


@dataclass
class LocalBatch:
    """This rank's part of a packed sample: tokens, labels, positions (all (local_tokens,)) and the plan."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    plan: Any
    rank: int

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def _check_documents(sample: Sample, plan) -> None:
    """The plan must be this sample's: one of another sample as long as it was taken, and the model attended within
    the plan's documents while the labels and positions followed the sample's.  One host read of cu_seqlens."""
    documents = plan.cu_seqlens.tolist() if isinstance(plan, SingleRankPlan) else plan.cu_seqlens_tensor().tolist()
    own = sample.cu_seqlens.tolist()
    if documents != own:
        raise ValueError(f"plan is for the documents cu_seqlens {documents[:8]}{'...' if len(documents) > 8 else ''}, "
                         f"but the sample's are {own[:8]}{'...' if len(own) > 8 else ''}; make the plan from this "
                         "sample (make_sample_plan(sample, cp_size) or model.make_plan(sample.cu_seqlens))")


def shard_sample(sample: Sample, plan, rank: int, device=None) -> LocalBatch:
    """Cuts ``sample`` into rank ``rank``'s shard under ``plan`` (:func:`make_sample_plan`'s: a plan of other
    document boundaries is refused, even one of a sample as long)."""
    from fa4dist.context_parallel import ShardPlan

    _check_sample(sample)
    if not isinstance(plan, (SingleRankPlan, ShardPlan)):
        raise TypeError("plan must be a sharding plan (a SingleRankPlan or a fa4dist.context_parallel.ShardPlan, as "
                        f"make_sample_plan or a model's make_plan make), got {type_name(plan)}")
    # (`device or ...` dropped device=0, torch's cuda:0 and a local rank's usual spelling: rank 0's shard stayed on
    # the sample's device while the others moved)
    device = sample.tokens.device if device is None else torch.device(device)
    if isinstance(plan, SingleRankPlan):
        check_int("rank", rank)  # required as at cp > 1 (where None is refused: the rank is never guessed)
        plan._check_rank(rank)
        tokens = plan.shard(sample.tokens, seq_dim=0)  # a plan of another sample fails as at cp > 1
        _check_documents(sample, plan)
        return LocalBatch(tokens.to(device), sample.labels.to(device), sample.positions.to(device), plan, 0)
    tokens = plan.shard(sample.tokens, seq_dim=0, rank=rank)  # real tokens only: a plan never pads
    _check_documents(sample, plan)
    labels = plan.shard(sample.labels, seq_dim=0, rank=rank)
    # the sample's own positions (as at cp 1), not the plan's document positions: they differ for a sample whose
    # positions do not restart at every boundary of its cu_seqlens, and the model must see the same ones at every size
    positions = plan.shard(sample.positions, seq_dim=0, rank=rank)
    return LocalBatch(tokens.to(device), labels.to(device), positions.to(device), plan, rank)
