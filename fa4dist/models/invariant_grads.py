"""Parameter gradients with the same bits at every cp size: the rest of a cp_invariant training step.

Every parameter gradient is a sum over tokens, and a context-parallel rank sums only its own: its fp32 partial sum
and the all-reduce over ranks round differently at every cp size (about 1e-7 relative in fp32).  Here every
contribution is added in int64 fixed point, as the attention's dq is (:mod:`fa4dist.kernels.fixed_point`):

- a matrix (:class:`~fa4dist.models.llama.Linear`): one product ``dy_b^T x_b`` per canonical block of ``ROW_BLOCK``
  tokens of the stream (a fixed shape, the last block zero-padded), each truncated to int64;
- a norm weight: each token's ``dy_t * x_t``; an embedding row: each token's ``dy_t``.

One power of two per contribution site and backward, 2^(61 - e) with ``T * max|dy| * max|x| < 2^e`` (T the tokens,
maxima and T all-reduced over the group: exact), keeps every sum below 2^62.  :meth:`FixedPointGrads.finish` then
all-reduces the int64 sums (exact in any order), converts each site once and adds a parameter's sites (a tied
embedding has two) in a fixed order.  Blocks are canonical when every rank's tokens are whole blocks of the stream:
plans whose chunks are multiples of ``ROW_BLOCK`` (``FA4Llama.make_plan`` asks for that in this mode).  The input
gradients of these ops stay per token (fixed row blocks for the matrices), so nothing else changes.  Several
backward passes before ``finish`` (micro-batches) are converted one by one and added in backward order; a sharded
parameter (FSDP2's DTensor) gets its shard of the sum; ``finish`` returns the whole gradients' norm for clipping
(:func:`clip_by_norm`), since a norm over shards depends on the world size.

On a group, each site's exchanges in a backward are agreed first, under the group's thread guard (as every
collective call of fa4dist is).  The site's one all-reduce (MAX) of its maxima also carries a key of the exchange
(the kind of call, a digest of the site, its parameter's name, shape and dtype, the sum pending from a previous
micro-batch) and its negation, and each rank's token count in a slot of its own: every rank reads the key's maximum
and minimum and, where they differ, every rank raises (the full signatures then exchanged to name the difference)
before any exchange whose size could differ; :meth:`FixedPointGrads.finish` opens with the same check, so a rank
still in a backward pairs with it too.  No store round trip and one collective per site, but the check is read
back: one wait for the device per site.  What this check cannot pair is an exchange of another kind: a rank whose
backward skips a site the others run just before a context-parallel attention call (a parameter frozen on that rank
only, another number of micro-batches) waits in the attention's store exchange while the others wait in the site's
all-reduce.  On gloo the all-reduce's wait reads the peers' posted waits (``comm.Transport._collective``), so both
fail within the first 10 s of the wait, naming the two; on NCCL each fails when its wait times out (the attention's
timeout, and this object's own ``timeout``, 300 s by default), naming the exchange it waited in.
Slower than autograd's own (one small product per block, int64 sums): a reproducibility mode.

Non-finite and tiny values: a site's scale comes from its maxima, so one NaN or inf contribution makes the whole
parameter's gradient NaN (autograd's would be NaN in the affected entries only; either way the step is not usable,
and a NaN gradient norm says so). The scale stops at 2^126: with a loss scaled below ~1e-30 the gradients resolve only
2^-126 absolute (smaller ones become 0), as the attention's fixed-point dq does for tiny rows.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from ..context_parallel.agreement import raise_disagreement, signature_digest
from ..kernels import fixed_point
from ..kernels.problem import accum_dtype, check_timeout
from .llama import row_block_products, row_blocks


class _Site:
    """One parameter's contributions from one module: the int64 sum and its scale (per backward), and the converted
    gradient of the step's earlier backward passes (gradient accumulation)."""

    def __init__(self, param: torch.nn.Parameter, grads: "FixedPointGrads", module=None, name: str = ""):
        self.param, self.grads = param, grads
        self.index = len(grads.sites)  # its place in installation order: the same site on every rank
        self.module, self.name = module, name  # where param is registered (as .weight): to notice it replaced
        self.total: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self.earlier: Optional[torch.Tensor] = None
        self._digest: Optional[tuple] = None  # ((shape, dtype, device type), digest): see digest()

    def start(self, tokens: int, *maxima: torch.Tensor) -> torch.Tensor:
        """The power of two for this backward's contributions (the maxima and the token count reduced over the
        group). A second backward before FixedPointGrads.finish() (micro-batches) first settles the previous one's
        sum: each backward pass has its own scale, so their int64 sums cannot be added.

        On a group the maxima and token counts are reduced by the agreement check of this exchange
        (:meth:`FixedPointGrads.agreed`): a rank whose backward reaches another site (a parameter frozen on one rank
        only), another parameter shape or dtype, or a micro-batch more than the others makes every rank raise,
        instead of pairing its all-reduces with other sites' (scales mixed silently) or leaving the others waiting
        in one."""
        device = self.param.device
        peak = torch.stack([m.reshape(()) for m in maxima]).to(device)
        grads = self.grads
        settles = 0 if self.total is None else self.total.numel()
        numbers = (self.index, self.param.numel(), len(maxima), settles, self.digest())

        def signature():  # (only for the message, once the check found a difference)
            return dict(site=self.index, name=self.name,
                        shape=list(self.param.shape), dtype=str(self.param.dtype), device=device.type,
                        maxima=len(maxima), settles=settles)

        with grads.agreed("FixedPointGrads backward", numbers, signature, peak, tokens) as (peak, count):
            if self.total is not None:
                self.settle(grads.sum_over_group([self.total]))
        bound = count * torch.prod(peak)  # on the device: no host sync
        self.scale = fixed_point.power_of_two_scale(bound)
        self.total = torch.zeros(self.param.shape, dtype=torch.int64, device=device)
        return self.scale

    def digest(self) -> int:
        """A digest of the parameter's name, shape, dtype and device type, for the agreement check; kept while those
        stay the same (model.double() changes the dtype of the installed parameter)."""
        key = (tuple(self.param.shape), self.param.dtype, self.param.device.type)
        if self._digest is None or self._digest[0] != key:
            sig = dict(name=self.name, shape=list(key[0]), dtype=str(key[1]), device=key[2])
            self._digest = key, signature_digest(sig)
        return self._digest[1]

    def settle(self, total: torch.Tensor) -> None:
        """This backward's int64 sum over the group, converted once (its scale is a power of two: exact) and added
        after the earlier backward passes' (in backward order, the same at every cp size)."""
        acc = accum_dtype(self.param.dtype)
        value = total.to(acc) * (1.0 / self.scale.double()).to(acc)
        self.earlier = value if self.earlier is None else self.earlier + value
        self.total = self.scale = None


