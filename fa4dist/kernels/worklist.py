"""The work-list entry points: many blocks of one attention in one call, forward and backward.

A work list is a sequence of :class:`WorkItem` s, each a block of the contract's partial-block call: query rows
``[q_start, q_start + q_len)`` against key rows ``[k_start, k_start + k_len)`` of the token dimension, placed in
their sequence by global positions (``q_offset``, ``k_offset``) under the mask of :mod:`fa4dist.kernels.mask`.
Layouts: packed ``(tokens, heads, dim)`` tensors, or dense ``(batch, tokens, heads, dim)`` where every item applies
to every batch element.

- ``attention_forward_items`` merges every item's block into the running fp32 ``(out, lse)`` of its query rows, in
  list order (items that share query rows merge in that order, so the result is a function of the list alone).
- ``attention_backward_items`` adds every item's dq, dk, dv into fp32 buffers, in list order, given the *global*
  out and lse; with ``fresh_dkv=True`` dk and dv may hold anything: each key row's first launch writes its
  gradient (:func:`fresh_key_launches`) and rows no item has become zero, the bytes of the same call into zeros.
  ``dlse=``: the global lse's gradient too (a loss of out and lse), in the same launches where the backend takes
  it (``lse_gradient``), else through each call's second pass (:func:`~fa4dist.kernels.attention_backward`);
  ``dout=None`` with it: a loss of the lse alone (then the two-pass backends run that second pass only).

Several backward work lists on the same queries (a ring's steps against every member's keys) can share their
query side: :func:`share_queries` gives a handle where the backend has one (cute: one preprocess and one dQ
convert for all of them instead of one per call), ``attention_backward_items(..., shared=handle)`` adds the
items it can take into it, and :meth:`SharedQueries.finish` adds the shared dQ into the fp32 dq at the end.

A backend that implements ``forward_items`` / ``backward_items`` runs a list in few launches; any other (or one
that declines a list by returning None) runs it as one contract call per item, in order, through
:func:`~fa4dist.kernels.attention_forward` / :func:`~fa4dist.kernels.attention_backward`.  That loop is also the
definition the launches must match: :func:`forward_launches` cuts a forward list into launches of items with
pairwise disjoint query rows (each row then merges its items in list order, as in the loop), and the cute backend
runs each in one launch whose rows get the loop's bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from .api import attention_backward, attention_forward
from .mask import Mask, is_int, visible_pairs
from .problem import (EAGER_ONLY, OFFSET_LIMIT, AttentionProblem, accum_dtype, check_bool, check_buffer,
                      check_optional_bool, check_window, check_written, type_name, validate_inputs)
from .registry import select_backend


@dataclass(frozen=True)
class WorkItem:
    """One block of a work list (see the module docstring)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    q_offset: int = 0
    k_offset: int = 0
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # flash-attn's window_size in global positions (fa4dist.kernels.mask)

    def __post_init__(self):
        if isinstance(self.window, list):  # as the contract takes it; a tuple keeps the item hashable (launch plans)
            object.__setattr__(self, "window", tuple(self.window))
        elif self.window is None:  # the contract's (-1, -1): one item, and a pair for coalesce and the planners
            object.__setattr__(self, "window", (-1, -1))
        for name in _INT_FIELDS:  # NumPy integers as the contract takes them (Python ints: one hash, one repr)
            value = getattr(self, name)
            if is_int(value) and type(value) is not int:
                object.__setattr__(self, name, int(value))

    def mask_kwargs(self) -> dict:
        return dict(causal=self.causal, window=self.window, q_offset=self.q_offset, k_offset=self.k_offset)


_INT_FIELDS = ("q_start", "q_len", "k_start", "k_len", "q_offset", "k_offset")


