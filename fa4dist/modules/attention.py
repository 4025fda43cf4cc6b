"""`FA4ContextParallelAttention`: context-parallel attention as an ``nn.Module``."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..context_parallel.comm import refusals_posted
from ..context_parallel.core import ContextParallel
from ..context_parallel.plan import ShardPlan, make_plan
from ..data.sharding import SingleRankPlan
from ..kernels.problem import check_int


class FA4ContextParallelAttention(nn.Module):
    """Attention of one long sequence spread over a process group; takes and returns local shards.

    Args:
        group: the context-parallel process group (None, or a group of one rank: plain attention through the
            kernel contract).
        mesh: instead of `group`, a DeviceMesh: 1-D (one cp group) or 2-D with dims ``("ring", "ulysses")``.
        ulysses_group, ring_group: instead of `group`, the two groups of the 2-D strategy.
        strategy: ``"ring"``, ``"ulysses"``, ``"hybrid"`` (Ulysses inside groups of `ulysses_degree` ranks, ring
            across them) or ``"auto"`` (default: a 2-D mesh is hybrid; otherwise the plan's Ulysses degree if it has
            one, else the largest Ulysses degree the head counts allow, ring for the rest).
        causal: causal mask over global positions (default True; positions within a document for packed plans).
        window: ``(left, right)`` sliding window over the same positions, flash-attn's ``window_size`` (-1:
            unbounded; causal + ``(W - 1, 0)`` is a window of W tokens, the query included).  Ring steps whose keys
            no query can see are neither sent nor computed; plans from :meth:`make_plan` are costed with it.
        softcap: scores become ``softcap * tanh(scale * q.k / softcap)`` (None: no capping).
        softmax_scale: default 1/sqrt(head_dim).
        plan: the :class:`~fa4dist.context_parallel.ShardPlan` the inputs were sharded with (or pass it to forward;
            at cp size 1 also :class:`fa4dist.data.SingleRankPlan`, the plan of an unsplit packed sample).
        deterministic: bitwise reproducible backward kernels; default follows
            ``torch.are_deterministic_algorithms_enabled()``.  (Every cross-rank reduction already runs in an
            order fixed by the plan, never by arrival.)
        backend: kernel backend for every block (``"auto"``, ``"reference"``, ``"sdpa"``, ``"cute"``, ...: a name
            :func:`fa4dist.kernels.register_backend` registered, checked at construction).
        ulysses_degree: the Ulysses group size for ``hybrid`` on one process group (given with ``auto``: the degree
            auto runs).
        timeout: seconds any wait on another rank may take before a :class:`~fa4dist.context_parallel.CommError`
            naming what was awaited.
        verify: on every call (forward and backward), exchange a small fingerprint of the call (shapes, dtypes,
            plan, options, which module, call number) through the group's store (host side, no collective), so
            that ranks that disagree all fail at once with one message naming the field and the ranks, instead
            of hanging or computing garbage.  The values of the inputs are not compared (each rank holds its own
            shard), nor those of ``sinks``: a replicated sinks parameter that drifts between ranks is not detected.
            Every rank must pass the same ``verify``: a rank with ``verify=False`` goes on to its transfers while the
            others wait in the check, until the timeout (then every message names ``verify=False``).

        cp_invariant: out, lse and the gradients bitwise identical at every cp size, strategy and balancer, and
            to ``fa4dist.attention(..., cp_invariant=True)`` on one device (default: the environment variable
            ``FA4DIST_CP_INVARIANT=1``).  Implies deterministic kernels.  Costs memory and time: every rank
            gathers the whole sequence's K/V (and, in the backward, Q, dO and out), and its one-pass backward
            exchanges the int64 fixed-point dq of the rows its keys touch (8 bytes per element;
            :mod:`fa4dist.context_parallel.gather`).  With ``sinks``, their gradient summed over the cp group
            is the same bits too (one rank per head holds the whole sequence's, the others zeros).

    ``forward(q, k, v, plan=None, sinks=None)``: dense plans take ``(batch, local_len, heads, head_dim)`` shards,
    packed-document plans ``(local_tokens, heads, head_dim)``; k and v may have fewer heads (GQA).  ``sinks``: a
    (heads_q,) tensor of learnable logits (the same on every rank) that join every row's softmax once; its
    gradient on each rank is that rank's rows' share (sum over the cp group, as a dp x cp gradient reduction does).
    Returns the local output; with ``return_lse=True`` ``(out, lse)``, lse the fp32 natural-log log-sum-exp of this
    rank's rows (``(batch, heads, local_len)``, packed ``(heads, local_tokens)``; the sinks included) and
    differentiable: a loss of it (a z-loss, a merge with other attention) adds its gradient inside the same ring /
    Ulysses backward (joined to its row sums; the backward runs on every rank when any rank's loss used an
    output).  With ``cp_invariant`` its gradient is the same bits at every cp size too (there one more invariant
    backward pass, with v = 0).

    The calls on a process group pair up across ranks by order: make them from one thread at a time (a second
    thread's call raises at once).  A module on a process group is not picklable (``torch.save(model)``): save the
    ``state_dict()``; ``copy.deepcopy`` shares the group.  Ranks match their calls by module number (each rank
    numbers its modules on a group in creation order, deep copies included): create and copy modules on every rank
    alike; a copy made on one rank only (a snapshot, say) is a ``state_dict`` copy.
    """

    def __init__(self, group=None, *, mesh=None, ulysses_group=None, ring_group=None, strategy: str = "auto",
                 causal: bool = True, window: tuple[int, int] = (-1, -1), softcap: Optional[float] = None,
                 softmax_scale: Optional[float] = None, plan: Optional[ShardPlan] = None,
                 deterministic: Optional[bool] = None, backend: str = "auto", ulysses_degree: Optional[int] = None,
                 timeout: float = 300.0, verify: bool = True, cp_invariant: Optional[bool] = None):
        super().__init__()
        if plan is not None and not isinstance(plan, (ShardPlan, SingleRankPlan)):  # as forward takes it
            raise TypeError(f"plan must be a ShardPlan (fa4dist.context_parallel.make_plan), got {type(plan).__name__}")
        with refusals_posted():  # a rank alone in refusing (its environment, say): the others' timeout names it
            self.cp = ContextParallel(group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                                      strategy=strategy, causal=causal, window=window, softcap=softcap,
                                      softmax_scale=softmax_scale,
                                      deterministic=deterministic, backend=backend, ulysses_degree=ulysses_degree,
                                      timeout=timeout, verify=verify, cp_invariant=cp_invariant)
        if plan is not None:  # forward would refuse it on every call
            self._check_plan_size(plan)
        self.plan = plan

    @property
    def cp_size(self) -> int:
        return self.cp.cp_size

    @property
    def cp_rank(self) -> int:
        """This process's rank in plans (``ring_index * ulysses_degree + ulysses_index`` on a 2-D mesh)."""
        return self.cp.cp_rank

    def make_plan(self, seqlen_or_cu_seqlens: Union[int, torch.Tensor, list], balancer: str = "lpt",
                  num_chunks: Optional[int] = None, align: int = 1,
                  heads: Optional[tuple[int, int]] = None) -> ShardPlan:
        """A plan for this module's group, mask and Ulysses degree; shard inputs with ``module.shard(x, plan)``
        (``align``: chunk sizes a multiple of it, see :func:`fa4dist.context_parallel.make_plan`).  ``heads``:
        the (query, key/value) head counts forward will get; with ``strategy="auto"`` the plan is then balanced for
        the Ulysses degree auto will run (without it, for a ring: still correct, but a hybrid run's ring part may
        be less balanced).  A refusal here (of this rank's batch, say) is posted for the ranks it leaves waiting in
        their next call, whose timeout then names it."""
        with refusals_posted():
            if heads is not None:
                if not isinstance(heads, (tuple, list)) or len(heads) != 2:
                    raise TypeError(f"heads must be a pair (query heads, key/value heads), got {heads!r}")
                hq, hkv = (check_int(name, h, 1) for name, h in zip(("heads[0]", "heads[1]"), heads))
                if hq % hkv:
                    raise ValueError(f"heads: {hq} query heads are not a multiple of {hkv} key/value heads")
                heads = (hq, hkv)
            return make_plan(seqlen_or_cu_seqlens, self.cp_size, balancer, num_chunks, causal=self.cp.causal,
                             window=self.cp.window, ulysses_degree=self.cp.plan_ulysses_degree(heads), align=align)

    def _plan(self, plan: Optional[ShardPlan]):
        """A ShardPlan, or at cp size 1 fa4dist.data's SingleRankPlan (of packed documents), as forward takes it."""
        plan = plan if plan is not None else self.plan
        if isinstance(plan, SingleRankPlan) and self.cp_size == 1:
            return plan
        if not isinstance(plan, ShardPlan):
            single = " (fa4dist.data's SingleRankPlan is a plan for cp size 1 only)" if isinstance(
                plan, SingleRankPlan) else ""
            raise TypeError(f"plan must be a ShardPlan (module.make_plan), got {type(plan).__name__}{single}")
        self._check_plan_size(plan)  # (forward refuses it too; a shard under it would be another rank's part)
        return plan

    def _check_plan_size(self, plan: ShardPlan) -> None:
        if plan.cp_size != self.cp.cp_size:
            raise ValueError(f"plan is for cp_size={plan.cp_size} but the module's group has {self.cp.cp_size} "
                             "rank(s) (make it with module.make_plan)")

    def shard(self, x: torch.Tensor, plan: Optional[ShardPlan] = None, seq_dim: Optional[int] = None) -> torch.Tensor:
        """This rank's tokens of a global tensor under `plan` (default: the module's); ``seq_dim`` defaults to 0
        for packed-document plans (and fa4dist.data's SingleRankPlan) and 1 for one sequence ((batch, seqlen, ...))."""
        with refusals_posted():  # (as make_plan)
            plan = self._plan(plan)
            if seq_dim is None:
                seq_dim = 0 if getattr(plan, "packed", True) else 1  # a SingleRankPlan's input is packed, as forward's
            return plan.shard(x, seq_dim=seq_dim, rank=self.cp_rank)

    def positions(self, plan: Optional[ShardPlan] = None) -> torch.Tensor:
        """int64 positions of this rank's tokens (within their document for packed plans): what RoPE needs."""
        with refusals_posted():  # (as make_plan)
            return self._plan(plan).positions(self.cp_rank)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Optional[ShardPlan] = None,
                sinks: Optional[torch.Tensor] = None, return_lse: bool = False):
        return self.cp(q, k, v, plan if plan is not None else self.plan, sinks, return_lse)

    def extra_repr(self) -> str:
        cp = self.cp
        return (f"cp_size={cp.cp_size}, strategy={cp.strategy!r}, causal={cp.causal}, backend={cp.backend!r}"
                + (f", window={cp.window}" if cp.mask.windowed else "")
                + (f", softcap={cp.softcap}" if cp.softcap is not None else "")
                + (f", ulysses_degree={cp.ulysses_degree}" if cp.ulysses_degree else ""))
