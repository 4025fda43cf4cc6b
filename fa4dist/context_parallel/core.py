"""Context-parallel attention: resolves the process groups and the strategy, checks that every rank agrees, and runs
Ulysses / ring / 2-D attention as one differentiable function of the local shards.

Every strategy is the same engine: Ulysses groups of ``u`` ranks (all-to-all to head sharding; ``u = 1`` is no
exchange) inside a ring of ``R = cp / u`` members (``R = 1`` is no ring).  ``ring`` is u = 1, ``ulysses`` is
u = cp, ``hybrid`` is anything between, over a 2-D DeviceMesh, two process groups, or one group and
``ulysses_degree``.

The mask (causal, sliding window), softcap and sinks go through every strategy: the schedule skips what the mask
hides, the kernels get the mask and softcap per call, and the sinks (per query head; Ulysses members take their
heads' share) are merged into each row's result once, after the ring (:func:`fa4dist.kernels.merge.merge_sink_`).
The sinks' gradient on each rank is its rows' share: summed over the cp group (as data-parallel gradient reduction
over a dp x cp mesh does for every replicated weight) it is the gradient of the whole sequence.  With
``cp_invariant`` the share is the whole sequence's gradient (one exact sum) on one rank per head and zeros on the
others, so that the sum over the group has the same bits at every cp size.

``return_lse=True`` also returns the local rows' lse, differentiable: its gradient joins the ring's backward
steps (the row sums D - dlse of every work list and of the shared query side, as the contract's ``dlse=``), where
any rank's loss used the lse (the backward is collective: a rank whose loss did not use an output takes zeros for
its gradient).  With ``cp_invariant`` it is a second pass of the invariant engine with v = 0
(:func:`fa4dist.kernels.api.lse_pass`), as the single-device call computes it.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from ..kernels.autograd import attention as _plain_attention
from ..kernels.autograd import add_in_order, forward_ad_refusal, refuse_torch_func
from ..kernels.invariant import enabled as invariant_enabled
from ..kernels.invariant import sum_group
from ..kernels.api import lse_pass
from ..kernels.merge import lse_as_out_layout, merge_sink_, sink_grad
from ..kernels.problem import (
    EAGER_ONLY,
    check_bool, check_mask, check_optional_bool, check_softcap, check_softmax_scale, check_timeout, check_window,
    type_name, validate_inputs,
)
from ..kernels.registry import check_backend, get_backend
from .agreement import LABEL, raise_disagreement, signature_digest
from .comm import (CommError, Transport, deepcopy_sharing, exclusive, group_alive, member_size_rank, post_unverified,
                   post_refusal, refuse_pickling, world_generation)
from .gather import gather_backward, gather_forward
from .peer import TRANSPORT_ENV, requested_transport
from .plan import ShardPlan
from .ring import (KernelOptions, RingPeers, accum_dtype, requested_steps_per_launch, ring_backward,
                   ring_forward)
from .schedule import Schedule
from .ulysses import HeadSplit, UlyssesGroup, requested_chunks

STRATEGIES = ("auto", "ring", "ulysses", "hybrid")




def _resolve_mesh(mesh):
    """(group, ulysses_group, ring_group) from a 1-D or 2-D DeviceMesh."""
    ndim = getattr(mesh, "ndim", None)
    if ndim is None or not hasattr(mesh, "get_group"):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if ndim == 1:
        return mesh.get_group(), None, None
    if ndim != 2:
        raise ValueError(f"mesh must be 1-D (one cp group) or 2-D (ring x ulysses), got {ndim}-D")
    names = tuple(mesh.mesh_dim_names or ())
    if "ulysses" in names and "ring" in names:
        return None, mesh.get_group("ulysses"), mesh.get_group("ring")
    if names:
        raise ValueError(f"a 2-D mesh needs dims named 'ring' and 'ulysses' (or unnamed: ring, ulysses), got {names}")
    return None, mesh.get_group(1), mesh.get_group(0)


def mesh_group(mesh, call: str):
    """The process group spanning every rank of a 1-D mesh, or of a 2-D ('ring', 'ulysses') mesh (flattened: a
    loss's token count, say, is summed over all cp ranks of the grid). ``call`` names the caller in errors."""
    if mesh.ndim == 1:
        return mesh.get_group()
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != {"ring", "ulysses"}:  # (torch flattens named meshes only; a (dp, cp) mesh
        # would sum over data-parallel replicas too)
        raise ValueError(f"{call} takes a 1-D mesh or a 2-D one with mesh_dim_names=('ring', 'ulysses') (all its ranks "
                         f"are the cp group), got a {mesh.ndim}-D mesh named {names or 'nothing'}; pass the cp "
                         "dimension (mesh['cp']) or the cp process group")
    # torch keeps flattened meshes by name on the root mesh: a name flattened from another 2-D submesh of the same
    # root (unflattened differently) is refused, one from this layout is given back.  So the first name that is
    # free or holds this layout (the same on every rank, which holds the same meshes).
    for i in range(64):
        try:
            return mesh._flatten("fa4dist_cp" if i == 0 else f"fa4dist_cp_{i}").get_group()
        except ValueError as err:
            if "has been created before" not in str(err):
                raise
    raise ValueError(f"{call}: 64 other 2-D submeshes of this mesh's root were flattened already; pass the cp group "
                     "as a process group instead")


_INSTANCES: dict = {}  # process groups' key (_groups_key) -> modules created on them so far in this process
# the keys of the (ulysses_group, ring_group) pairs checked to form a 2-D grid (ContextParallel._check_grid).  Per
# pair of groups, not per object: every rank makes the same calls on the groups, so each knows alike whether a check
# is still due, also a rank that refuses a functional call before it has an object of the call's options
# (_refuse_functional).
_GRIDS: set = set()


def _groups_key(*groups) -> tuple:
    """The key of process groups in this process's per-group records: their names (the same on every rank, unique
    within a world) and the world's number; not their ids, which a group made after another was freed can reuse on
    some ranks and not on others (its modules would be numbered on from the dead group's on those ranks only)."""
    if all(g is None for g in groups):
        return (0,) + groups
    return (world_generation(),) + tuple(None if g is None else g.group_name for g in groups)


_WARNED_DEGREES: set = set()  # (plan's Ulysses degree, the call's): warned once per process


def _warn_degree_mismatch(plan: ShardPlan, u: int, cp_size: int) -> None:
    """Warns once per pair of degrees where a call runs a ring part (u < cp) of another Ulysses degree than its plan
    was balanced for: exact, but the plan's balance (and ``balance_report()``) is that of its own degree's ring
    groups, not of the ones that run (a ring plan run at u = 2 was up to 1.04x off, a hybrid plan run as a ring up
    to 1.5x)."""
    key = (plan.ulysses_degree, u)
    if u == plan.ulysses_degree or u >= cp_size or key in _WARNED_DEGREES:
        return
    _WARNED_DEGREES.add(key)
    warnings.warn(
        f"{LABEL}: a plan made for ulysses_degree={plan.ulysses_degree} runs at Ulysses degree {u} (a ring of "
        f"{cp_size // u} groups): the result is exact, but the plan balanced {plan.ring_degree} ring groups, not "
        f"these; make it with ulysses_degree={u} (module.make_plan(..., heads=(query heads, key/value heads)) "
        "chooses it for strategy='auto')", stacklevel=3)


def _next_instance(key: tuple) -> int:
    """The number of a new module on these process groups: modules are numbered in the order a rank creates them
    on the groups, which is the same on every rank that builds the same model.  The agreement checks compare it,
    so two modules called in different orders on different ranks fail instead of pairing the wrong calls."""
    if key[0]:  # the records of earlier worlds are dropped
        for old in [k for k in _INSTANCES if k[0] and k[0] != key[0]]:
            del _INSTANCES[old]
    number = _INSTANCES.get(key, 0)
    _INSTANCES[key] = number + 1
    return number


def _lse_layout(rows: torch.Tensor) -> torch.Tensor:
    """An lse (..., heads, seqlen) from its one-column out layout (:func:`~fa4dist.kernels.merge.lse_as_out_layout`,
    the form the Ulysses exchange moves)."""
    return rows.squeeze(-1).transpose(-1, -2).contiguous()


class _Call:
    """Everything one forward/backward needs; kept by the autograd graph.

    With Ulysses the member's heads run in head chunks (:class:`~fa4dist.context_parallel.ulysses.HeadChunk`; one
    chunk of all its heads unless ``FA4DIST_ULYSSES_CHUNKS`` asks for more): chunk c + 1's exchange is posted before
    chunk c is computed, and chunk c's result is posted back before c + 1 is.  Each chunk keeps its own tensors for
    the backward, which runs the chunks the same way."""

    def __init__(self, sched, ring, uly, split, opts, heads_q, heads_kv, call_id=0, agree=None, invariant=False,
                 signature=None, groups=(), any_rank=None, return_lse=False, chunks=1):
        self.sched, self.ring, self.uly, self.split, self.opts = sched, ring, uly, split, opts
        self.groups = groups  # the process groups the backward exchanges on (one thread at a time: comm.exclusive)
        self.heads_q, self.heads_kv = heads_q, heads_kv
        self.invariant = invariant  # cp_invariant: the gather engine (fa4dist.context_parallel.gather)
        self.call_id, self.agree = call_id, agree  # agree: ContextParallel.agree, or None without verification
        self.signature = signature  # the forward call's agreed signature (its backward's check names it)
        # return_lse: the lse is an output with a gradient; any_rank(flags) -> each flag or'ed over the cp group
        self.return_lse, self.any_rank = return_lse, any_rank
        self.chunks = [None] if uly is None else split.chunks(chunks)  # None: every head, no exchange
        self.local_shapes = None  # (out, lse, q, k, v) of this rank's tokens, set by forward

    def member_sinks(self, sinks, chunk):
        """The sinks of the query heads this rank computes in ``chunk`` (its Ulysses share), or None."""
        if sinks is None or chunk is None:
            return sinks
        lo, hi = chunk.q_heads(self.uly.index)
        return sinks[lo:hi]

    @staticmethod
    def _to_heads(chunk, **tensors) -> list:
        """The Ulysses exchange items of ``chunk``: k and v by its key/value heads, the rest (q, dout, the lse's
        gradient) by its query heads."""
        return [(t, chunk.kv_heads if name in ("k", "v") else chunk.q_heads, name) for name, t in tensors.items()]

    # ---- forward ----------------------------------------------------------------------------------------------

    def forward(self, q, k, v, sinks):
        """(out, lse or None, what the backward keeps: per chunk its q, k, v, out and lse in head layout)."""
        uly, heads_q = self.uly, self.heads_q
        if uly is None:
            out_m, lse_m = self._attend(q, k, v, sinks, None)
            # (the caller's lse is its own copy, theirs to update in place: the saved one stays)
            lse = lse_m.clone() if self.return_lse else None
            self.local_shapes = (out_m.shape, None if lse is None else lse.shape, q.shape, k.shape, v.shape)
            return out_m, lse, [q, k, v, out_m, lse_m]
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        # the rows' lse travels as a one-column out (lse_as_out_layout)
        lse_rows = q.new_empty((*q.shape[:-1], 1), dtype=accum_dtype(q.dtype)) if self.return_lse else None
        chunks, saved, returns = self.chunks, [], []
        with uly.abandoned_on_failure("forward"):
            incoming = uly.post_seq_to_head(self._to_heads(chunks[0], q=q, k=k, v=v), 0)
            for c, chunk in enumerate(chunks):
                following = (uly.post_seq_to_head(self._to_heads(chunks[c + 1], q=q, k=k, v=v), c + 1)
                             if c + 1 < len(chunks) else None)
                qc, kc, vc = incoming.wait()
                out_m, lse_m = self._attend(qc, kc, vc, sinks, chunk)
                items, into = [(out_m, chunk.q_heads, heads_q, "out", False)], [out]
                if self.return_lse:
                    items.append((lse_as_out_layout(lse_m), chunk.q_heads, heads_q, "lse", False))
                    into.append(lse_rows)
                returns.append(uly.post_head_to_seq(items, into, c))
                saved += [qc, kc, vc, out_m, lse_m]
                incoming = following
            for back in returns:
                back.wait()
        lse = _lse_layout(lse_rows) if self.return_lse else None
        self.local_shapes = (out.shape, None if lse is None else lse.shape, q.shape, k.shape, v.shape)
        return out, lse, saved

    def _attend(self, q, k, v, sinks, chunk):
        """(out in q's dtype, fp32 lse) of this member's rows in these heads over every key, the sinks merged."""
        if self.invariant:
            acc = gather_forward(self.sched, self.ring, q, k, v, self.opts, self._head_map(q, chunk))
        else:
            acc = ring_forward(self.sched, self.ring, q, k, v, self.opts,
                               steps_per_launch=self.signature["ring_steps_per_launch"])
        member_sinks = self.member_sinks(sinks, chunk)
        if member_sinks is not None:  # the sinks' virtual key block, once per row, after every real key
            merge_sink_(acc.out, acc.lse, member_sinks)
        return acc.out.to(q.dtype), acc.lse

    def _head_map(self, q, chunk) -> torch.Tensor:
        """For each query head of ``chunk`` here, the key/value head of the chunk it reads (cp_invariant expands
        K/V to them)."""
        group = self.heads_q // self.heads_kv
        lo, kv_lo = (0, 0) if chunk is None else (chunk.q_heads(self.uly.index)[0],
                                                  chunk.kv_heads(self.uly.index)[0])
        return torch.tensor([(lo + i) // group - kv_lo for i in range(q.shape[-2])], dtype=torch.int64)

    # ---- backward ---------------------------------------------------------------------------------------------

    def backward(self, dout, dlse, saved, sinks, create_graph: bool = False):
        """The gradients of (q, k, v, sinks) given out's gradient ``dout`` and the lse's ``dlse`` (either None: that
        output unused on this rank); ``saved``: what :meth:`forward` kept.  The ring's steps take the lse's
        gradient with out's (joined to the row sums, as the contract's ``dlse=``).  With cp_invariant it is a
        second pass of the invariant engine, as on one device: with the operands of
        :func:`fa4dist.kernels.api.lse_pass` (v = 0) the backward computes exactly the lse's share of dq, dk (and
        the sinks'); v has none."""
        if self.agree is not None:  # every rank must be back-propagating the same forward call, the same way
            self.agree("the backward of forward call", self.call_id,
                       dict(self.signature, direction="backward", create_graph=create_graph))
        if create_graph:  # (after the check: a rank that raised alone would leave the others waiting in it)
            raise RuntimeError(
                f"{LABEL}: double backward (create_graph=True) is not supported across ranks: the ring and "
                "Ulysses backward have no derivative of their own.  Differentiate once, or run the second-order "
                "computation without context parallelism (fa4dist.attention supports it)"
            )
        dtype, device = saved[0].dtype, saved[0].device
        with_out, with_lse = dout is not None, dlse is not None
        if self.return_lse:  # the backward is collective: it runs where any rank's loss used an output
            with_out, with_lse = self.any_rank([with_out, with_lse], f"the backward of forward call {self.call_id}")
        with_out = with_out or not with_lse  # (neither output used anywhere: out's backward of a zero gradient)
        out_shape, lse_shape = self.local_shapes[:2]
        if with_out:
            dout = torch.zeros(out_shape, dtype=dtype, device=device) if dout is None else dout
            dout = dout.to(dtype).contiguous()
        if with_lse:
            dlse = torch.zeros(lse_shape, dtype=accum_dtype(dtype), device=device) if dlse is None else dlse
            dlse = dlse.to(accum_dtype(dtype))
        if self.uly is None:
            grads = self._chunk_grads(None, dout, dlse, saved, sinks, dtype)
            dsinks = None if sinks is None else [grads["dsinks"]]
            return self._finish(grads["dq"], grads["dk"], grads["dv"], dsinks, sinks, dtype)
        return self._ulysses_backward(dout, dlse, saved, sinks, dtype)

    def _chunk_grads(self, chunk, dout, dlse, saved, sinks, dtype) -> dict:
        """The gradients of one chunk's heads (``saved``: its q, k, v, out and lse) in head layout: dq in ``dtype``;
        dk a list, one per pass (the ring's one pass; cp_invariant's out and lse passes, per query head); dv (per
        query head with cp_invariant; None there without a loss of out) in fp32; dsinks (heads lo, hi, the sinks'
        gradient there in their dtype) or None."""
        q, k, v, out_m, lse_m = saved
        lo, hi = (0, self.heads_q) if chunk is None else chunk.q_heads(self.uly.index)
        zeros = None if sinks is None else torch.zeros(hi - lo, dtype=sinks.dtype, device=sinks.device)
        if self.invariant:  # each pass's results in the inputs' dtypes, added as autograd adds two uses' gradients
            passes = [(dout, v, out_m)] if dout is not None else []
            if dlse is not None:
                passes.append(lse_pass(dlse, out_m, v, dtype))
            grads = [gather_backward(self.sched, self.ring, d, q, k, vv, o, lse_m, self.opts,
                                     self._head_map(q, chunk), self.member_sinks(sinks, chunk))
                     for d, vv, o in passes]
            dsinks = None
            if sinks is not None:  # (the sinks' whole-sequence gradient is the ring's first member's; zeros elsewhere)
                dsinks = (lo, hi, add_in_order([zeros if g[3] is None else g[3].to(sinks.dtype) for g in grads]))
            return dict(dq=add_in_order(g[0].to(dtype) for g in grads), dk=[g[1] for g in grads],
                        dv=grads[0][2] if dout is not None else None, dsinks=dsinks)
        # one ring pass: the lse's gradient joins the row sums (D - dlse); a loss of the lse alone passes dout None
        # (the work lists give zeros to the kernels that take a dout; a backend without lse_gradient runs the lse's
        # pass alone)
        dlse = None if dlse is None else dlse.contiguous()  # (backward made it the accumulation dtype)
        dq, dk, dv = ring_backward(self.sched, self.ring, dout, q, k, v, out_m, lse_m, self.opts, dlse=dlse,
                                   steps_per_launch=self.signature["ring_steps_per_launch"])
        dsinks = None
        if sinks is not None:  # this rank's rows' share of the sinks' gradient (in its heads)
            dsinks = (lo, hi, sink_grad(dout, out_m, lse_m, self.member_sinks(sinks, chunk), dlse).to(sinks.dtype)
                      if out_m.numel() else zeros)
        return dict(dq=dq.to(dtype), dk=[dk], dv=dv, dsinks=dsinks)

    def _ulysses_backward(self, dout, dlse, saved, sinks, dtype):
        """:meth:`backward` over the head chunks: chunk c + 1's dout (and dlse) travel while chunk c's gradients
        are computed, and chunk c's gradients travel back to the tokens' ranks while c + 1's are computed."""
        uly, chunks, heads_q = self.uly, self.chunks, self.heads_q
        _, _, q_shape, k_shape, v_shape = self.local_shapes
        acc, device = accum_dtype(dtype), saved[0].device
        rep = self.split.kv_replicated  # replicated KV heads: sent in fp32, summed over members in member order
        if self.invariant:  # per query head, in fp32: each pass's summed over its group at the end (_finish)
            kv_total, reduce, grad_dtype = heads_q, False, acc
            kv_shapes = [(*shape[:-2], heads_q, shape[-1]) for shape in (k_shape, v_shape)]
        else:
            kv_total, reduce, grad_dtype = self.heads_kv, rep, acc if rep else dtype
            kv_shapes = [k_shape, v_shape]
        make = torch.zeros if reduce else torch.empty
        n_dk = 1 if not self.invariant else int(dout is not None) + int(dlse is not None)
        dq = torch.empty(q_shape, dtype=dtype, device=device)
        dk = [make(kv_shapes[0], dtype=grad_dtype, device=device) for _ in range(n_dk)]
        dv = make(kv_shapes[1], dtype=grad_dtype, device=device) if dout is not None or not self.invariant else None
        dsinks = [] if sinks is not None else None  # each chunk's (lo, hi, values)
        inputs = dict(dout=dout) if dout is not None else {}
        if dlse is not None:  # (the lse's gradient travels as a one-column out)
            inputs["dlse"] = lse_as_out_layout(dlse)
        returns = []
        with uly.abandoned_on_failure("backward"):
            incoming = uly.post_seq_to_head(self._to_heads(chunks[0], **inputs), 0)
            for c, chunk in enumerate(chunks):
                following = (uly.post_seq_to_head(self._to_heads(chunks[c + 1], **inputs), c + 1)
                             if c + 1 < len(chunks) else None)
                got = incoming.wait()
                dout_c = got.pop(0) if dout is not None else None
                dlse_c = _lse_layout(got.pop(0)) if dlse is not None else None
                grads = self._chunk_grads(chunk, dout_c, dlse_c, saved[5 * c:5 * c + 5], sinks, dtype)
                kv_heads = chunk.q_heads if self.invariant else chunk.kv_heads
                items, into = [(grads["dq"], chunk.q_heads, heads_q, "dq", False)], [dq]
                for i, g in enumerate(grads["dk"]):
                    items.append((g.to(grad_dtype), kv_heads, kv_total, "dk" if i == 0 else "the lse's dk", reduce))
                    into.append(dk[i])
                if dv is not None:
                    items.append((grads["dv"].to(grad_dtype), kv_heads, kv_total, "dv", reduce))
                    into.append(dv)
                if dsinks is not None:
                    dsinks.append(grads["dsinks"])
                returns.append(uly.post_head_to_seq(items, into, c))
                incoming = following
            for back in returns:
                back.wait()
        return self._finish(dq, dk, dv, dsinks, sinks, dtype)

    def _finish(self, dq, dk, dv, dsinks, sinks, dtype):
        """(dq, dk, dv, dsinks) of the local tokens in the inputs' dtypes from the passes' dk (and dv): summed over
        each key/value head's query heads first with cp_invariant (ascending order; each pass's own sum, then the
        passes added in order).  ``dsinks``: the chunks' (lo, hi, values) of the sinks' gradient, or None."""
        if dsinks is not None:
            parts, dsinks = dsinks, torch.zeros(sinks.shape, dtype=sinks.dtype, device=sinks.device)
            for lo, hi, values in parts:
                dsinks[lo:hi] = values
        if self.invariant:
            group = self.heads_q // self.heads_kv
            dk = add_in_order(sum_group(g, group, dtype) for g in dk)
            v_shape = self.local_shapes[4]
            dv = sum_group(dv, group, dtype) if dv is not None else torch.zeros(v_shape, dtype=dtype,
                                                                                    device=dq.device)
        else:
            dk = dk[0]
        return dq, dk.to(dtype), dv.to(dtype), dsinks


class _ContextParallelFunction(torch.autograd.Function):
    """(out, lse) of the local shards; the lse differentiable with the call's ``return_lse`` (else None)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: _Call):
        out, lse, saved = call.forward(q, k, v, sinks)
        ctx.call = call
        ctx.save_for_backward(*saved, sinks)
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None (its backward may be skipped)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        call = ctx.call
        *saved, sinks = ctx.saved_tensors
        with exclusive(call.groups, f"the backward of forward call {call.call_id}", LABEL):
            dq, dk, dv, dsinks = call.backward(dout, dlse, saved, sinks, create_graph=torch.is_grad_enabled())
        return dq, dk, dv, dsinks, None

    jvp = forward_ad_refusal(LABEL)


class ContextParallel:
    """Context-parallel attention over a process group (or mesh); call it with the local q, k, v shards.

    See :class:`fa4dist.modules.FA4ContextParallelAttention` for the options."""

    def __init__(self, group=None, *, mesh=None, ulysses_group=None, ring_group=None, strategy: str = "auto",
                 causal: bool = True, window: tuple[int, int] = (-1, -1), softcap: Optional[float] = None,
                 softmax_scale: Optional[float] = None, deterministic: Optional[bool] = None,
                 backend: str = "auto", ulysses_degree: Optional[int] = None, timeout: float = 300.0,
                 verify: bool = True, cp_invariant: Optional[bool] = None):
        self.cp_invariant = invariant_enabled(cp_invariant)
        if not isinstance(strategy, str) or strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.mask = check_mask(causal, window)
        self.softcap = check_softcap(softcap)
        check_optional_bool("deterministic", deterministic)
        check_bool("verify", verify)  # verify=0 would silently turn the agreement checks off
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {type(backend).__name__}")
        if backend != "auto":
            get_backend(backend)  # a name the registry does not know fails here, not on the first call
        if softmax_scale is not None:
            check_softmax_scale(softmax_scale, 1)
        check_timeout(timeout)
        if ulysses_degree is not None and (isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int)
                                           or ulysses_degree < 1):
            raise ValueError(f"ulysses_degree must be a positive int or None, got {ulysses_degree!r}")
        if mesh is not None:
            if group is not None or ulysses_group is not None or ring_group is not None:
                raise ValueError("pass either mesh or process groups (group / ulysses_group + ring_group), not both")
            group, ulysses_group, ring_group = _resolve_mesh(mesh)
        if (ulysses_group is None) != (ring_group is None):
            raise ValueError("ulysses_group and ring_group must be given together (the 2-D strategy)")
        if ulysses_group is not None and group is not None:
            raise ValueError("pass either group or ulysses_group + ring_group, not both")
        self.strategy, self.causal, self.softmax_scale = strategy, causal, softmax_scale
        self.window = check_window(window)
        self.deterministic, self.backend, self.timeout, self.verify = deterministic, backend, float(timeout), verify
        self.ulysses_degree = ulysses_degree
        self.group, self.ulysses_group, self.ring_group = group, ulysses_group, ring_group
        self.grid = ulysses_group is not None
        if self.grid:
            u, self._uly_rank = member_size_rank(ulysses_group, "ulysses_group")
            r, self._ring_rank = member_size_rank(ring_group, "ring_group")
            self.cp_size, self.cp_rank = u * r, self._ring_rank * u + self._uly_rank
            if strategy not in ("auto", "hybrid"):
                raise ValueError(f"two process groups (or a 2-D mesh) mean strategy='hybrid', got {strategy!r}")
            if ulysses_degree is not None and ulysses_degree != u:
                raise ValueError(f"ulysses_degree={ulysses_degree} disagrees with the ulysses group's size {u}")
        elif group is not None:
            self.cp_size, self.cp_rank = member_size_rank(group, "group")
        else:
            self.cp_size, self.cp_rank = 1, 0
        sized = ulysses_degree is not None and not self.grid and self.cp_size > 1  # (a degree to check against)
        if sized and self.cp_size % ulysses_degree:
            raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide the cp size ({self.cp_size})")
        # a ring with a Ulysses degree contradicts itself at every cp size (so refused at cp 1 too, where a model
        # checks its options before it runs on a cp group); Ulysses spans the whole cp group
        if (strategy == "ring" and ulysses_degree not in (None, 1)
                or strategy == "ulysses" and sized and ulysses_degree != self.cp_size):
            raise ValueError(f"ulysses_degree={ulysses_degree} contradicts strategy={strategy!r}")
        self._transports: dict = {}
        self._schedules: dict = {}
        # forward calls made (every rank makes the same ones: checked per call), in a list that the functional
        # form's objects on one process group share (_functional_bucket)
        self._calls = [0]
        self.instance = _next_instance(self._group_key())

    def _group_key(self) -> tuple:
        return _groups_key(self.group, self.ulysses_group, self.ring_group)

    def _groups(self) -> tuple:
        """The process groups this object exchanges on."""
        return tuple(g for g in (self.group, self.ulysses_group, self.ring_group) if g is not None)

    def __deepcopy__(self, memo):
        # the copy shares the process groups and their transports (neither can be copied), copies the rest, and
        # is a module of its own on the groups: the next instance number (every rank copies in the same order)
        new = deepcopy_sharing(self, memo, ("group", "ulysses_group", "ring_group", "_transports"))
        new.instance = _next_instance(new._group_key())
        return new

    def __getstate__(self):
        # pickle, torch.save(model), multiprocessing: refused naming the module and the remedy (without groups,
        # cp size 1, there is nothing to refuse)
        return refuse_pickling(self, f"{LABEL}: a context-parallel attention module",
                               ("group", "ulysses_group", "ring_group"), "build the model on its process group")

    # ---- strategy ---------------------------------------------------------------------------------------------

    def plan_ulysses_degree(self, heads: Optional[tuple[int, int]] = None) -> int:
        """The Ulysses degree a plan should balance for, where it is known before the head counts are; with
        ``heads`` = (query heads, key/value heads), also auto's choice from them (what :meth:`degree` then runs)."""
        if self.grid:
            return self._group_size(self.ulysses_group)
        if self.cp_size == 1:  # no group: plain attention, whatever ulysses_degree the module would use at cp > 1
            return 1
        if self.strategy == "ulysses":
            return self.cp_size
        if self.strategy in ("hybrid", "auto") and self.ulysses_degree is not None:
            return self.ulysses_degree
        if self.strategy == "auto" and heads is not None:
            return max(HeadSplit.feasible_degrees(heads[0], heads[1], self.cp_size))
        return 1

    @staticmethod
    def _group_size(group) -> int:
        return member_size_rank(group)[0]

    def degree(self, heads_q: int, heads_kv: int, plan: ShardPlan) -> int:
        """The Ulysses degree u of this call (1: ring only; cp: Ulysses only); raises if the heads forbid it."""
        cp = self.cp_size
        if self.grid:
            u = self._group_size(self.ulysses_group)
        elif self.strategy == "ring":
            return 1
        elif self.strategy == "ulysses":
            u = cp
        elif self.strategy == "hybrid":
            u = self.ulysses_degree or (plan.ulysses_degree if plan.ulysses_degree > 1 else None)
            if u is None:
                raise ValueError(
                    "strategy='hybrid' on one process group needs ulysses_degree= (or a plan made with "
                    "ulysses_degree, or a 2-D mesh / ulysses_group + ring_group)"
                )
        else:  # auto: the plan's degree, else the largest Ulysses degree the heads allow (fewest ring steps)
            if self.ulysses_degree is not None:
                u = self.ulysses_degree
            elif plan.ulysses_degree > 1 and HeadSplit.problem(heads_q, heads_kv, plan.ulysses_degree) is None:
                u = plan.ulysses_degree
            else:
                u = max(HeadSplit.feasible_degrees(heads_q, heads_kv, cp))
        if u > 1:
            HeadSplit.check(heads_q, heads_kv, u, cp, groups=self.grid)
        return u

    def strategy_name(self, u: int) -> str:
        return "ring" if u == 1 else "ulysses" if u == self.cp_size else "hybrid"

    # ---- groups -----------------------------------------------------------------------------------------------

    def _transport(self, group) -> Transport:
        key = id(group)
        if key not in self._transports:
            # unchecked calls (verify=False) say so in every failure: a rank that checks waits in its agreement
            # check while this one moves on to its transfers, and neither wait can name the other
            label = LABEL if self.verify else f"{LABEL} (verify=False: calls not compared across ranks)"
            if not self.verify:
                post_unverified(group)
            self._transports[key] = (group, Transport(group, self.timeout, label))
        return self._transports[key][1]

    def _peers(self, u: int):
        """(RingPeers, ulysses transport, ulysses peers, ulysses index) for Ulysses degree u."""
        if self.grid:
            rt, ut = self._transport(self.ring_group), self._transport(self.ulysses_group)
            R = rt.size
            return RingPeers(rt, list(range(R)), self._ring_rank), ut, list(range(u)), self._uly_rank
        t = self._transport(self.group)
        R, i, j = self.cp_size // u, self.cp_rank // u, self.cp_rank % u
        ring = RingPeers(t, [m * u + j for m in range(R)], i)
        return ring, t, [i * u + jj for jj in range(u)], j

    # ---- checks -----------------------------------------------------------------------------------------------

    def _local_check(self, q, k, v, plan, sinks):
        """(the signature every rank must share, the Ulysses degree); raises on bad local input."""
        if plan is None:  # checked with the rest, so that the ranks that have a plan fail with this one at once
            raise ValueError(
                "context-parallel attention needs the plan the inputs were sharded with (plan=; build one with "
                "fa4dist.context_parallel.make_plan or FA4ContextParallelAttention.make_plan)"
            )
        if not isinstance(plan, ShardPlan):
            raise TypeError(
                f"plan must be a ShardPlan (fa4dist.context_parallel.make_plan), got {type(plan).__name__}"
            )
        if plan.cp_size != self.cp_size:
            raise ValueError(f"the plan is for cp_size={plan.cp_size} but the process group has {self.cp_size} ranks")
        sd = _check_shard_layout(q, k, v, plan.packed)
        refuse_torch_func(LABEL, q, k, v, sinks)
        n = plan.local_len(self.cp_rank)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[sd] != n:
                raise ValueError(
                    f"{name} holds {t.shape[sd]} tokens but the plan gives cp rank {self.cp_rank} {n} (shard the "
                    f"global tensors with plan.shard(x, seq_dim={sd}, rank={self.cp_rank}))"
                )
        transport = requested_transport()
        if transport == "peer" and not q.is_cuda:
            raise ValueError(f"{TRANSPORT_ENV}=peer (copy-engine copies between the processes of one host) needs "
                             f"CUDA tensors, got q on {q.device}; unset it for CPU tensors")
        if transport == "peer" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{TRANSPORT_ENV}=peer cannot be captured in a CUDA graph (each transfer waits for a "
                             f"batch number that a replay would not renew); use {TRANSPORT_ENV}=group there")
        options = dict(causal=self.causal, window=self.window, softcap=self.softcap, sinks=sinks,
                       softmax_scale=self.softmax_scale)
        if plan.packed:
            cu = torch.tensor([0, n], dtype=torch.int32)
            problem = validate_inputs(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **options)
        else:
            problem = validate_inputs(q, k, v, **options)
        # a backend that cannot run on this device fails here, through the agreement check; in the ring it failed
        # at the first kernel call, with the first step's transfers posted: the group was left out of step
        check_backend(self.backend, problem.device)
        u = self.degree(problem.heads_q, problem.heads_kv, plan)
        _warn_degree_mismatch(plan, u, self.cp_size)
        t = self._transport(self.ulysses_group if self.grid else self.group)
        if t.backend == "nccl" and not q.is_cuda:
            raise ValueError("an NCCL process group needs CUDA tensors (use a gloo group for CPU tensors)")
        docs = f" in {len(plan.cu_seqlens) - 1} documents" if plan.packed else ""
        shared = dict(
            direction="forward",  # a backward's check against another rank's forward call names both
            strategy=self.strategy_name(u), ulysses_degree=u, cp_size=self.cp_size, mask=str(self.mask),
            softcap=self.softcap, sinks=str(sinks.dtype) if sinks is not None else None,
            softmax_scale=problem.softmax_scale, deterministic=self._deterministic(), backend=self.backend,
            plan=f"{plan.fingerprint} ({plan.total_len} tokens{docs}, {plan.num_chunks} chunks, "
                 f"ulysses_degree {plan.ulysses_degree})",
            dtype=str(problem.dtype), device=problem.device.type,
            batch=None if plan.packed else problem.batch, heads_q=problem.heads_q, heads_kv=problem.heads_kv,
            head_dim=problem.head_dim, head_dim_v=problem.head_dim_v,
            grad=bool(torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))),
            cp_invariant=self.cp_invariant, module=self.instance,
            ring_steps_per_launch=requested_steps_per_launch(), ulysses_chunks=requested_chunks(),
            transport=transport,
        )
        return shared, u

    def _deterministic(self) -> bool:
        if self.cp_invariant:
            return True
        return torch.are_deterministic_algorithms_enabled() if self.deterministic is None else self.deterministic

    def _stages(self) -> list:
        """The transports an agreement check runs over, in order: one group, or the Ulysses then the ring group
        (every pair of ranks is then connected through the two stages)."""
        if self.grid:
            return [self._transport(self.ulysses_group), self._transport(self.ring_group)]
        return [self._transport(self.group)]

    def agree(self, what: str, call: int, sig: Optional[dict], error: Optional[Exception] = None) -> None:
        """Checks that every rank makes the same call: a small fingerprint (signature digest, call number, error
        flag) exchanged per stage through the group's store (host-side: no GPU sync, no collective).  Only when
        something differs do the ranks exchange their full signatures, so that every rank raises the same message
        naming the fields and ranks (never a hang or garbage)."""
        digest = signature_digest(sig)
        found = 0
        for stage in self._stages():
            rows = stage.host_gather_ints([digest, call, int(error is not None), found],
                                          f"the agreement check of {what} {call}")
            if any(r[2] or r[3] for r in rows) or len({(r[0], r[1]) for r in rows}) > 1:
                found = 1
        if found:
            raise_disagreement(self._stages(), self.cp_rank, what, call, sig, error)

    def _check_alive(self) -> None:
        """The process groups are those of the current world: a destroyed one (destroy_process_group, of it or of the
        world before a new init_process_group) fails here, before its name's agreement exchange could mix with
        those of a live group that has it now, and not deep in the transfers."""
        for name in ("group", "ulysses_group", "ring_group"):
            group = getattr(self, name)
            if group is not None and not group_alive(group):
                raise RuntimeError(
                    f"{LABEL}: this module's {name} was destroyed (torch.distributed.destroy_process_group, of the "
                    "group or of the whole world); build the module on a process group of the current world")

    def _check_grid(self) -> None:
        """The two groups of the 2-D strategy form its grid: the ranks of a Ulysses group share one ring rank and
        those of a ring group one Ulysses rank.  Otherwise a ring step would exchange the keys of other heads with
        a rank of another Ulysses index, and a Ulysses group hold tokens of other ring members: a silently wrong
        result.  Once per pair of groups, on the first call of any object on them (inputs play no part); a
        mismatch anywhere is passed on through the stages (Ulysses, ring, Ulysses), so every rank raises instead of
        waiting for a rank that did."""
        if not self.grid:
            return
        key = _groups_key(self.ulysses_group, self.ring_group)
        if key in _GRIDS:
            return
        uly, ring = self._transport(self.ulysses_group), self._transport(self.ring_group)
        found, seen = 0, {}
        # each round carries its number: a rank that passed its groups the other way round (or others) makes its
        # rounds on a group in another order, and its partners' values alone could still agree
        for index, (name, t, mine) in enumerate((("ring", uly, self._ring_rank), ("Ulysses", ring, self._uly_rank),
                                                 ("ring", uly, self._ring_rank))):
            rows = t.host_gather_ints([index, mine, found], "the check that ulysses_group and ring_group form a grid")
            seen.setdefault(name, sorted({r[1] for r in rows}))
            if len({(r[0], r[1]) for r in rows}) > 1 or any(r[2] for r in rows):
                found = 1
        if found:
            raise ValueError(
                f"{LABEL}: ulysses_group and ring_group do not form a 2-D grid: the ranks of a Ulysses group must "
                "all have one rank in their ring groups, and the ranks of a ring group one rank in their Ulysses "
                f"groups (this rank (cp rank {self.cp_rank}): its Ulysses group's ring ranks {seen['ring']}, its "
                f"ring group's Ulysses ranks {seen['Ulysses']}; some rank's groups differ).  Build them from a 2-D "
                "DeviceMesh (mesh_dim_names=('ring', 'ulysses')), or pass one group with ulysses_degree="
            )
        for old in [k for k in _GRIDS if k[0] != key[0]]:  # earlier worlds' groups
            _GRIDS.discard(old)
        _GRIDS.add(key)

    def any_rank(self, flags: list, what: str) -> list:
        """Each of ``flags`` (bools) or'ed over every rank of the cp group (host side, through the stages as the
        agreement checks go: the Ulysses group, then the ring group of those results)."""
        flags = [bool(f) for f in flags]
        for stage in self._stages():
            rows = stage.host_gather_ints([int(f) for f in flags], what)
            flags = [any(r[i] for r in rows) for i in range(len(flags))]
        return flags

    def _verify(self, q, k, v, plan, sinks, error: Optional[Exception] = None, return_lse: bool = False) -> tuple:
        """Checks the local input and that every rank makes the same call (fails alike on every rank, never hangs,
        on bad or disagreeing input); returns the Ulysses degree and the agreed signature.  ``error``: the caller's
        own refusal of this call (:meth:`refuse`), which takes the local check's place."""
        shared, u = None, None
        try:
            if error is not None:
                raise error
            shared, u = self._local_check(q, k, v, plan, sinks)
            shared["return_lse"] = return_lse  # (the Ulysses exchange and the backward's passes depend on it)
        except Exception as err:  # any error, not only the checks' own: the other ranks must not wait for this one
            if not self.verify:
                raise
            error = err
        if self.verify:
            self._calls[0] += 1
            self.agree("forward call", self._calls[0], shared, error)
        return u, shared

    # ---- the call ---------------------------------------------------------------------------------------------

    @torch.compiler.disable(reason=EAGER_ONLY)
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Optional[ShardPlan] = None,
                 sinks: Optional[torch.Tensor] = None, return_lse: bool = False):
        """The local out, or (out, lse) with ``return_lse=True`` (see FA4ContextParallelAttention.forward)."""
        if self.cp_size == 1:
            check_bool("return_lse", return_lse)
            return self._single(q, k, v, plan, sinks, return_lse)
        self._check_alive()
        with exclusive(self._groups(), f"forward call {self._calls[0] + 1}", LABEL):
            return self._call(q, k, v, plan, sinks, return_lse)

    def _call(self, q, k, v, plan, sinks, return_lse):
        self._check_grid()
        try:
            check_bool("return_lse", return_lse)
        except TypeError as err:  # refused through the agreement check: the other ranks must not wait for this one
            self._verify(q, k, v, plan, sinks, err)  # (raises on every rank)
            raise
        u, signature = self._verify(q, k, v, plan, sinks, return_lse=return_lse)
        key = (plan.fingerprint, plan.total_len, u)
        sched = self._schedules.get(key)
        if sched is None:
            if len(self._schedules) >= 16:  # per-sample plans: keep the recent ones
                self._schedules.pop(next(iter(self._schedules)))
            sched = self._schedules[key] = Schedule(plan, u, self.mask)
        for stage in self._stages():  # (after the agreement check: every rank makes the same choice)
            stage.use_peer_copies(signature["transport"] == "peer")
        ring, ut, upeers, uidx = self._peers(u)
        if sched.ring_size > 1:
            ring.transport.ready()  # a sparse schedule's first transfers need not involve every rank
        heads_q, heads_kv = q.shape[-2], k.shape[-2]
        uly = split = None
        if u > 1:
            split = HeadSplit(heads_q, heads_kv, u)
            member = sched.members[ring.index]
            lens = [plan.local_len(r) for r in member.ranks]
            uly = UlyssesGroup(ut, upeers, uidx, member, lens, 0 if plan.packed else 1)
        opts = KernelOptions(self.softmax_scale, self.softcap, self.backend, self._deterministic())
        call = _Call(sched, ring, uly, split, opts, heads_q, heads_kv, self._calls[0],
                     self.agree if self.verify else None, invariant=self.cp_invariant, signature=signature,
                     groups=self._groups(), any_rank=self.any_rank, return_lse=return_lse,
                     chunks=split.chunk_count(signature["ulysses_chunks"]) if split is not None else 1)
        out, lse = _ContextParallelFunction.apply(q, k, v, sinks, call)
        return (out, lse) if return_lse else out

    def refuse(self, error: Exception):
        """Raises for a forward call that its caller refused before making it (its own checks of what it passes):
        on a group of several ranks through this call's agreement check, as a refusal of the local check would, so
        that every rank raises at once, naming this one, instead of waiting for it; the others make the call."""
        if self.cp_size == 1 or not self.verify:
            raise error
        self._check_alive()
        with exclusive(self._groups(), f"forward call {self._calls[0] + 1}", LABEL):
            self._check_grid()
            self._verify(None, None, None, None, None, error)
        raise error  # (the agreement check has raised on every rank)

    def _single(self, q, k, v, plan, sinks, return_lse=False):
        cu = None
        if plan is not None:
            if check_single_rank_plan(q, k, v, plan):
                cu = plan.cu_seqlens_tensor(q.device) if isinstance(plan, ShardPlan) else plan.cu_seqlens.to(q.device)
        elif isinstance(q, torch.Tensor) and q.dim() == 3:
            raise ValueError("packed (3-D) input needs a packed-document plan (make_plan(cu_seqlens, 1)) for its "
                             "document boundaries")
        return _plain_attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, window=self.window,
                                softcap=self.softcap, sinks=sinks, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                deterministic=self.deterministic, backend=self.backend,
                                cp_invariant=self.cp_invariant, return_lse=return_lse)


