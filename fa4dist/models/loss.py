"""Next-token loss over a context-parallel shard, equal to the loss of the unsplit sequence.

Each rank computes the summed cross entropy of its local tokens and divides by the count of target labels (not
IGNORE) of the *whole* sequence (gathered over the cp group; a sequence without targets gives 0, not NaN:
:func:`cp_cross_entropy` says why).  The cp ranks' losses then add up to the mean over the sequence, and so do
their gradients: summing gradients over the cp group (what FSDP2 with divide factor dp, or DeepSpeed with our cp
group as its sequence-parallel group, does) gives exactly the single-process gradient.

Every rank of the group must make the same call.  The one exchange that gathers the label counts (int64, whatever
the logits dtype) also carries each rank's fingerprint of its call (a digest of vocabulary size, logits dtype and
device type and whether a gradient is needed, the call's number on the group, an error flag), so checking costs
nothing extra; a rank whose inputs are refused still takes part.  When anything differs, the ranks swap their full
signatures and all raise the same error naming the ranks and fields
(``fa4dist.context_parallel.agreement.raise_disagreement``, as the attention's agreement check does), instead of the
others waiting in the collective or gloo/NCCL failing on mismatched buffers.  A rank that skips a call cannot be
seen by the others: they time out after ``timeout`` seconds with a message naming the call.

The value to *log* in a cp_invariant run, whose weights have the same bits at every cp size, is ``exact_value=True``'s
``CPLoss.value``: the token losses added by :func:`invariant_sum` (int64 fixed point), which gives the same bits for
any split of the terms over the ranks; the shares' float sum over the group does not (its last bits move with cp)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fa4dist.data.packing import IGNORE
from fa4dist.kernels.problem import check_timeout

_CALLS: dict = {}  # (function, group name) -> this rank's calls on the group so far


def _process_group(group):
    """A group argument as a process group: a DeviceMesh (1-D, or a named 2-D ring x ulysses one: all its ranks)
    resolved."""
    if group is not None and hasattr(group, "get_group") and hasattr(group, "ndim"):  # DeviceMesh
        from fa4dist.context_parallel.core import mesh_group

        return mesh_group(group, "the loss's cp group")
    return group


def _member_group(group, name: str):
    """(process group, its size) of a group argument (a DeviceMesh resolved; None stays None, the default group
    where it means that); a group this rank is not a member of is refused (it has size -1: was a silent local
    result)."""
    from fa4dist.context_parallel.comm import member_size_rank

    group = _process_group(group)
    return group, member_size_rank(group, name)[0]


def _next_call(function: str, group) -> int:
    key = (function, (group if group is not None else dist.group.WORLD).group_name)
    _CALLS[key] = _CALLS.get(key, 0) + 1
    return _CALLS[key]


def _one_thread(function: str, group, label: str):
    """The group's thread guard (:func:`fa4dist.context_parallel.comm.exclusive`, as the attention takes it) for
    ``function``'s next call: its exchange pairs up with the other ranks' by order, so a call on the group from a
    second thread at once (another loss, the attention, reduce_value) is refused instead of mispairing."""
    from fa4dist.context_parallel.comm import exclusive

    group = group if group is not None else dist.group.WORLD
    return exclusive([group], f"{function} call {_CALLS.get((function, group.group_name), 0) + 1}", label)


@dataclass
class CPLoss:
    loss: torch.Tensor  # this rank's share: backward through it; the shares add up to the sequence's mean
    tokens: torch.Tensor  # label tokens of the whole sequence (all cp ranks)
    local_tokens: int
    # exact_value=True: the sequence's mean loss (fp64, detached), the same bits on every rank and at every cp size
    value: Optional[torch.Tensor] = None


def _check_inputs(logits, labels) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        bad = "logits" if not isinstance(logits, torch.Tensor) else "labels"
        raise TypeError(f"{bad} must be a torch.Tensor, got {type(logits if bad == 'logits' else labels).__name__}")
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be 2-D (local_tokens, vocab) with vocab >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must have a floating-point dtype, got {logits.dtype}")
    if labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"labels must be 1-D with one label per logits row ({logits.shape[0]}), got shape "
                         f"{tuple(labels.shape)}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must have an integer dtype (token ids, {IGNORE} for no target), got {labels.dtype}")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}")


def _label_count(labels: torch.Tensor, vocab: int) -> int:
    """The labels that are targets (not IGNORE); refuses ids outside [0, vocab) (a CUDA device assert, or an
    IndexError on one rank only, in the cross entropy).  One host sync, as the count needs anyway."""
    labels = labels.long()  # (int64: IGNORE and vocab wrap in narrow dtypes; uint64 past 2^63 turns negative: refused)
    outside = ((labels < 0) & (labels != IGNORE)) | (labels >= vocab)
    count, n_out = torch.stack([(labels != IGNORE).sum(), outside.sum()]).tolist()
    if n_out:
        example = int(labels[outside][0])
        raise ValueError(f"labels hold {n_out} id(s) outside the vocabulary [0, {vocab}) that are not IGNORE "
                         f"({IGNORE}), e.g. {example}")
    return count


def label_counts(function: str, cp_group, inputs: Callable[[], tuple], timeout: float = 300.0) -> tuple[int, int]:
    """(this rank's target labels, the whole sequence's) for a cp loss named ``function``.  ``inputs()`` checks the
    call's arguments and returns (labels, vocab, signature): labels integer ids or IGNORE, whose ids are checked to
    lie in [0, vocab), and the signature (a JSON-able dict) that every rank of ``cp_group`` must share.  On a group
    of several ranks, the counts and the calls' fingerprints go in one all-gather; a refused or differing call
    raises the same error on every rank.  ``cp_group`` None: this rank's tokens are the whole sequence."""
    group, size = (None, 1) if cp_group is None else _member_group(cp_group, "cp_group")
    error, sig, count, wait = None, None, 0, 300.0
    try:
        # a bad timeout was taken at cp 1, and at cp > 1 failed the exchange at once (as if a rank had not called:
        # -1 or 0) or deep in it (float('x'), NaN); refused as any bad input, on every rank, the exchange waiting
        # the default time
        wait = check_timeout(timeout)
        labels, vocab, sig = inputs()
        count = _label_count(labels, vocab)
    except Exception as err:  # any error: the other ranks must not wait for this one
        if size == 1:
            raise
        error = err
    if size == 1:
        return count, count
    from fa4dist.context_parallel.comm import Transport
    from fa4dist.context_parallel.agreement import raise_disagreement, signature_digest

    label = f"fa4dist {function}"
    transport = Transport(group, wait, label=label)
    with _one_thread(function, group, label):
        call = _next_call(function, group)
        rows = transport.all_gather_ints([count, signature_digest(sig), call, int(error is not None)],
                                         f"the label counts of {function} call {call}")
        if any(r[3] for r in rows) or len({(r[1], r[2]) for r in rows}) > 1:
            raise_disagreement([transport], transport.rank, f"{function} call", call, sig, error, label=label,
                               calls=f"{function} call")
    return count, sum(r[0] for r in rows)


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cp_group=None, *,
                     timeout: float = 300.0, exact_value: bool = False) -> CPLoss:
    """Token-mean cross entropy of the sequence that ``logits`` (local_tokens, vocab) / ``labels`` (local_tokens,),
    integer ids or IGNORE, are this rank's shard of.  ``cp_group``: the cp group (ProcessGroup or 1-D DeviceMesh;
    None: this rank's tokens are the whole sequence); every rank of it must call this alike (checked in the one
    exchange of the label counts, which waits at most ``timeout`` seconds for the other ranks).

    The share is this rank's summed token losses over ``max(1, the sequence's target count)``.  A rank without
    targets (while other ranks have some) gives 0, and the shares still add up to the mean over the sequence's
    targets.  A sequence without any target (every label IGNORE, on every rank) gives **0 with zero gradients**, at
    every cp size and on every rank, where torch's mean ``F.cross_entropy`` and the transformers models' own loss
    give NaN (0 / 0): chosen so that such a sequence adds nothing to a step's sums of losses and gradients, where a
    NaN would reach every replica's weights through the gradient reduction and an error would stop a run on a
    legitimate window (a prompt-only stretch of SFT data, one-token documents).  ``CPLoss.tokens`` is 0 then, for
    a caller that wants to tell.

    ``exact_value=True`` also gives ``CPLoss.value``: the sequence's mean loss as a detached fp64 scalar whose bits
    do not depend on how the tokens are split over the ranks (:func:`invariant_sum` of the token losses, two more
    reductions over the group).  The shares' own sum rounds differently at every cp size: this is the value to log
    in a cp_invariant run, whose weights have the same bits at every cp size."""
    return cp_cross_entropy_of(lambda: (logits, labels), cp_group, timeout=timeout, exact_value=exact_value)