def _check_items(items: Sequence[WorkItem], total_q: int, total_k: int) -> tuple[WorkItem, ...]:
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"items must be a list or tuple of WorkItem, got {type_name(items)}")
    for i, item in enumerate(items):
        if not isinstance(item, WorkItem):
            raise TypeError(f"items[{i}] must be a WorkItem, got {type_name(item)}")
        for name in _INT_FIELDS:
            value = getattr(item, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"items[{i}].{name} must be an int, got {type_name(value)}")
            if name.endswith("offset") and not -OFFSET_LIMIT <= value < OFFSET_LIMIT:
                raise ValueError(f"items[{i}].{name} must be a token position in [-2**62, 2**62), got {value}")
        if not isinstance(item.causal, bool):
            raise TypeError(f"items[{i}].causal must be a bool, got {type_name(item.causal)}")
        try:
            check_window(item.window)
        except (TypeError, ValueError) as err:
            raise type(err)(f"items[{i}]: {err}") from None
        if item.q_start < 0 or item.q_len < 0 or item.q_start + item.q_len > total_q:
            raise ValueError(f"items[{i}] query rows [{item.q_start}, {item.q_start + item.q_len}) are outside the "
                             f"{total_q} query tokens")
        if item.k_start < 0 or item.k_len < 0 or item.k_start + item.k_len > total_k:
            raise ValueError(f"items[{i}] key rows [{item.k_start}, {item.k_start + item.k_len}) are outside the "
                             f"{total_k} key tokens")
    return tuple(items)


def _layout(q, k, v, cp_invariant: bool = False, softmax_scale=None, softcap=None):
    """(token dim, validated problem of the whole tensors, with the list's softmax_scale and softcap) for a packed
    (3-D) or dense (4-D) work list."""
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        raise ValueError("q must be packed (tokens, heads, dim) or dense (batch, tokens, heads, dim) for a work list, "
                         f"got {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dim() == 3:
        # (k's rank is validate_inputs' to check and name: a 0-d k has no token count)
        n_q, n_k = q.shape[0], k.shape[0] if isinstance(k, torch.Tensor) and k.dim() > 0 else 0
        cu_q = torch.tensor([0, n_q], dtype=torch.int32)
        cu_k = torch.tensor([0, n_k], dtype=torch.int32)
        return 0, validate_inputs(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, cp_invariant=cp_invariant,
                                  softmax_scale=softmax_scale, softcap=softcap)
    return 1, validate_inputs(q, k, v, cp_invariant=cp_invariant, softmax_scale=softmax_scale, softcap=softcap)


def _check_whole_buffers(problem: AttentionProblem, what: str, running: dict, grads: dict) -> None:
    """The caller's whole buffers, named, before any item's view of them: ``running`` (fp32 / fp64 for fp64 inputs:
    the running out and lse, or dout / out / lse given as the forward left them) and ``grads`` (fp32 / fp64 buffers
    shaped like q, k, v, or None)."""
    acc = (torch.float64,) if problem.dtype == torch.float64 else (torch.float32,)
    shapes = {"out": problem.out_shape(), "dout": problem.out_shape(), "lse": problem.lse_shape(),
              "dlse": problem.lse_shape()}
    for name, (t, dtypes) in running.items():
        if t is None:
            raise ValueError(f"{what} needs {name}")
        check_buffer(name, t, shapes[name], problem.device, dtypes or acc)
    for name, (t, shape) in grads.items():
        check_buffer(name, t, shape, problem.device, acc)


def _out_gradients(what: str, dout, dlse, given: tuple[torch.dtype, ...]) -> dict:
    """The ``running`` entries of :func:`_check_whole_buffers` for the loss's gradients: dout (in ``given``) and
    dlse where given; dout may be None with dlse (a loss of the lse alone), not without."""
    if dout is None and dlse is None:
        raise ValueError(f"{what} needs dout (out's gradient), or dlse= with dout=None for a loss of the lse alone")
    return {**({} if dout is None else {"dout": (dout, given)}), **({} if dlse is None else {"dlse": (dlse, None)})}


def _forward_dtypes(problem: AttentionProblem) -> tuple[torch.dtype, ...]:
    """The dtypes dout and out may come in: the inputs', or fp32 (fp64 for fp64 inputs) as a running result."""
    return (problem.dtype, accum_dtype(problem.dtype))


def token_rows(t: Optional[torch.Tensor], dim: int, start: int, length: int, unsqueeze: bool) -> Optional[torch.Tensor]:
    """Rows [start, start + length) of the token dim ``dim`` (packed: with a batch dim of 1 added), or None."""
    if t is None:  # a gradient the caller does not ask for
        return None
    view = t.narrow(dim, start, length)
    return view.unsqueeze(0) if unsqueeze else view


def lse_token_rows(lse: torch.Tensor, packed: bool, start: int, length: int) -> torch.Tensor:
    """The same rows of an lse-shaped tensor ((b, h, s), or packed (h, t) -> (1, h, length))."""
    view = lse.narrow(-1, start, length)
    return view.unsqueeze(0) if packed else view


def uncovered_ranges(ranges, start: int, end: int) -> list[tuple[int, int]]:
    """The sub-ranges of ``[start, end)`` that none of ``ranges`` (half-open ``(a, b)`` pairs) covers, in order."""
    out, at = [], start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in ranges if a < end and b > start):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