def check_single_rank_plan(q, k, v, plan) -> bool:
    """The checks of a plan and its inputs without a cp group (this module's cp size 1, and the model's attention
    without one): `plan` is a cp-size-1 ShardPlan or fa4dist.data's SingleRankPlan, and q, k, v are laid out as it
    takes them and hold all its tokens.  Returns whether the plan is packed (its inputs 3-D, with documents)."""
    from fa4dist.data.sharding import SingleRankPlan

    if isinstance(plan, SingleRankPlan):  # fa4dist.data's plan of an unsplit packed sample
        packed, total = True, plan.total
    elif isinstance(plan, ShardPlan):
        if plan.cp_size != 1:  # its rank-0 segments would be attended alone: no other rank's keys
            error = (f"the plan is for cp_size={plan.cp_size} but there is no process group (cp size 1); make it "
                     "with make_plan(seqlen_or_cu_seqlens, 1) (or the model's make_plan)")
            post_refusal(f"ValueError: {error}")  # (the plan's other ranks may be waiting for this one)
            raise ValueError(error)
        packed, total = plan.packed, plan.total_len
    else:  # (cu_seqlens given as the plan was an AttributeError in the model)
        raise TypeError("plan must be a sharding plan (a ShardPlan of cp size 1: make_plan(seqlen_or_cu_seqlens, 1) "
                        f"or the model's make_plan; or fa4dist.data's SingleRankPlan), got {type_name(plan)}")
    sd = _check_shard_layout(q, k, v, packed)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[sd] != total:
            raise ValueError(f"{name} holds {t.shape[sd]} tokens but the plan covers {total}")
    return packed