def cp_cross_entropy_of(operands: Callable[[], tuple], cp_group=None, *, timeout: float = 300.0,
                        exact_value: bool = False) -> CPLoss:
    """:func:`cp_cross_entropy` of the ``(logits, labels)`` that ``operands()`` returns.  It is called inside the
    check of the arguments that every rank joins, so a caller's own checks of what it makes them from (a
    ``ContextParallelHandle.loss``'s) raise on every rank alike too, instead of leaving the others waiting."""
    got = {}

    def inputs():
        if not isinstance(exact_value, bool):
            raise TypeError(f"exact_value must be a bool, got {type(exact_value).__name__}")
        logits, labels = operands()
        _check_inputs(logits, labels)
        got.update(logits=logits, labels=labels)
        return labels, logits.shape[1], dict(vocab=int(logits.shape[1]), dtype=str(logits.dtype),
                                             device=logits.device.type,
                                             grad=bool(torch.is_grad_enabled() and logits.requires_grad),
                                             exact_value=exact_value)

    count, total = label_counts("cp_cross_entropy", cp_group, inputs, timeout)
    logits, labels = got["logits"], got["labels"]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    tokens = torch.tensor(total, dtype=logits.dtype, device=logits.device)
    if not exact_value:
        local_sum = F.cross_entropy(logits, labels.long(), ignore_index=IGNORE, reduction="sum")
        return CPLoss(local_sum / tokens.clamp(min=1.0), tokens, count)
    # the token losses once, summed for the share (whose gradient is the summed call's: each token's loss gets the
    # same 1 / tokens) and, in fixed point, for the value
    per_token = F.cross_entropy(logits, labels.long(), ignore_index=IGNORE, reduction="none")
    value = (invariant_sum(per_token, cp_group, timeout=timeout) if cp_group is not None
             else _fixed_point_sum(per_token, 1, 0, lambda facts, op: facts)) / max(1, total)
    return CPLoss(per_token.sum() / tokens.clamp(min=1.0), tokens, count, value)