class _Fresh:
    """Which query rows no item has written yet, for ``fresh=True``: an item over untouched rows writes instead of
    merging; an item over partly written rows first sets its untouched rows to the empty result (0, -inf)."""

    def __init__(self, enabled: bool):
        self.enabled, self.touched = enabled, []  # disjoint [start, end) intervals, unsorted

    def claim(self, start: int, end: int):
        """(write, untouched sub-ranges to clear before merging)."""
        if not self.enabled:
            return False, []
        cuts = [(a, b) for a, b in self.touched if a < end and b > start]
        gaps = uncovered_ranges(cuts, start, end)
        # the union: a touched interval reaching past [start, end) keeps its rows outside it
        lo = min([start] + [a for a, b in self.touched if a < end and b > start])
        hi = max([end] + [b for a, b in self.touched if a < end and b > start])
        self.touched = [(a, b) for a, b in self.touched if b <= start or a >= end] + [(lo, hi)]
        if not cuts:
            return True, []
        return False, gaps


def sees_all_keys(item: WorkItem) -> bool:
    """Every query row of the item sees every one of its keys under its mask (no masked pair)."""
    mask = Mask(item.causal, item.window)
    return visible_pairs(item.q_len, item.k_len, item.q_offset, item.k_offset, mask) == item.q_len * item.k_len > 0


def _joined(a: WorkItem, b: WorkItem) -> Optional[WorkItem]:
    """a and b (each seeing all its keys) as one item that sees all its keys, with the mask flags of one of them:
    the same key rows and adjacent query rows, or the same query rows and adjacent key rows; None if they do not
    fit."""
    if (a.k_start, a.k_len) == (b.k_start, b.k_len):
        lo, hi = (a, b) if a.q_start <= b.q_start else (b, a)
        if lo.q_start + lo.q_len != hi.q_start:
            return None
        rows = (lo.q_start, lo.q_len + hi.q_len, a.k_start, a.k_len)
    elif (a.q_start, a.q_len) == (b.q_start, b.q_len):
        lo, hi = (a, b) if a.k_start <= b.k_start else (b, a)
        if lo.k_start + lo.k_len != hi.k_start:
            return None
        rows = (a.q_start, a.q_len, lo.k_start, lo.k_len + hi.k_len)
    else:
        return None
    # positions that show every query every key under the same mask: the rows' own positions stop mattering
    for flags in (a, b):
        for q_offset in (0, rows[3] - 1):
            joined = WorkItem(*rows, q_offset, 0, causal=flags.causal, window=flags.window)
            if sees_all_keys(joined):
                return joined
    return None


def _joined_to_band(full: WorkItem, band: WorkItem) -> Optional[WorkItem]:
    """A fully visible item and a causal one on the same query rows, the full item's keys right before the causal
    one's in the buffer, as one causal item: the full item's keys take the positions just below the causal keys'
    (virtual positions), which every row sees as long as every row sees every key before the causal item's first
    (its first query position is at least that key's position - 1). A causal rule sees only relative order, so the
    joined item masks exactly the pairs the two did; a window measures distances, so windowed items are not
    joined. None if they do not fit."""
    if (full.q_start, full.q_len) != (band.q_start, band.q_len) or full.k_start + full.k_len != band.k_start:
        return None
    if not band.causal or tuple(band.window) != (-1, -1) or band.q_offset < band.k_offset - 1:
        return None
    return WorkItem(band.q_start, band.q_len, full.k_start, full.k_len + band.k_len, band.q_offset,
                    band.k_offset - full.k_len, causal=True)


def _join(a: WorkItem, b: WorkItem) -> Optional[WorkItem]:
    a_full, b_full = sees_all_keys(a), sees_all_keys(b)
    if a_full and b_full:
        return _joined(a, b)
    if a_full != b_full:
        return _joined_to_band(a, b) if a_full else _joined_to_band(b, a)
    return None