class _FixedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, site, rows):
        ctx.save_for_backward(x, weight)
        ctx.site, ctx.rows = site, rows
        return row_block_products(x, weight, rows)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        site, rows, n = ctx.site, ctx.rows, x.shape[0]
        dx = row_block_products(dy, weight.t(), rows)
        if not ctx.needs_input_grad[1]:  # a frozen weight (the same on every rank): no gradient, no exchange
            return dx, None, None, None
        scale = site.start(n, fixed_point.absmax(dy), fixed_point.absmax(x))
        acc = accum_dtype(x.dtype)
        for dy_b, x_b in zip(row_blocks(dy, rows), row_blocks(x, rows)):  # one fixed-shape product per canonical block
            site.total += fixed_point.to_fixed(dy_b.t().to(acc) @ x_b.to(acc), scale)
        return dx, site.grads.placeholder(weight), None, None


class _FixedScale(torch.autograd.Function):
    """weight * x (a norm's gain): per-token contributions to the weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, site):
        ctx.save_for_backward(x, weight)
        ctx.site = site
        return weight * x

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        site = ctx.site
        if not ctx.needs_input_grad[1]:  # a frozen gain: no gradient, no exchange
            return (dy * weight).to(x.dtype), None, None
        flat_dy, flat_x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        scale = site.start(flat_dy.shape[0], fixed_point.absmax(dy), fixed_point.absmax(x))
        acc = accum_dtype(x.dtype)
        site.total += fixed_point.to_fixed(flat_dy.to(acc) * flat_x.to(acc), scale).sum(0)
        return (dy * weight).to(x.dtype), site.grads.placeholder(weight), None


class _FixedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, site):
        ctx.save_for_backward(tokens)
        ctx.site, ctx.weight_meta = site, (weight.shape, weight.dtype, weight.device)
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, dy):
        (tokens,) = ctx.saved_tensors
        site = ctx.site
        if not ctx.needs_input_grad[1]:  # a frozen embedding: no gradient, no exchange
            return None, None, None
        flat = dy.reshape(-1, dy.shape[-1])
        scale = site.start(flat.shape[0], fixed_point.absmax(dy))
        acc = accum_dtype(dy.dtype)
        site.total.index_add_(0, tokens.reshape(-1), fixed_point.to_fixed(flat.to(acc), scale))
        return None, site.grads.placeholder(*ctx.weight_meta), None


class FixedPointGrads:
    """The fixed-point gradients of a model's Linear (weight only), RMSNorm and Embedding parameters; install with
    ``FA4Llama.set_invariant_grads`` and call :meth:`finish` after the step's backward passes (it sets ``p.grad``,
    summed over ``group``, the default group when distributed: no other gradient reduction for these parameters).
    ``timeout``: seconds any of its waits on another rank may take before it raises a
    :class:`~fa4dist.context_parallel.CommError` naming the exchange (as the attention's ``timeout``)."""

    def __init__(self, group=None, zero_weight_grads: bool = False, timeout: float = 300.0):
        self.timeout = check_timeout(timeout)
        if group is not None:  # a group without this rank has size -1: taken as 'not distributed', its sums local
            from ..context_parallel.comm import member_size_rank

            member_size_rank(group, "group")
        self.group = group
        self.sites: list[_Site] = []
        # a wrapper that reduces gradients itself from its own hooks and buffers (DeepSpeed) gets a zero gradient
        # for every weight, so those run as usual; finish(assign=...) then hands it the real one
        self.zero_weight_grads = zero_weight_grads
        self.retired: Optional[str] = None  # why this object no longer gets the model's gradients
        self.calls: dict[str, int] = {}  # this object's agreed calls on the group so far, by kind (agreed())
        self.exchanges = 0  # and of every kind: its agreement all-reduces, the same count on every rank
        self._transports: Optional[tuple] = None  # (world generation, Transport on group): _transport()

    def __deepcopy__(self, memo):
        from ..context_parallel.comm import deepcopy_sharing

        return deepcopy_sharing(self, memo, ("group", "_transports"))  # the copy reduces over the same process group

    def __getstate__(self):
        # torch.save(model) pickles it (the model and its layers hold it): on a group, refused naming the remedy,
        # as the attention module on a group is, not with pickle's own error about a ProcessGroup
        from ..context_parallel.comm import refuse_pickling

        state = refuse_pickling(self, "fa4dist invariant gradients (FixedPointGrads, model.invariant_grads)",
                                ("group",), "call model.set_invariant_grads(True, group)")
        return dict(state, _transports=None)  # (the default group's Transport: this process's world only)

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def placeholder(self, weight_or_shape, dtype=None, device=None) -> Optional[torch.Tensor]:
        """What autograd receives as a weight's gradient: nothing, or zeros (``zero_weight_grads``)."""
        if not self.zero_weight_grads:
            return None
        if isinstance(weight_or_shape, torch.Tensor):
            return torch.zeros_like(weight_or_shape)
        return torch.zeros(weight_or_shape, dtype=dtype, device=device)

    def site(self, param: torch.nn.Parameter, module=None, name: str = "") -> _Site:
        """A contribution site of ``param``; ``module`` (named ``name``) holds it as ``.weight``, so that
        :meth:`check_params` can notice the parameter replaced."""
        s = _Site(param, self, module, name)
        self.sites.append(s)
        return s

    def retire(self, why: str) -> None:
        """The model no longer sends its gradients here (``set_invariant_grads`` again or off): finish() raises."""
        self.retired = why

    def replaced_params(self) -> list[str]:
        """Names of the sites' parameters that their modules no longer hold (``fully_shard``, a new
        ``nn.Parameter``, ``load_state_dict(assign=True)`` after installation): their gradients would go to tensors
        the optimizer no longer sees.  FSDP2's unsharded stand-in of an installed sharded parameter (between its
        forward and its reshard) is not a replacement."""
        out = []
        for s in self.sites:
            if s.module is None:
                continue
            now = s.module._parameters.get("weight")
            if now is s.param or (isinstance(s.param, DTensor) and now is not None and not isinstance(now, DTensor)):
                continue
            out.append(f"{s.name}.weight")
        return out

    def check_params(self) -> None:
        """Raises if the model's parameters are not the ones installed (:meth:`replaced_params`): the step would
        otherwise leave them without gradients, silently."""
        replaced = self.replaced_params()
        if replaced:
            raise ValueError(
                f"invariant gradients were installed for parameters the model no longer holds ({len(replaced)}, "
                f"e.g. {replaced[:3]}): they were replaced after set_invariant_grads (fully_shard, a new "
                "nn.Parameter, load_state_dict(assign=True)); call model.set_invariant_grads(True) again after that")

    def linear(self, x, weight, site, rows):
        return _FixedLinear.apply(x, weight, site, rows)

    def scale(self, x, weight, site):
        return _FixedScale.apply(x, weight, site)

    def embedding(self, tokens, weight, site):
        return _FixedEmbedding.apply(tokens, weight, site)

    def sum_over_group(self, totals: list[torch.Tensor]) -> torch.Tensor:
        """The int64 tensors summed over the group (exact, in any order), as one flat tensor when several."""
        flat = torch.cat([t.flatten() for t in totals]) if len(totals) > 1 else totals[0]
        if self.distributed:
            dist.all_reduce(flat, group=self.group)
        return flat

    @torch.no_grad()
    def finish(self, divide_by: int = 1, *, max_norm: Optional[float] = None, assign=None) -> torch.Tensor:
        """Sums every site over the group (int64: exact), converts it once and sets each parameter's gradient
        (sites of one parameter added in installation order; backward passes since the last finish() in their
        order); sites without a backward this step add nothing. ``divide_by``: the gradient is the sum over the
        group divided by it (the data-parallel replicas' mean). A sharded parameter (a DTensor, FSDP2) gets its
        own shard of the summed gradient, which every rank has whole.

        ``max_norm``: clip the gradients by their total norm first (as :func:`clip_by_norm`). ``assign(param,
        grad)``: hand each whole gradient to the wrapper (DeepSpeed: ``deepspeed.utils.safe_set_full_grad``)
        instead of setting ``param.grad``.

        Returns the gradients' total 2-norm (before clipping), computed from the whole gradients the same way on
        every rank, hence the same bits at every cp size, unlike a norm over shards.

        On a group, a call that one rank's checks refuse, or whose sums, ``divide_by`` or ``max_norm`` differ
        between ranks, raises on every rank (naming that rank) before the sums are exchanged: the others waited in
        the all-reduce for it until the group's timeout, or scaled their copies of the sum differently."""
        live = [s for s in self.sites if s.total is not None]
        error = None
        try:
            self._check_finish(divide_by, max_norm, assign)
        except Exception as err:  # on a group: the other ranks must not wait for this one
            if not self.distributed:
                raise
            error = err
        # (a divide_by or max_norm that differs by rank scaled each rank's copy of the sum differently: replicas
        # drifting apart silently)
        sig = None if error else dict(sites=len(live),
                                      elements=sum(s.total.numel() for s in live), divide_by=float(divide_by),
                                      max_norm=None if max_norm is None else float(max_norm))
        numbers = () if sig is None else (signature_digest(sig),)
        with self.agreed("FixedPointGrads.finish", numbers, lambda: sig, error=error):
            if live:
                flat = self.sum_over_group([s.total for s in live])
                for s, part in zip(live, torch.split(flat, [s.total.numel() for s in live])):
                    s.settle(part.view(s.total.shape))
        grads: dict[int, torch.Tensor] = {}
        for s in self.sites:
            if s.earlier is not None:
                key = id(s.param)
                grads[key] = s.earlier if key not in grads else grads[key] + s.earlier
                s.earlier = None
        whole = []
        for s in self.sites:
            g = grads.pop(id(s.param), None)
            if g is None:
                continue
            if divide_by != 1:
                g = g / divide_by
            whole.append((s.param, g.to(s.param.dtype)))
        if not whole:
            return torch.zeros((), dtype=torch.float64, device=self.sites[0].param.device if self.sites else None)
        norm = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for _, g in whole]).sum().sqrt()
        coef = None if max_norm is None else clip_coefficient(max_norm, norm)
        for param, g in whole:
            if coef is not None:
                g = g * coef.to(g.device, g.dtype)
            if assign is not None:
                assign(param, g)
                continue
            if isinstance(param, DTensor):
                g = distribute_tensor(g, param.device_mesh, param.placements, src_data_rank=None)
            param.grad = g if param.grad is None else param.grad + g
        return norm

    def _check_finish(self, divide_by, max_norm, assign) -> None:
        """finish()'s arguments and this object's state (every rank checks its own)."""
        if isinstance(divide_by, bool) or not isinstance(divide_by, (int, float)) or not 0 < divide_by < math.inf:
            raise ValueError(f"divide_by must be a positive number (the replicas' count), got {divide_by!r}")
        if max_norm is not None:
            _check_max_norm(max_norm)
        if assign is not None and not callable(assign):
            raise TypeError(f"assign must be a function (param, grad) or None, got {type(assign).__name__}")
        if self.retired:
            raise RuntimeError(f"this FixedPointGrads no longer receives the model's gradients: {self.retired} "
                               "retired it (finish the one model.invariant_grads holds)")
        self.check_params()

    @contextlib.contextmanager
    def agreed(self, function: str, numbers: tuple, signature: Callable[[], Optional[dict]],
               peak: Optional[torch.Tensor] = None, tokens: int = 0, error: Optional[Exception] = None):
        """Where a call (``function``) exchanges on the group: under the group's thread guard, after the agreement
        check of the call, which yields (``peak``, a site's maxima, reduced under MAX over the group; the sum of the
        ranks' ``tokens``, fp64: exact), on ``peak``'s device.

        The check is one all-reduce (MAX) of a vector: ``PEAKS`` maxima (padded with zeros), a key ``k`` of the call
        and ``-k``, then one slot per rank for its ``tokens`` (0 in the others' slots: each rank reads every count;
        8 bytes per rank, 8 KiB at 1024 ranks, where a separate sum would cost a second collective per site).
        Every rank reads the key's maximum and minimum over the group.  ``k`` (:func:`_agreement_key`) holds the
        call's kind, a digest of this object's count of agreed calls and ``numbers`` (ints: the site and its size,
        or finish()'s sums and options), and a flag where this rank's own checks refused the call (``error``).  One
        size for every call on the group: a rank in another site's exchange, or in finish() while another is in a
        backward, pairs with it and sees the difference.  Where the keys differ, or a rank was refused, every rank
        raises the same error (``signature()``, the full signature, exchanged to name the fields and ranks:
        :func:`fa4dist.context_parallel.core.raise_disagreement`) before the call's own exchanges, whose sizes may
        differ.  Not distributed: ``error`` raised, the values as they are."""
        if peak is not None and peak.numel() > PEAKS:  # (the vector has one size)
            raise ValueError(f"an agreement reduces at most {PEAKS} maxima, got {peak.numel()}")
        if not self.distributed:
            if error is not None:
                raise error
            yield peak, None if peak is None else torch.tensor(float(tokens), dtype=torch.float64, device=peak.device)
            return
        from ..context_parallel.comm import exclusive

        transport = self._transport()
        group = self.group if self.group is not None else dist.group.WORLD
        with exclusive([group], f"{function} call {self.calls.get(function, 0) + 1}", transport.label):
            call = self.calls[function] = self.calls.get(function, 0) + 1
            self.exchanges += 1
            key = float(_agreement_key(_KINDS[function], self.exchanges, numbers, error is not None))
            device = transport.comm_device()
            peaks = torch.zeros(PEAKS, dtype=torch.float64, device=device)
            if peak is not None:
                peaks[:peak.numel()] = peak.to(device, torch.float64)
            host = torch.zeros(2 + transport.size, dtype=torch.float64)
            host[0], host[1], host[2 + transport.rank] = key, -key, float(tokens)
            vector = torch.cat([peaks, host.to(device)])
            what = f"the agreement check of {function} call {call}"
            transport._collective(dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                                  what)
            top, bottom = vector[PEAKS:PEAKS + 2].tolist()  # (waits for the device: the check is read at once)
            top, bottom = int(top), -int(bottom)
            if top != bottom or top >= _REFUSED:
                sig = None if error is not None else dict(call=f"{function} call {call}", **signature())
                if top >= _REFUSED or top >> _KIND_SHIFT == bottom >> _KIND_SHIFT:  # one kind of call
                    where = dict(what=f"{function} call", call=call)
                else:  # a backward's and finish(): what every rank knows is the exchange's number
                    where = dict(what="FixedPointGrads exchange", call=self.exchanges)
                raise_disagreement([transport], transport.rank, where["what"], where["call"], sig, error,
                                   label=transport.label, calls=where["what"])
            if peak is None:
                yield None, None
            else:
                yield (vector[:peak.numel()].to(peak.device, peak.dtype),
                       vector[PEAKS + 2:].sum().to(peak.device))  # (whole numbers below 2^53: exact in any order)

    def _transport(self):
        """The group's Transport (its waits time out, naming the exchange), made once per world."""
        from ..context_parallel.comm import Transport, world_generation

        generation = world_generation()
        if self._transports is None or self._transports[0] != generation:
            self._transports = generation, Transport(self.group, self.timeout, label="fa4dist invariant gradients")
        return self._transports[1]