def invariant_sum(terms: torch.Tensor, group=None, *, timeout: float = 300.0) -> torch.Tensor:
    """The sum of every rank's ``terms`` (a floating-point tensor of any shape; each rank its own count) over
    ``group`` (default: every rank; this rank's terms alone when torch.distributed is not initialized), as a detached
    fp64 scalar, the same on every rank, whose bits do not depend on how the terms are split over the ranks: one
    rank or many, any shard sizes.  A float sum's bits do (its partial sums round differently).

    Each finite term becomes the integer trunc(term * 2^s) and the integers add exactly, in any order; the sum is
    converted once.  2^s = 2^(61 - e) with n * max|term| < 2^e (n the terms and the maximum taken over the group:
    exact in any layout), so every partial sum stays below 2^62 and the result is within n * 2^(e - 61) of the exact
    sum (fixed_point.power_of_two_scale; NaN if that bound is 2^187 or more).  The scale is at most 2^126, so below
    n * max|term| ~ 2^-65 (~3e-20) the bound is n * 2^-126 instead, absolute: such tiny terms lose their low bits,
    and a term below 2^-126 (~1.2e-38) truncates to 0 (a float sum keeps it).  Non-finite terms give what a float
    sum in any order gives: NaN where a term is NaN or both infinities occur, else the infinity.  Two reductions
    (:func:`reduce_value`: a call that differs between ranks raises on every rank)."""
    if not isinstance(terms, torch.Tensor) or not terms.is_floating_point():
        got = terms.dtype if isinstance(terms, torch.Tensor) else type(terms).__name__
        raise TypeError(f"terms must be a floating-point torch.Tensor, got {got}")
    size, rank = 1, 0
    if dist.is_available() and dist.is_initialized():
        process_group, size = _member_group(group, "group")
        rank = dist.get_rank(process_group)
    return _fixed_point_sum(terms, size, rank, lambda facts, op: reduce_value(facts, group, op, timeout=timeout))