def coalesce(items: Sequence[WorkItem]) -> tuple[WorkItem, ...]:
    """The list with items joined where they share one side, into the place of the first of them: items that see
    all their keys with the same key rows and adjacent query rows, or the same query rows and adjacent key rows;
    and a causal item with the fully visible item whose keys come right before its own (``_joined_to_band``).
    A ring step's blocks of a zigzag or LPT plan often pair up so (a member's two chunks against one held chunk,
    or one chunk against the two it holds, or a member's later chunk against both of its own): one item then does
    in one pass what two did, with no merge between them (forward) and one dK/dV accumulation instead of two
    (backward), and fewer waves of items with disjoint rows. The sums change only in their rounding; the result
    is still a function of the list."""
    out: list[WorkItem] = []
    for item in items:
        place, i = len(out), 0
        while i < len(out):
            joined = _join(out[i], item)
            if joined is None:
                i += 1
                continue
            del out[i]
            item, place, i = joined, min(place, i), 0  # the joined item may fit another one
        out.insert(place, item)
    return tuple(out)


@dataclass(frozen=True)
class Launch:
    """Items of a work list that one launch can run (:func:`forward_launches`, :func:`backward_launches`)."""

    items: tuple[WorkItem, ...]  # in list order
    write: bool  # fresh rows (no earlier item touched them), written, not merged (forward) or added (backward dK / dV)
    variant: object  # the backend's kernel variant of every item


def forward_launches(items: Sequence[WorkItem], fresh: bool, variant) -> tuple[tuple[tuple[int, int], ...],
                                                                                 tuple[Launch, ...]]:
    """(rows to set to the empty result (0, -inf) first, launches in order) that compute ``items`` as the loop of
    :func:`attention_forward_items` does. ``variant(item)``: the backend's kernel variant of an item (hashable);
    items of different variants never share a launch.

    An item goes to the wave after the last wave holding an earlier item that shares one of its query rows, so
    every row still merges its items in list order; a wave becomes one launch per (write, variant). Items without
    query rows, or without keys (their fresh rows are cleared instead), launch nothing."""
    state = _Fresh(fresh)
    clears: list[tuple[int, int]] = []
    placed: list[tuple[int, int, int]] = []  # (start, end, wave) of the items so far
    waves: list[dict] = []
    for item in items:
        if item.q_len == 0:
            continue
        start, end = item.q_start, item.q_start + item.q_len
        write, gaps = state.claim(start, end)
        clears.extend(gaps)  # rows no earlier item touched: no later-placed item touches them before this one
        if item.k_len == 0:  # no key: fresh rows get the empty result, running ones keep theirs
            if write:
                clears.append((start, end))
            continue
        wave = 1 + max((w for a, b, w in placed if a < end and b > start), default=-1)
        placed.append((start, end, wave))
        if wave == len(waves):
            waves.append({})
        waves[wave].setdefault((write, variant(item)), []).append(item)
    launches = tuple(Launch(tuple(group), write, var) for wave in waves for (write, var), group in wave.items())
    return tuple(clears), launches


def _disjoint(a: WorkItem, b: WorkItem, keys_only: bool = False) -> bool:
    """Whether two items share no key row and (unless ``keys_only``) no query row."""
    keys = a.k_start + a.k_len <= b.k_start or b.k_start + b.k_len <= a.k_start
    return keys and (keys_only or a.q_start + a.q_len <= b.q_start or b.q_start + b.q_len <= a.q_start)


def backward_launches(items: Sequence[WorkItem], variant, queries_shared: bool = False) -> tuple[Launch, ...]:
    """Launches of a backward list (any grouping gives its gradients up to the order of the sums; the grouping is a
    function of the list, so a deterministic backend's sums keep one order run to run): items
    with pairwise disjoint key rows (a key tile's dK / dV are added by one CTA), pairwise disjoint query rows unless
    ``queries_shared`` (dQ then goes to one shared scratch by atomic adds; else each launch converts its own), and
    one variant (``variant(item)``, hashable) each, first fit in list order. Unmasked items on the same keys with
    adjacent query rows join first (one item: the keys' gradients then sum over both in one pass). Items without
    rows are dropped."""
    joined: list[WorkItem] = []
    for item in items:
        if item.q_len == 0 or item.k_len == 0:
            continue
        last = joined[-1] if joined else None
        if (last is not None and Mask.canonical(item.causal, item.window).full
                and Mask.canonical(last.causal, last.window).full
                and (last.k_start, last.k_len) == (item.k_start, item.k_len)
                and last.q_start + last.q_len == item.q_start):
            joined[-1] = replace(last, q_len=last.q_len + item.q_len)
        else:
            joined.append(item)
    groups: list[tuple[object, list[WorkItem]]] = []
    for item in joined:
        var = variant(item)
        for gvar, group in groups:
            if gvar == var and all(_disjoint(item, other, queries_shared) for other in group):
                group.append(item)
                break
        else:
            groups.append((var, [item]))
    return tuple(Launch(tuple(group), False, var) for var, group in groups)