# FixedPointGrads.agreed's vector: PEAKS maxima, a key and its negation, the ranks' token counts.  A key (below
# 2^53: exact in fp64) is _REFUSED where the rank's own checks refused the call, plus the kind of call (_KINDS) above
# _KIND_SHIFT bits of digest: the maximum over the ranks tells every rank that one was refused, and the maximum and
# minimum, whether the ranks made the same kind of call.
_KINDS = {"FixedPointGrads backward": 1, "FixedPointGrads.finish": 2}
PEAKS, _KIND_SHIFT, _REFUSED = 2, 50, 1 << 52


def _agreement_key(kind: int, exchange: int, numbers: tuple, refused: bool) -> int:
    """The key of one agreed call (see above): equal on two ranks when their kind, exchange number and numbers are
    (a digest of _KIND_SHIFT bits: two different calls share one with probability 2^-50)."""
    digest = signature_digest(dict(exchange=exchange, numbers=list(numbers))) & ((1 << _KIND_SHIFT) - 1)
    return (_REFUSED if refused else 0) + (kind << _KIND_SHIFT) + digest


def _check_max_norm(max_norm) -> None:
    """A clipping norm: a number > 0 (inf: no clipping).  A negative one flipped every gradient's sign, NaN made
    them NaN, 0 zeroed them: all silently."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0 (None: no clipping), got {max_norm!r}")


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """min(1, max_norm / (total_norm + 1e-6)), on the device, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_by_norm(params, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales the gradients by min(1, max_norm / (total_norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_`` does,
    with a norm given (FixedPointGrads.finish's): elementwise, so the shards of a gradient scale as it would whole.
    The coefficient stays on the device (no host sync); a DTensor gradient is scaled through its local shard."""
    _check_max_norm(max_norm)
    coef = clip_coefficient(max_norm, total_norm)
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.mul_(coef.to(local.device, local.dtype))
