"""Registry adapter: exposes the Hopper CuTe DSL kernels as backend "cute" of fa4dist.kernels.

The backend has fused epilogues: the forward writes, or in accumulate mode merges, straight into the caller's
(out, lse); the backward writes dq/dk/dv or adds into the caller's fp32 buffers.  Head dims the backward lacks
(256) are reported by supports(), so "auto" picks the next backend for them.

Masks: the kernels know a causal diagonal and a sliding window's lower edge below it (``window_left``).
``kernel_band`` maps a call's band ``lo <= s - p <= hi`` onto that: causal on the diagonal shifted by ``hi`` (the
query offsets move by ``hi``) and ``window_left = hi - lo``. A band without an upper edge but with a lower one is
not expressible and falls back.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import forward as _fwd
from . import host


def kernel_band(mask):
    """(causal, window_left, q_shift) the kernels take for ``mask`` (fa4dist.kernels.mask.Mask), or None."""
    if not mask.windowed:
        return mask.causal, -1, 0
    hi, lo = mask.hi, mask.lo
    if hi is None:
        return None
    return True, (hi - lo if lo is not None else -1), hi


# the kernels hold a window's width and a causal diagonal in int32 arithmetic with headroom
BAND_LIMIT = 2**30
# the causal diagonal's range: the backward's launch takes |diag| <= INT32_MAX // 4 (the forward's INT32_MAX // 2),
# so supports() must not promise more (a call it takes would then fail at launch, or overflow per segment)
DIAG_LIMIT = host.INT32_MAX // 4


def band_diagonal_fits(band, q_offset: int, k_offset: int) -> bool:
    """Whether a call's kernel band (kernel_band) and its diagonal q_offset - k_offset fit the kernels' range."""
    causal, window_left, shift = band
    return window_left < BAND_LIMIT and (not causal or abs(q_offset + shift - k_offset) <= DIAG_LIMIT)


class CuteSm90Backend:
    name = "cute"
    priority = 30  # above "sdpa" (20): chosen by "auto" wherever it supports the call
    fused_epilogue = True
    # cp_invariant (fa4dist.kernels.invariant): a row's result depends on its own operands only (fixed tiles, the
    # per-row softmax state, key tiles at fixed offsets from the call's first key; fully masked tiles add exact
    # zeros) and a key's gradient sums query tiles in a fixed order; checked bitwise on the GPU
    # (tests/cp/test_cp_gpu.py, tests/cp/multigpu_check.py).
    cp_invariant = True
    # the fixed-point dq (dq_scale=; fa4dist.kernels.fixed_point): the kernel's 128-key tiles from the call's first
    # key are the canonical tiles, each added as int64 (bwd_sm90.FlashBwdSm90.dq_fixed)
    fixed_point_dq = True
    lse_gradient = True  # dlse= joins the preprocess's row sums (bwd_preprocess.py): no second pass
    # the work-list launches and the shared query side take dlse= in their preprocesses (False: their lists run the
    # per-item calls). (Off in the thirty-ninth session: the shared side dropped a unit-stride dlse, so the ring's
    # dq with a loss of the lse came out wrong; fixed in the fortieth.)
    worklist_dlse = True

    def __init__(self):
        # Both answers depend on their arguments alone, and the contract asks both on every forward and backward:
        # remembered, they cost ~2 us instead of ~16 on the GPU machine, ~30 us of a short forward+backward's host
        # time (bench/host_python.py's first row; bench/RESULTS.md, forty-second session).
        self._available_on: dict = {}
        self._verdicts: dict = {}

    def available(self, device) -> bool:
        try:
            return self._available_on[device]
        except (KeyError, TypeError):  # (TypeError: an unhashable device argument is answered uncached)
            pass
        answer = self.unavailable_reason(device) is None
        # remembered for a device named with its index ("cuda" alone means whichever device is current)
        if isinstance(device, (torch.device, str)) and torch.device(device).index is not None:
            self._available_on[device] = answer
        return answer

    @staticmethod
    def unavailable_reason(device) -> Optional[str]:
        """What the device or the install lacks for the kernels (the registry's error names it), or None."""
        device = torch.device(device)
        if device.type != "cuda":
            return "the cute kernels run on CUDA tensors of a Hopper GPU (sm_90: H100, H200)"
        if not torch.cuda.is_available():
            return "this torch sees no CUDA device"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            return f"the cute kernels are built for Hopper (sm_90), this GPU is sm_{major}{minor}"
        if not host.cutlass_importable():
            return "nvidia-cutlass-dsl is not installed: pip install 'fa4dist[cute]'"
        return None

    # a bound on the remembered verdicts (calls of many shapes are distinct problems)
    _VERDICTS_KEPT = 4096

    def supports(self, problem, direction: str):
        """None where the kernels compute ``problem`` (a function of the problem and the direction alone, so the
        verdict is remembered for dense calls), else Unsupported with the reason."""
        if problem.cu_seqlens_q_tensor is not None or problem.cu_seqlens_k_tensor is not None:
            # packed: not remembered, as the key would keep the caller's cu_seqlens tensors alive (inside a CUDA
            # graph's memory pool, torch.compile's cudagraph trees refuse such a tensor)
            return self._supports(problem, direction)
        key = (problem, direction)
        try:
            return self._verdicts[key]
        except KeyError:
            pass
        except TypeError:  # a field that does not hash (a symbolic size): answered uncached
            return self._supports(problem, direction)
        verdict = self._supports(problem, direction)
        if len(self._verdicts) >= self._VERDICTS_KEPT:
            self._verdicts.clear()
        self._verdicts[key] = verdict
        return verdict

    def _supports(self, problem, direction: str):
        from ..registry import Unsupported

        if problem.device.type != "cuda":
            return Unsupported(f"cute runs on CUDA tensors only, got {problem.device}")
        band = kernel_band(problem.mask)
        if band is None:
            return Unsupported(f"cute takes windows with an upper edge (causal or right >= 0), got {problem.mask}",
                               fallback=True)
        if band[1] >= BAND_LIMIT:
            return Unsupported("window wider than 2^30 keys", fallback=True)
        if problem.dtype not in (torch.bfloat16, torch.float16):
            return Unsupported(f"cute takes float16 or bfloat16, got {problem.dtype}")
        if problem.head_dim != problem.head_dim_v or problem.head_dim not in _fwd.SUPPORTED_HEAD_DIMS:
            return Unsupported(
                f"cute supports head dims {_fwd.SUPPORTED_HEAD_DIMS} with equal q/k/v head dims, "
                f"got {problem.head_dim}/{problem.head_dim_v}"
            )
        if problem.softmax_scale <= 0:  # both kernels mask with -inf scores, which a negative scale would flip
            return Unsupported(f"cute needs a positive softmax_scale, got {problem.softmax_scale}")
        if not host.score_scale_fits(problem.softmax_scale, problem.softcap or 0.0):
            return Unsupported(f"softmax_scale {problem.softmax_scale:g} over softcap {problem.softcap or 0.0:g}: "
                               f"the cute kernels take their score scale as one normal float32 number")
        from . import backward as _bwd

        if direction == "backward" and problem.head_dim not in _bwd.BWD_HEAD_DIMS:
            return Unsupported(f"the cute backward supports head dims {_bwd.BWD_HEAD_DIMS}, got {problem.head_dim}")
        # the kernels index in 32 bits (non-compact views are copied compact first, see _kernel_ready)
        d = max(problem.head_dim, problem.head_dim_v)
        largest = max(problem.total_q * problem.heads_q, problem.total_k * problem.heads_kv) * d
        if direction == "backward":
            largest = max(largest, _bwd.dq_scratch_elements(problem.total_q, problem.batch, problem.heads_q, d))
        if largest >= host.INT32_MAX:
            return Unsupported(f"{largest} elements in one tensor: the cute kernels index in 32 bits")
        offsets = tuple(zip(problem.q_offsets, problem.k_offsets))
        if not all(band_diagonal_fits(band, qo, ko) for qo, ko in offsets):
            if all(abs(qo - ko) <= DIAG_LIMIT for qo, ko in offsets):  # the window's right edge moved it there
                return Unsupported(f"a window's right edge of {problem.mask.hi} keys puts the kernels' causal "
                                   f"diagonal past its int32 range", fallback=True)
            return Unsupported("q_offset - k_offset beyond int32 range")
        return None

    @staticmethod
    def _kernel_ready(t: torch.Tensor, elems: int) -> bool:
        """TMA needs a contiguous head dim and 16-byte aligned base and strides; 32-bit indexing needs the
        view's extent below 2^31 elements."""
        strides = t.stride()
        if strides[-1] != 1 or t.data_ptr() % 16:
            return False
        for s in strides[:-1]:  # (a loop: a generator cost more host time than the check, at short sequences)
            if s % elems:
                return False
        # a contiguous view spans numel elements (host time counts at short sequences: no per-dim walk then)
        extent = t.numel() - 1 if t.is_contiguous() else sum((n - 1) * s for n, s in zip(t.shape, strides))
        return extent < host.INT32_MAX

    fused_sinks = True  # the forward epilogue takes the sinks (non-accumulate); the contract merges them otherwise
    overlaps_previous = True  # forward_items takes overlap_previous (programmatic dependent launch)

    def forward_items(self, q, k, v, items, out, lse, *, softmax_scale, softcap, fresh, overlap_previous=False):
        """A forward work list (fa4dist.kernels.worklist) in few launches: one per wave of items with disjoint query
        rows and kernel variant (worklist.forward_launches; per batch element for a dense batch). Each row gets the
        bits of the per-item loop. Returns None (the caller loops) where the tensors or an item do not suit it.
        ``overlap_previous``: every launch may start while the kernel before it finishes (programmatic dependent
        launch, forward.forward_worklist); the caller promises that the work before this call wrote none of q, k, v."""
        if not self._worklist_ready(q, k, v, out, lse):
            return None
        plan = self._forward_plan(q, items, fresh, softmax_scale, softcap)
        if plan is None:
            return None
        clears, launches = plan
        packed = q.dim() == 3
        tok = 0 if packed else 1
        for a, b in clears:
            out.narrow(tok, a, b - a).zero_()
            lse.narrow(-1, a, b - a).fill_(float("-inf"))
        for bi in ([None] if packed else range(q.shape[0])):
            view = (lambda t: t) if packed else (lambda t: t[bi])  # noqa: E731 - a dense batch element as packed
            for table, max_q, causal, window_left, write in launches:
                _fwd.forward_worklist(view(q), view(k), view(v), view(out), view(lse), table, max_q,
                                      softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                                      softcap=softcap, accumulate=not write, overlap_previous=overlap_previous)
        return out, lse

    def backward_items(self, dout, q, k, v, out, lse, items, dq, dk, dv, *, softmax_scale, softcap, deterministic,
                       shared=None, fresh_dkv=False, dlse=None):
        """A backward work list in few launches (worklist.backward_launches): one main kernel per group of items
        with disjoint key rows (and query rows, unless the launches share a non-deterministic query side). Items
        whose rows ``shared`` (backward.SharedRows of these queries) takes add their dQ into its scratch; the other
        groups run their own preprocess and dQ convert. Deterministic: the same sums in an order fixed by the list
        (the tickets of each query tile within a launch, the launches in order), not the loop's order. ``dlse``
        (fp32, lse's layout): the lse's gradient, joined to the row sums of the launches' own preprocesses (``shared``
        was made with the same). Returns None (the caller loops) where the tensors or an item do not suit it."""
        from . import backward as _bwd

        if dq is None or dk is None or dv is None or q.shape[-1] not in _bwd.BWD_HEAD_DIMS:
            return None
        if not self._worklist_ready(q, k, v, dq, lse) or dout.dtype != q.dtype:
            return None
        if not all(self._kernel_ready(t, 8) for t in (dout, out)) or not all(
                self._kernel_ready(t, 4) and t.dtype == torch.float32 for t in (dk, dv)):
            return None
        packed = q.dim() == 3
        if shared is not None and not (packed or q.shape[0] == 1):
            shared = None
        if shared is not None and shared.deterministic != bool(deterministic):
            shared = None
        if dlse is not None and not self.worklist_dlse:
            return None
        if dlse is not None:
            dlse = dlse.to(torch.float32)
            dlse = dlse if dlse.stride(-1) == 1 else dlse.contiguous()  # (the preprocess takes lse's unit stride)
        causal_keys = [it.k_len for it in items if it.causal]
        if deterministic and shared is None and _bwd.deterministic_gqa_form(
                q.shape[-2] // k.shape[-2], q.shape[-1], True, max(causal_keys, default=None)) == "expanded":
            return None  # the loop's calls take the expanded heads there, faster than the GQA tickets
        tok = 0 if packed else 1
        plan = self._backward_plan(q, items, shared, bool(deterministic), k.shape[tok] if fresh_dkv else None)
        if plan is None:
            return None
        clears, launches = plan
        for a, b in clears:
            dk.narrow(tok, a, b - a).zero_()
            dv.narrow(tok, a, b - a).zero_()
        for bi in ([None] if packed else range(q.shape[0])):
            view = (lambda t: t) if packed else (lambda t: t[bi])  # noqa: E731 - a dense batch element as packed
            for table, tiles, max_q, max_k, causal, window_left, on_shared, write in launches:
                _bwd.backward_worklist(view(dout), view(q), view(k), view(v), view(out), view(lse), view(dq),
                                       view(dk), view(dv), table, scratch_tiles=tiles, max_q_len=max_q,
                                       max_k_len=max_k, softmax_scale=softmax_scale, causal=causal,
                                       window_left=window_left, softcap=softcap,
                                       rows=shared if on_shared else None, deterministic=deterministic,
                                       write_dkv=write, dlse=None if dlse is None or on_shared else view(dlse))
        return dq, dk, dv

    @staticmethod
    def _cu_seqlens(problem) -> dict:
        """The kernels' cu_seqlens arguments: the problem's, on q's device and contiguous (packed calls)."""
        if not problem.varlen:
            return dict(cu_seqlens_q=None, cu_seqlens_k=None)
        cq, ck = problem.device_cu_seqlens()
        return dict(cu_seqlens_q=cq, cu_seqlens_k=ck)

    def _worklist_ready(self, q, k, v, out, lse) -> bool:
        """Tensors a work-list launch takes as they are (the loop copies odd layouts per item instead)."""
        if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16) or out.dtype != torch.float32:
            return False
        if q.shape[-1] not in _fwd.SUPPORTED_HEAD_DIMS or v.shape[-1] != q.shape[-1] or lse.stride(-1) != 1:
            return False
        if not all(self._kernel_ready(t, 8) for t in (q, k, v)) or not self._kernel_ready(out, 4):
            return False
        return q.shape[-3] > 0 and k.shape[-3] > 0

    _PLANS: dict = {}

    @staticmethod
    def _band(item):
        """The kernels' (causal, window_left, q_shift) of an item, or None where they cannot take it."""
        from ..mask import Mask

        band = kernel_band(Mask.canonical(item.causal, item.window))
        return band if band is not None and band_diagonal_fits(band, item.q_offset, item.k_offset) else None

    def _bands(self, items):
        """{item: kernel band} of every item, or None where one does not suit the kernels."""
        bands = {item: self._band(item) for item in items}
        return None if any(b is None for b in bands.values()) else bands

    @staticmethod
    def _longest_first(items):
        """A launch's items by descending work (visible pairs): the kernels take the table's items in order (each
        item's tiles longest first), so the largest start first. A launch's items are independent, so the order
        changes no result."""
        from ..mask import Mask, visible_pairs

        def work(it):
            return visible_pairs(it.q_len, it.k_len, it.q_offset, it.k_offset, Mask.canonical(it.causal, it.window))

        return sorted(items, key=work, reverse=True)

    @staticmethod
    def _row(item, band, scratch_base):
        """The item's row of a work-list table (block_info.WORKLIST_COLUMNS)."""
        causal, _, shift = band
        diag = item.q_offset + shift - item.k_offset if causal else item.k_len  # unmasked: sees every key
        return [item.q_start, item.q_len, item.k_start, item.k_len, diag, scratch_base]

    def _backward_plan(self, q, items, shared, deterministic: bool, fresh_total_k: Optional[int] = None):
        """(clears, [(device table, scratch tiles, longest query rows, longest key rows, causal, window_left, whether
        the launch uses ``shared``, whether it writes dK / dV)]) of a backward list, cached by the list; None if an
        item does not suit. ``fresh_total_k``: dk / dv hold nothing yet and have this many rows
        (worklist.fresh_key_launches: the key rows to zero, and launches split into written and added items);
        None: every launch adds, nothing is cleared."""
        from ..worklist import backward_launches, fresh_key_launches
        from .backward import tile_m_for

        # the heads too: the plan is None where a launch's dQ scratch (tiles x heads x tile_m x d) would outgrow
        # 32-bit indexing, which a plan cached for fewer heads must not hide
        key = ("bwd", tuple(items), None if shared is None else shared.rows, deterministic, fresh_total_k, q.dtype,
               q.shape[-2], q.shape[-1], str(q.device))
        plan = self._PLANS.get(key)
        if plan is not None:
            return plan
        if self._bands(items) is None:
            return None
        tm = tile_m_for(q.shape[-1])
        # the shared query side takes items whose rows start (and end) on its tiles; the others' launches keep their
        # own, and then their items need disjoint query rows too (one convert per launch), as every deterministic
        # launch's do (the tickets of one query tile count one item's key tiles)
        taken = [shared is not None and shared.takes(i.q_start, i.q_len) for i in items]
        variant = lambda it: self._band(it)[:2]  # noqa: E731
        ordered = [(True, launch) for launch in backward_launches([i for i, t in zip(items, taken) if t], variant,
                                                                  queries_shared=not deterministic)]
        ordered += [(False, launch) for launch in backward_launches([i for i, t in zip(items, taken) if not t],
                                                                    variant)]
        clears = ()
        if fresh_total_k is not None:
            clears, parts = fresh_key_launches([launch for _, launch in ordered], fresh_total_k)
            ordered = [(ordered[index][0], part) for index, part in parts]
        out = []
        for on_shared, launch in ordered:
            rows, tiles = [], 0
            for item in self._longest_first(launch.items):
                rows += self._row(item, self._band(item), item.q_start // tm if on_shared else tiles)
                tiles += -(-item.q_len // tm)
            if tiles * q.shape[-2] * tm * q.shape[-1] >= host.INT32_MAX:
                return None  # the launch's own dQ scratch would outgrow 32-bit indexing
            causal, window_left = launch.variant
            table = torch.tensor(rows, dtype=torch.int32, device=q.device)
            out.append((table, tiles, max(i.q_len for i in launch.items), max(i.k_len for i in launch.items),
                        causal, window_left, on_shared, launch.write))
        if len(self._PLANS) > 256:
            self._PLANS.clear()
        plan = self._PLANS[key] = (clears, tuple(out))
        return plan

    def _forward_plan(self, q, items, fresh, softmax_scale, softcap):
        """(clears, [(device table, longest query rows, causal, window_left, write)]) of a work list, cached by the
        list (a ring's schedule hands the same lists every step), or None if an item's mask does not suit."""
        from ..worklist import forward_launches

        d = q.shape[-1]
        key = (tuple(items), bool(fresh), softcap, q.dtype, d, str(q.device))
        plan = self._PLANS.get(key)
        if plan is not None:
            return plan
        # items without a mask may join a causal launch (a diagonal past their last key) where the two variants
        # differ in nothing a row's bits depend on
        opts = dict(varlen=True, accumulate=True, softcap=softcap or 0.0)
        mix = _fwd.same_kernel_math(q.dtype, d, dict(causal=False, **opts), dict(causal=True, **opts))
        bands = self._bands(items)
        if bands is None:
            return None

        def variant(item):
            causal, window_left, _ = bands[item]
            return (causal or mix, window_left)

        clears, launches = forward_launches(items, fresh, variant)
        out = []
        for launch in launches:
            causal, window_left = launch.variant
            rows = []
            for item in self._longest_first(launch.items):
                rows += self._row(item, bands[item], 0)
            table = torch.tensor(rows, dtype=torch.int32, device=q.device)
            out.append((table, max(i.q_len for i in launch.items), causal, window_left, launch.write))
        if len(self._PLANS) > 256:
            self._PLANS.clear()
        plan = self._PLANS[key] = (clears, tuple(out))
        return plan

    def forward(self, problem, q, k, v, out=None, lse=None, accumulate=False, sinks=None):
        # TMA needs 16-byte aligned strides and a contiguous head dim: copy odd layouts once
        q, k, v = (t if self._kernel_ready(t, 8) else t.contiguous() for t in (q, k, v))
        if out is None:
            out = torch.empty(problem.out_shape(), dtype=q.dtype, device=q.device)
        if lse is None:
            lse = torch.empty(problem.lse_shape(), dtype=torch.float32, device=q.device)
        out_k = out if self._kernel_ready(out, 16 // out.element_size()) else out.contiguous()
        lse_k = lse if lse.stride(-1) == 1 else lse.contiguous()
        causal, window_left, q_off, k_off = self._band_and_offsets(problem)
        _fwd.forward(
            q, k, v, out_k, lse_k,
            softmax_scale=problem.softmax_scale, causal=causal, window_left=window_left, q_offset=q_off,
            k_offset=k_off, softcap=problem.softcap,
            **self._cu_seqlens(problem),
            max_seqlen_q=problem.seqlen_q if problem.varlen else None,
            max_seqlen_k=problem.seqlen_k if problem.varlen else None,
            accumulate=accumulate,
            sinks=None if sinks is None else sinks.detach().to(device=q.device, dtype=torch.float32).contiguous(),
        )
        if out_k is not out:
            out.copy_(out_k)
        if lse_k is not lse:
            lse.copy_(lse_k)
        return out, lse

    @staticmethod
    def _band_and_offsets(problem):
        """(causal, window_left, q_offset, k_offset) for the kernels: offsets per segment only where they differ
        and a mask needs them; query offsets shifted onto the kernels' diagonal (kernel_band).  The kernels read
        per-segment offsets as int32 and use only their difference, so each segment passes its diagonal (and a key
        offset of 0): positions beyond int32 whose diagonal fits (band_diagonal_fits) are taken as they are."""
        causal, window_left, shift = kernel_band(problem.mask)
        if causal and not problem.uniform_offsets:
            diagonals = tuple(qo + shift - ko for qo, ko in zip(problem.q_offsets, problem.k_offsets))
            return causal, window_left, diagonals, (0,) * len(diagonals)
        return causal, window_left, problem.q_offsets[0] + shift, problem.k_offsets[0]

    def shared_rows(self, dout, q, out, lse, *, softmax_scale, deterministic, dlse=None):
        """The query side of many backward launches on row ranges of these queries (backward.SharedRows), or None
        where it cannot be shared (a dense batch above 1, odd layouts): then every launch keeps its own.  ``dlse``:
        the lse's gradient, in its preprocess's row sums."""
        from . import backward as _bwd

        if dlse is not None and not self.worklist_dlse:
            return None
        if q.dim() != 4 or q.shape[0] != 1 or not all(
                self._kernel_ready(t, 16 // t.element_size()) for t in (dout, q, out)):
            return None
        return _bwd.SharedRows(dout, q, out, lse, softmax_scale=softmax_scale, deterministic=deterministic,
                               dlse=None if dlse is None else dlse.to(torch.float32))

    def backward(self, problem, dout, q, k, v, out, lse, deterministic, dq=None, dk=None, dv=None,
                 accumulate=False, rows=None, q_start=0, dq_scale=None, dlse=None):
        """rows / q_start: these queries are rows [q_start, ...) of a shared_rows(): dQ goes into its scratch (dq
        is then not touched), dK and dV are added into dk and dv. dq_scale: dq is int64 fixed point. dlse: the
        lse's gradient (api.attention_backward)."""
        from . import backward as _bwd

        dout, q, k, v, out = (t if self._kernel_ready(t, 16 // t.element_size()) else t.contiguous()
                              for t in (dout, q, k, v, out))
        lse = lse if lse.stride(-1) == 1 else lse.contiguous()
        given = (dq, dk, dv)
        work = []
        for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if buf is None and name == "dq" and rows is not None:
                work.append(None)  # dQ goes into the shared rows' scratch
            elif buf is None and accumulate:
                work.append(None)  # not asked for: the kernel variant skips it (api.backward_problem)
            elif buf is None:
                work.append(torch.empty(like.shape, dtype=like.dtype, device=like.device))
            elif self._kernel_ready(buf, 16 // buf.element_size()):
                work.append(buf)
            else:  # odd caller layout: work in a compact copy (holding the running sum when accumulating)
                work.append(buf.contiguous())
        causal, window_left, q_off, k_off = self._band_and_offsets(problem)
        _bwd.backward(
            dout, q, k, v, out, lse, *work,
            softmax_scale=problem.softmax_scale, causal=causal, window_left=window_left, q_offset=q_off,
            k_offset=k_off, softcap=problem.softcap,
            **self._cu_seqlens(problem),
            max_seqlen_q=problem.seqlen_q if problem.varlen else None,
            max_seqlen_k=problem.seqlen_k if problem.varlen else None,
            deterministic=deterministic, accumulate=accumulate, rows=rows, q_start=q_start, dq_scale=dq_scale,
            dlse=None if dlse is None else dlse.to(torch.float32),
        )
        for buf, w in zip(given, work):
            if buf is not None and w is not buf:
                buf.copy_(w)
        return tuple(b if b is not None else w for b, w in zip(given, work))


_REGISTERED = False


def register() -> None:
    """Registers backend "cute" with fa4dist.kernels (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from ..registry import register_backend

    register_backend(CuteSm90Backend())
    _REGISTERED = True