def fresh_key_launches(launches: Sequence[Launch], total_k: int) -> tuple[tuple[tuple[int, int], ...],
                                                                           tuple[tuple[int, Launch], ...]]:
    """Backward launches (in the order they run) into dk / dv that hold no gradient yet (``fresh_dkv``): (key rows
    to set to zero first, and each launch split into the items whose key rows no earlier launch touched, which
    write their gradients, and the others, which add them: ``(index of the launch it came from, part)``).

    Rows no item touches and the untouched rows of an adding item are the zeros. The parts keep their launch's place
    and a launch's items have pairwise disjoint key (and, deterministic, query) rows, so every sum keeps the terms
    and order of the zero-filled run, and a written tile stores ``0 + x`` as the add into zeros would."""
    state = _Fresh(True)
    clears: list[tuple[int, int]] = []
    parts: list[tuple[int, Launch]] = []
    for index, launch in enumerate(launches):
        split: dict[bool, list[WorkItem]] = {True: [], False: []}
        for item in launch.items:
            write, gaps = state.claim(item.k_start, item.k_start + item.k_len)
            clears.extend(gaps)
            split[write].append(item)
        parts.extend((index, Launch(tuple(split[w]), w, launch.variant)) for w in (True, False) if split[w])
    clears.extend(uncovered_ranges(state.touched, 0, total_k))
    return tuple(sorted(clears)), tuple(parts)