def _check_shard_layout(q, k, v, packed: bool) -> int:
    """q, k, v are tensors laid out as the plan's kind takes them; returns their token dim."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        want = 3 if packed else 4
        if t.dim() != want:
            layout = "(local_tokens, heads, head_dim) for this packed-document plan" if packed else (
                "(batch, local_seqlen, heads, head_dim) for this single-sequence plan")
            raise ValueError(f"{name} must be {want}-D {layout}, got shape {tuple(t.shape)}")
    return 0 if packed else 1


# The functional form's ContextParallel objects, per process groups (or mesh), then per options: groups key ->
# (the groups, kept alive so that their ids stay theirs; the objects per options; their shared call count).  The
# functional calls on one groups are one attention "module" (FUNCTIONAL) with one call count, whichever object
# runs them: a rank that spells an option otherwise (its timeout, or deterministic=False where the others' None
# resolves to False) gets an object of its own, and a rank whose call was refused none (_refuse_functional), yet
# the ranks' calls stay paired, and the agreement check names the options that differ, never a 'module' or 'call
# number' that only the cache made differ.  Each groups' cache is bounded and emptied on its own (the call count
# stays): calls that only some ranks make (one rank's calls without a group at cp size 1, or a subgroup's) never
# evict the objects of a group that other ranks share.
_FUNCTIONAL: dict = {}
FUNCTIONAL = "functional"  # the 'module' of the functional form's calls in the agreement checks
_FUNCTIONAL_MAX = 64  # objects per groups


def _functional_groups(group, mesh, ulysses_group, ring_group) -> tuple:
    """The process groups a functional call runs on, as its cache knows them: a DeviceMesh by the groups it resolves
    to (a mesh made anew for every call is still the same groups, and adds no cache of its own)."""
    if mesh is not None and group is None and ulysses_group is None and ring_group is None:
        try:
            group, ulysses_group, ring_group = _resolve_mesh(mesh)
        except (TypeError, ValueError):  # not a mesh the constructor takes: it raises its own error
            return (None, mesh, None, None)
        return (group, None, ulysses_group, ring_group)
    return (group, mesh, ulysses_group, ring_group)


@torch.compiler.disable(reason=EAGER_ONLY)
def context_parallel_attention(q, k, v, plan: Optional[ShardPlan] = None, group=None, *, mesh=None,
                               ulysses_group=None, ring_group=None, strategy: str = "auto", causal: bool = True,
                               window: tuple[int, int] = (-1, -1), softcap: Optional[float] = None,
                               sinks: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                               deterministic: Optional[bool] = None, backend: str = "auto",
                               ulysses_degree: Optional[int] = None, timeout: float = 300.0,
                               verify: bool = True, cp_invariant: Optional[bool] = None, return_lse: bool = False):
    """Functional form of :class:`fa4dist.modules.FA4ContextParallelAttention`: the local output for the local
    shards q, k, v (sharded with `plan`), or (out, lse) with ``return_lse=True``.  Every call checks that all ranks
    make the same call (``verify``)."""
    # the numeric options in their parsed form (window [3, 0] is (3, 0), softcap 2 is 2.0, numpy scalars floats), and
    # the mask by its band (causal with window (3, 0) is causal with (3, -1)), so that spellings of one option share
    # one cached object
    groups = _functional_groups(group, mesh, ulysses_group, ring_group)
    try:
        mask = check_mask(causal, window)
        options = dict(strategy=strategy, causal=causal, window=check_window(window), softcap=check_softcap(softcap),
                       softmax_scale=None if softmax_scale is None else check_softmax_scale(softmax_scale, 1),
                       deterministic=deterministic, backend=backend, ulysses_degree=ulysses_degree, timeout=timeout,
                       verify=verify, cp_invariant=invariant_enabled(cp_invariant))
        # repr keeps apart the other values that compare equal (True, 1, 1.0): each is checked by the constructor
        # once, as the module checks it, and none rides on another's cached object
        key = repr(sorted(dict(options, causal=mask.causal, window=mask.window).items()))
        bucket = _FUNCTIONAL.get(tuple(id(g) for g in groups))
        cp = bucket[1].get(key) if bucket is not None else None
        if cp is None:
            cp = ContextParallel(group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group, **options)
            objects = _functional_bucket(groups, cp)[1]
            if len(objects) >= _FUNCTIONAL_MAX:
                objects.clear()
            objects[key] = cp
    except Exception as err:  # options this rank cannot run with: the other ranks of the call must not wait for it
        _refuse_functional(groups, timeout, verify, err)
        raise
    return cp(q, k, v, plan, sinks, return_lse)


def _functional_bucket(groups: tuple, cp: ContextParallel) -> tuple:
    """The functional cache's entry of `groups` (made if new), with `cp` (just made on them) joined to it: cp gives
    its module number back (the functional calls on a group are one module, FUNCTIONAL, whatever objects this
    rank's spellings of the options made, so that the modules built after them have the same numbers on every
    rank) and counts its calls with the others'."""
    key = cp._group_key()  # its number was the last the constructor took
    _INSTANCES[key] -= 1
    if not _INSTANCES[key]:
        del _INSTANCES[key]
    _drop_destroyed()
    bucket = _FUNCTIONAL.setdefault(tuple(id(g) for g in groups), (groups, {}, [0]))
    cp.instance, cp._calls = FUNCTIONAL, bucket[2]
    return bucket