def _fixed_point_sum(terms: torch.Tensor, size: int, rank: int, reduce: Callable) -> torch.Tensor:
    """:func:`invariant_sum` of this rank (``rank`` of ``size``), ``reduce(tensor, op)`` reducing over the ranks."""
    from fa4dist.kernels.fixed_point import power_of_two_scale, to_fixed

    flat = terms.detach().reshape(-1).double()
    finite = torch.isfinite(flat)
    zero = flat.new_zeros(())
    # one MAX reduction: the largest finite |term|, which non-finite kinds occur, and each rank's count in a slot of
    # its own (the others hold 0 there), so that every rank reads the whole count exactly
    facts = flat.new_zeros(4 + size)
    if flat.numel():
        facts[0] = torch.where(finite, flat.abs(), zero).max()
        facts[1] = flat.isnan().any().double()
        facts[2] = (flat == float("inf")).any().double()
        facts[3] = (flat == -float("inf")).any().double()
    facts[4 + rank] = flat.numel()
    facts = reduce(facts, dist.ReduceOp.MAX)
    scale = power_of_two_scale(facts[0] * facts[4:].sum()).double()
    fixed = to_fixed(flat, scale).sum().reshape(1)  # (a non-finite term adds 0: its kind was counted above)
    total = reduce(fixed, dist.ReduceOp.SUM)[0].double() / scale
    nan, pos, neg = facts[1] > 0, facts[2] > 0, facts[3] > 0
    total = torch.where(pos, float("inf"), torch.where(neg, -float("inf"), total))
    return torch.where(nan | (pos & neg), float("nan"), total)


def reduce_value(value: torch.Tensor, group=None, op=dist.ReduceOp.SUM, *, timeout: float = 300.0) -> torch.Tensor:
    """A detached copy of ``value`` reduced over ``group`` (default: every rank; a plain copy when
    torch.distributed is not initialized or the group has one rank).  Every rank must call it alike (one shape,
    dtype and ``op``): a fingerprint of the call is compared first through the group's store (host-side, no device
    sync, as the attention's agreement check), so a rank whose call differs or is refused makes every rank raise,
    naming it, instead of gloo aborting, NCCL hanging or the ops mixing silently."""
    def check(value):  # (op too at every size: a bad one was taken without a group or at size 1, refused above)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a torch.Tensor, got {type(value).__name__}")
        if not isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            raise TypeError(f"op must be a torch.distributed.ReduceOp, got {type(op).__name__}")
        return value.detach().clone()

    if not (dist.is_available() and dist.is_initialized()):
        check_timeout(timeout)
        return check(value)
    group, size = _member_group(group, "group")
    if size == 1:
        check_timeout(timeout)
        return check(value)
    from fa4dist.context_parallel.comm import Transport

    label = "fa4dist reduce_value"
    error, sig, wait = None, None, 300.0
    try:
        wait = check_timeout(timeout)  # a bad one: refused on every rank, the agreement check waiting the default
    except ValueError as err:
        error = err
    transport = Transport(group, wait, label=label)
    try:
        if error is not None:
            raise error
        value = check(value)
        if transport.backend == "nccl" and not value.is_cuda:
            raise ValueError(f"an NCCL process group needs a CUDA tensor, got one on {value.device}")
        sig = dict(shape=list(value.shape), dtype=str(value.dtype), device=value.device.type,
                   op=op.name if isinstance(op, dist.ReduceOp.RedOpType) else type(op).__name__)
    except Exception as err:  # the other ranks must not wait for this one
        error = err
    with agreed_call("reduce_value", group, transport, sig, error):
        dist.all_reduce(value, op=op, group=group)
    return value


@contextmanager
def agreed_call(function: str, group, transport, sig, error):
    """One call of ``function`` on ``group`` (several ranks, ``transport`` on it) that every rank makes alike, its
    body (the call's collectives) under the group's thread guard: first a fingerprint of the call (the digest of
    ``sig``, the call's number, whether this rank's own checks refused it: ``error``) goes through the group's
    store, as the attention's agreement check (``ContextParallel.agree``) does, and when a rank's call differs or
    was refused every rank raises the same error naming it, instead of the others waiting in the collective."""
    from fa4dist.context_parallel.agreement import raise_disagreement, signature_digest

    with _one_thread(function, group, transport.label):
        call = _next_call(function, group)
        # the row of ContextParallel.agree's exchanges on the group's store: paired with one of them by a rank that
        # skipped or added a call, each side sees the other's digest and both raise
        rows = transport.host_gather_ints([signature_digest(sig), call, int(error is not None), 0],
                                          f"the agreement check of {function} call {call}")
        if any(r[2] or r[3] for r in rows) or len({(r[0], r[1]) for r in rows}) > 1:
            raise_disagreement([transport], transport.rank, f"{function} call", call, sig, error,
                               label=transport.label, calls=f"{function} call")
        yield