@torch.compiler.disable(reason=EAGER_ONLY)
def attention_forward_items(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    items: Sequence[WorkItem],
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    fresh: bool = False,
    backend: str = "auto",
    cp_invariant: bool = False,
    overlap_previous: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges every item's block into the running fp32 ``(out, lse)``, in list order; returns them.

    ``fresh=True``: out and lse hold no result yet (any values); rows no item covers are left as they are, rows the
    first time an item covers them are written instead of merged (equal to merging into (0, -inf), one pass less).

    ``overlap_previous=True``: a promise that the GPU work queued just before this call in the current stream wrote
    none of q, k, v (a previous call's merges into out / lse, say, as a ring's steps are): a backend may then start
    this call's kernels while that work finishes, ordering only their reads and writes of out and lse after it (the
    cute backend: programmatic dependent launch). The same bits; backends without it ignore it.
    """
    check_bool("fresh", fresh)
    check_bool("overlap_previous", overlap_previous)
    seq_dim, problem = _layout(q, k, v, cp_invariant, softmax_scale, softcap)
    _check_whole_buffers(problem, "attention_forward_items (the running fp32 result)",
                         {"out": (out, None), "lse": (lse, None)}, {})
    check_written({"out": out, "lse": lse}, {"q": q, "k": k, "v": v})
    items = _check_items(items, q.shape[seq_dim], k.shape[seq_dim])
    impl = select_backend(backend, problem, "forward")
    if getattr(impl, "forward_items", None) is not None:
        # (only a backend that says it takes the promise gets it: forward_items' signature is the registry's)
        extra = {"overlap_previous": True} if overlap_previous and getattr(impl, "overlaps_previous", False) else {}
        done = impl.forward_items(q, k, v, items, out, lse, softmax_scale=problem.softmax_scale,
                                  softcap=problem.softcap, fresh=fresh, **extra)
        if done is not None:
            return out, lse
    packed = seq_dim == 0
    state = _Fresh(fresh)
    for item in items:
        if item.q_len == 0:
            continue
        o = token_rows(out, seq_dim, item.q_start, item.q_len, packed)
        m = lse_token_rows(lse, packed, item.q_start, item.q_len)
        write, clear = state.claim(item.q_start, item.q_start + item.q_len)
        for a, b in clear:
            token_rows(out, seq_dim, a, b - a, False).zero_()
            lse.narrow(-1, a, b - a).fill_(float("-inf"))
        qc = token_rows(q, seq_dim, item.q_start, item.q_len, packed)
        kc = token_rows(k, seq_dim, item.k_start, item.k_len, packed)
        vc = token_rows(v, seq_dim, item.k_start, item.k_len, packed)
        attention_forward(qc, kc, vc, softmax_scale=softmax_scale, softcap=softcap, out=o, lse=m,
                          accumulate=not write, backend=backend, cp_invariant=cp_invariant, **item.mask_kwargs())
    return out, lse


def _described(tensors: dict) -> dict:
    """name -> ((shape, dtype, device), (address, strides)) of each tensor: what a shared query side was made for."""
    return {name: None if t is None else ((tuple(t.shape), t.dtype, t.device), (t.data_ptr(), t.stride()))
            for name, t in tensors.items()}


class SharedQueries:
    """The shared query side of backward work lists on the same queries (:func:`share_queries`). ``given``: the
    dout, q, out and lse it was made for, described, and ``softmax_scale`` its preprocess used (:meth:`check_call`).
    ``zero_dout``: made for dout=None (a loss of the lse alone), the zeros its preprocess took as dout, which the
    lists' kernels on it take too (one for every list)."""

    def __init__(self, impl, state, seq_dim: int, deterministic: bool, given: dict, softmax_scale: float,
                 zero_dout: Optional[torch.Tensor] = None):
        self.impl, self.state, self.seq_dim, self.deterministic = impl, state, seq_dim, deterministic
        self.given, self.softmax_scale, self.zero_dout = given, softmax_scale, zero_dout
        self.finished = False

    def takes(self, item: "WorkItem") -> bool:
        return not self.finished and self.state.takes(item.q_start, item.q_len)

    def check_call(self, tensors: dict, head_dim_v: int, softmax_scale: float) -> None:
        """A work list's q, dout, out and lse (and its v's head dim, its softmax_scale) against the ones this side
        was made for: its preprocess read those (lse, rowsum(dout * out) * softmax_scale), so with others the list's
        gradients would be wrong, silently."""
        if softmax_scale != self.softmax_scale:
            raise ValueError(f"shared= was made (share_queries) with softmax_scale {self.softmax_scale}, but this "
                             f"call's is {softmax_scale}: its preprocess scaled rowsum(dout * out) by it")
        made = self.given["out"][0][0][-1]
        if head_dim_v != made:
            raise ValueError(f"shared= was made (share_queries) for dout and out of head dim {made}, but this call's "
                             f"v has head dim {head_dim_v}: a shared query side serves only the dout, q, out and "
                             "lse it was made for")
        for name, described in _described(tensors).items():
            if (described is None) != (self.given[name] is None):
                raise ValueError(f"shared= was made (share_queries) {'with' if described is None else 'without'} "
                                 f"{name}, but this call has {'none' if described is None else 'one'}: its "
                                 "preprocess's row sums took what it was made with")
            if described is None:
                continue
            (got, memory), (want, made_memory) = described, self.given[name]
            if got != want:
                raise ValueError(f"shared= was made (share_queries) for {name} of shape {want[0]}, {want[1]} on "
                                 f"{want[2]}, but this call's {name} is {got[0]}, {got[1]} on {got[2]}: a shared "
                                 "query side serves only the dout, q, out and lse it was made for")
            if memory != made_memory:
                raise ValueError(f"shared= was made (share_queries) for another {name} tensor (other memory) than "
                                 f"this call's: a shared query side serves only the dout, q, out and lse it was made "
                                 "for (pass the same tensors to every list)")

    def finish(self, dq: torch.Tensor) -> torch.Tensor:
        """Adds the shared dQ of every item it took into the fp32 dq (the work lists' dq); returns dq."""
        if self.finished:
            raise RuntimeError("SharedQueries.finish was already called")
        if dq is None:
            raise ValueError("SharedQueries.finish needs dq: the work lists' fp32 dq, which the shared dQ goes into")
        shape, dtype, device = self.given["q"][0]
        check_buffer("dq", dq, shape, device, (accum_dtype(dtype),))
        self.finished = True
        self.state.finish(dq.unsqueeze(0) if self.seq_dim == 0 else dq)
        return dq