def _drop_destroyed() -> None:
    """Forgets the functional objects of process groups that were destroyed since (they held the groups, and with
    them the groups' connections, for the life of the process: a process that makes and destroys groups ran out of
    file descriptors)."""
    for key, (groups, _, _) in list(_FUNCTIONAL.items()):
        group, _, ulysses_group, ring_group = groups
        if not all(group_alive(g) for g in (group, ulysses_group, ring_group) if g is not None):
            del _FUNCTIONAL[key]


def _refuse_functional(groups: tuple, timeout, verify, error: Exception) -> None:
    """Raises ``error`` of a functional call whose options this rank refused (a bad value, or one the constructor
    refuses) through the call's agreement check on its groups, as :meth:`ContextParallel.refuse` does: the other
    ranks, which built their object and made the call, raise at once naming this rank's error, instead of waiting
    out their timeout.  Returns (the caller raises the error as it is) where the groups themselves are refused
    (every rank of the call has them alike), at cp size 1, and with ``verify=False`` (no agreement checks).  The
    object made for the exchange is not kept; as the objects of the groups' functional calls, it is module
    FUNCTIONAL and counts its call with theirs (the refused call is one of the groups' calls on every rank)."""
    group, mesh, ulysses_group, ring_group = groups
    if mesh is not None or verify is False:  # a mesh the constructor refuses (a resolved one arrives as its groups)
        return
    try:
        ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf
        cp = ContextParallel(group, ulysses_group=ulysses_group, ring_group=ring_group, strategy="auto",
                             timeout=timeout if ok else 300.0, verify=True, cp_invariant=False)
    except Exception:  # noqa: BLE001  (the groups are refused: every rank refuses them alike, if the ranks agree)
        post_refusal(f"{type(error).__name__}: {error}")  # (one that does not: the others' timeout names this)
        return
    _functional_bucket(groups, cp)
    if cp.cp_size == 1:
        return
    try:
        cp.refuse(error)
    except CommError as failed:  # the others never joined the check (verify=False there): this rank's own error
        raise error from failed