@torch.compiler.disable(reason=EAGER_ONLY)
def share_queries(dout, q, out, lse, *, softmax_scale=None, softcap=None, deterministic=None,
                  backend: str = "auto", dlse: Optional[torch.Tensor] = None) -> Optional[SharedQueries]:
    """A shared query side for backward work lists on these queries (dout, q, out, lse as the lists get them), or
    None where the backend has none (every call then keeps its own, with the same result up to fp32 rounding).
    dout and out have v's head dim (which may differ from q's): the lists that use the handle must have it too.
    ``dlse``: the lse's gradient, which the lists get too (the side's row sums take it, where the backend takes
    it at all: ``lse_gradient``); ``dout=None`` with it: a loss of the lse alone (the side takes zeros for dout)."""
    check_optional_bool("deterministic", deterministic)
    seq_dim, whole = _layout(q, q, q, softmax_scale=softmax_scale, softcap=softcap)
    if isinstance(out, torch.Tensor) and out.dim() > 0 and out.shape[-1] > 0:  # no v here: out has its head dim
        whole = replace(whole, head_dim_v=out.shape[-1])
    given = _forward_dtypes(whole)
    what = "share_queries (the global forward result and its gradient, as the lists get them)"
    _check_whole_buffers(whole, what, {"out": (out, given), "lse": (lse, None),  # out first: v's dim
                                       **_out_gradients(what, dout, dlse, given)}, {})
    packed = seq_dim == 0
    n = q.shape[seq_dim]
    if n == 0:
        return None
    queries = token_rows(q, seq_dim, 0, n, packed)  # a launch's view: dense, batch 1 for packed rows
    problem = validate_inputs(queries, queries, queries, softcap=softcap, softmax_scale=softmax_scale)
    impl = select_backend(backend, problem, "backward")
    make = getattr(impl, "shared_rows", None)
    if make is None or (dlse is not None and not getattr(impl, "lse_gradient", False)):
        return None
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    rows = dict(dlse=lse_token_rows(dlse, packed, 0, n)) if dlse is not None else {}
    # (a loss of the lse alone: the preprocess's row sums rowsum(dout * out) - dlse take a zero dout)
    zero_dout = None if dout is not None else torch.zeros(out.shape, dtype=q.dtype, device=q.device)
    state = make(token_rows(dout if dout is not None else zero_dout, seq_dim, 0, n, packed), queries,
                 token_rows(out, seq_dim, 0, n, packed), lse_token_rows(lse, packed, 0, n),
                 softmax_scale=problem.softmax_scale, deterministic=bool(deterministic), **rows)
    return None if state is None else SharedQueries(
        impl, state, seq_dim, bool(deterministic),
        _described({"q": q, "dout": dout, "out": out, "lse": lse, "dlse": dlse}), problem.softmax_scale, zero_dout)


@torch.compiler.disable(reason=EAGER_ONLY)
def attention_backward_items(
    dout: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    items: Sequence[WorkItem],
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    *,
    softmax_scale: Optional[float] = None,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    backend: str = "auto",
    cp_invariant: bool = False,
    shared: Optional[SharedQueries] = None,
    fresh_dkv: bool = False,
    dlse: Optional[torch.Tensor] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Adds every item's gradients into the fp32 ``dq, dk, dv``, in list order, given the global out and lse.
    ``dq=None`` or ``dk=dv=None``: those are not computed (the contract's rule for accumulate=True).
    ``shared``: the items it takes add their dQ into it instead (:func:`share_queries`; not with cp_invariant, and
    not with dq=None).
    ``fresh_dkv=True``: dk and dv hold no gradient yet (any values): they end as the sum of the items' gradients,
    zero on key rows no item has, the bits of the same call into zeros, without a pass that fills them (dq is
    still added into).
    ``dlse`` (lse's shape, fp32; fp64 for fp64 inputs): the global lse's gradient, added to the items' gradients
    as :func:`~fa4dist.kernels.attention_backward` adds it (``shared`` must have been made with the same).
    ``dout=None`` with ``dlse``: a loss of the lse alone (dv gets zeros): each item's call runs the lse's pass
    alone where the backend has no ``lse_gradient``; a backend's list launches and a shared query side take one
    dout of zeros for the whole call (``shared`` must have been made with dout=None too)."""
    check_bool("fresh_dkv", fresh_dkv)
    if shared is not None and not isinstance(shared, SharedQueries):
        raise TypeError(f"shared must be a SharedQueries handle (from share_queries) or None, got "
                        f"{type(shared).__name__}")
    if fresh_dkv and (dk is None or dv is None):
        raise ValueError("fresh_dkv=True needs dk and dv to write into")
    if (dk is None) != (dv is None):
        raise ValueError("attention_backward_items adds dk and dv together: give both, or neither (then neither is "
                         "computed)")
    if dq is None and dk is None:
        raise ValueError("attention_backward_items needs dq, or dk and dv, or all three: the fp32 buffers it adds "
                         "into (a gradient without a buffer is not computed)")
    seq_dim, problem = _layout(q, k, v, cp_invariant, softmax_scale, softcap)
    given = _forward_dtypes(problem)
    what = "attention_backward_items (the global forward result and its gradient)"
    _check_whole_buffers(problem, what, {**_out_gradients(what, dout, dlse, given), "out": (out, given),
                                         "lse": (lse, None)},
                         {"dq": (dq, tuple(q.shape)), "dk": (dk, tuple(k.shape)), "dv": (dv, tuple(v.shape))})
    check_written({"dq": dq, "dk": dk, "dv": dv}, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                                                  "dlse": dlse})
    items = _check_items(items, q.shape[seq_dim], k.shape[seq_dim])
    if check_optional_bool("deterministic", deterministic) is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    impl = select_backend(backend, problem, "backward")
    if shared is not None and (cp_invariant or shared.deterministic != bool(deterministic) or dk is None
                               or dq is None):
        # (dq=None means dQ is not computed, but the items a shared side takes add theirs into it, and its finish()
        # into the caller's dq: it would hold the dQ of lists that asked for none)
        raise ValueError("shared= needs cp_invariant=False and the deterministic setting it was made with (and "
                         "dq, dk and dv to add into)")
    if shared is not None:
        shared.check_call({"q": q, "dout": dout, "out": out, "lse": lse, "dlse": dlse}, problem.head_dim_v,
                          problem.softmax_scale)
    # what the list's launches and a shared side's calls take as dout: for dout=None (a loss of the lse alone) zeros,
    # the shared side's (made with dout=None too: one for every list) or made once for the launches
    kernel_dout = dout if dout is not None or shared is None else shared.zero_dout
    if getattr(impl, "backward_items", None) is not None and not cp_invariant and (
            dlse is None or getattr(impl, "lse_gradient", False)):
        rows = None if shared is None or shared.finished or shared.impl is not impl else shared.state
        if kernel_dout is None:
            kernel_dout = torch.zeros(problem.out_shape(), dtype=problem.dtype, device=problem.device)
        done = impl.backward_items(kernel_dout, q, k, v, out, lse, items, dq, dk, dv,
                                   softmax_scale=problem.softmax_scale, softcap=problem.softcap,
                                   deterministic=bool(deterministic), shared=rows, fresh_dkv=fresh_dkv,
                                   **({} if dlse is None else {"dlse": dlse}))
        if done is not None:
            return dq, dk, dv
    if fresh_dkv:  # the loop adds every item: into zeros
        dk.zero_()
        dv.zero_()
    packed = seq_dim == 0
    for item in items:
        if item.q_len == 0 or item.k_len == 0:
            continue
        qs = (item.q_start, item.q_len)
        ks = (item.k_start, item.k_len)
        if shared is not None and shared.takes(item):
            views = [token_rows(t, seq_dim, *qs, packed) for t in (kernel_dout, q, out)]
            kv = [token_rows(t, seq_dim, *ks, packed) for t in (k, v, dk, dv)]
            item_problem = validate_inputs(views[1], kv[0], kv[1], softcap=softcap, softmax_scale=softmax_scale,
                                           **item.mask_kwargs())
            if select_backend(backend, item_problem, "backward") is shared.impl:
                shared.impl.backward(item_problem, views[0], views[1], kv[0], kv[1], views[2],
                                     lse_token_rows(lse, packed, *qs), deterministic, dq=None, dk=kv[2], dv=kv[3],
                                     accumulate=True, rows=shared.state, q_start=item.q_start)
                continue
        attention_backward(
            token_rows(dout, seq_dim, *qs, packed), token_rows(q, seq_dim, *qs, packed),
            token_rows(k, seq_dim, *ks, packed), token_rows(v, seq_dim, *ks, packed),
            token_rows(out, seq_dim, *qs, packed), lse_token_rows(lse, packed, *qs),
            softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic,
            dq=token_rows(dq, seq_dim, *qs, packed),
            dk=token_rows(dk, seq_dim, *ks, packed), dv=token_rows(dv, seq_dim, *ks, packed), accumulate=True,
            backend=backend, cp_invariant=cp_invariant, **item.mask_kwargs(),
            dlse=None if dlse is None else lse_token_rows(dlse, packed, *qs),
        )
    return dq, dk, dv
