"""Pure-PyTorch reference attention: any device, any float dtype, the oracle of every test.

Accumulates in fp32 (fp64 for fp64 inputs) and walks the score matrix in (query chunk x key chunk) tiles with an
online softmax, so a 32k-token sequence on the CPU never materializes the whole score matrix.  GQA is computed by
viewing the query heads as (kv_heads, group) — K and V are never expanded.  Tiles that the mask (causal, sliding
window) hides entirely are never loaded: each query tile visits only the key tiles of its visible key range; tiles
it shows entirely skip the mask.  ``softcap`` caps the scaled scores (``softcap * tanh(s / softcap)``) before the
softmax; sinks are not the backend's business (the contract merges them, see :mod:`fa4dist.kernels.merge`).

Non-finite values follow the contract: a masked (query, key) pair contributes exactly nothing, whatever the key,
value, query or output gradient holds there (padding garbage, NaN, inf), so a row's results depend only on what it
can see.  A row that sees no key gets out = 0 and lse = -inf; a row that sees keys but whose softmax is undefined
(non-finite scores: NaN, +inf, or -inf for every key it sees in the call) gets lse = NaN, never -inf.  A -inf score
beside a finite one weighs nothing, so that NaN depends on how a row's keys are split over calls (README, Range).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import fixed_point
from .mask import Mask, Visibility, block_visibility, visible, visible_rect
from .problem import AttentionProblem, accum_dtype

# Tiles are (128 queries x 1024 keys), the same for every call: a query row's result then sums the same key tiles,
# and a key's gradient the same query tiles, whatever else is in the call (how many heads, which other rows) --
# what the cp_invariant numerics (fa4dist.kernels.invariant) rely on.  A tile holds batch x heads x 128 x 1024
# scores, so a 32k-token sequence on the CPU never materializes its whole score matrix.
_KEY_CHUNK = 1024
_QUERY_CHUNK = 128
_TERM_ELEMENTS = 1 << 22  # the largest term tensor of _contract's non-finite tokens (elements)


def _finite_absmax(t: torch.Tensor, dims) -> torch.Tensor:
    """max |t| over ``dims`` of its finite entries (0 where none, and for an empty t), in t's dtype."""
    finite = torch.where(torch.isfinite(t), t.abs(), torch.zeros((), dtype=t.dtype, device=t.device))
    if t.numel():
        return finite.amax(dim=dims)
    return finite.sum(dim=dims)  # (the zeros of the kept dims: amax refuses an empty reduction)


def _pv_weight(v: torch.Tensor, acc: torch.dtype, mask: Mask, q_len: int, q_offset: int, k_offset: int) -> torch.Tensor:
    """The factor (batch, heads_kv, 1, q_len, 1) that each row's P @ V weights enter with.  P @ V adds up to seqlen_k
    values times weights of at most 1, so values near the top of the accumulation dtype's range overflow that sum
    (bfloat16 values of 3e38: out = inf) although out, a convex combination of them, does not.  A row whose visible
    keys hold finite values that can overflow it (2^E > max |v|, times
    2 seqlen_k) takes 2^-n, n above log2(seqlen_k), and its row sum is scaled alike before the division; every other
    row takes 1: a fixed small factor would push the products of small values below the normal range (values of
    1e-36 gave out = 0), as a factor taken from keys a row never sees did (a value of 3e38 after a causal row).
    Exact (the same bits) wherever the weighted products stay normal.  A row's factor depends on the keys it sees
    alone (:func:`fixed_point.visible_key_bounds`)."""
    from .worklist import WorkItem  # (worklist imports the backends: not at module level)

    batch, seqlen_k, heads_kv, _ = v.shape
    rows = WorkItem(0, q_len, 0, seqlen_k, q_offset, k_offset, mask.causal, mask.window)
    (bound,), _ = fixed_point.visible_key_bounds((v,), [rows], q_len)  # (batch, q_len, heads_kv)
    # twice the bound (the partial sums' rounding stays in range too), inf where the product itself overflows
    overflows = bound.to(acc) * (2 * seqlen_k) >= torch.finfo(acc).max
    weight = torch.where(overflows, 2.0 ** -(seqlen_k.bit_length() + 1), 1.0).to(acc)
    return weight.permute(0, 2, 1)[:, :, None, :, None]


def _chunks(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    return max(1, min(seqlen_q, _QUERY_CHUNK)), max(1, min(seqlen_k, _KEY_CHUNK))


def _tile_mask(q_len, k_len, q_pos0, k_pos0, mask: Mask, device):
    vis = block_visibility(q_len, k_len, q_pos0, k_pos0, mask)
    if vis is not Visibility.PARTIAL:
        return vis, None
    q_pos = torch.arange(q_pos0, q_pos0 + q_len, device=device)
    k_pos = torch.arange(k_pos0, k_pos0 + k_len, device=device)
    return vis, visible(q_pos, k_pos, mask)


def _key_tiles(q_len: int, seqlen_k: int, q_pos0: int, k_offset: int, mask: Mask, k_chunk: int):
    """Starts of the key tiles (on the fixed grid of k_chunk) that hold a key visible to these queries."""
    rect = visible_rect(q_len, seqlen_k, q_pos0, k_offset, mask)
    if rect is None:
        return range(0)
    return range(rect.k_start // k_chunk * k_chunk, rect.k_start + rect.k_len, k_chunk)


def _capped(scores: torch.Tensor, softcap) -> torch.Tensor:
    """softcap * tanh(scores / softcap) (scores already scaled), or the scores themselves."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


# The two contractions of attention, masked pairs contributing exactly nothing.  A weight of 0 times a non-finite
# value is NaN in a plain product, so non-finite values are contracted separately, only over visible pairs.
_ROWS_FROM_KEYS = "bhgqk,bkhd->bhgqd"  # P @ V, dS @ K: values indexed by key
_KEYS_FROM_ROWS = "bhgqk,bqhgd->bkhd"  # P^T @ dO, dS^T @ Q: values indexed by query (and head of the group)


def _contract(equation: str, weights: torch.Tensor, values: torch.Tensor, keep) -> torch.Tensor:
    """einsum(equation, weights, values) where the pairs that ``keep`` (broadcastable to weights, None: all)
    hides contribute exactly zero even where ``values`` is not finite."""
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return torch.einsum(equation, weights, values)
    result = torch.einsum(equation, weights, torch.where(finite, values, torch.zeros((), dtype=values.dtype)))
    if keep is not None:
        keep = keep.expand(weights.shape)
    by_key = equation == _ROWS_FROM_KEYS
    # tokens (keys, or queries) whose value vector holds a non-finite entry somewhere, a block of them at a time
    # (each term is +0 where hidden or finite and non-finite where seen, so the blocks' sums give the one-by-one
    # sums' values; one token at a time made NaN padding 10-20x slower)
    bad = (~finite).flatten(2).any(-1).any(0).nonzero().flatten()
    zero = torch.zeros((), dtype=values.dtype)
    per_token = weights[..., 0].numel() * values.shape[-1] if by_key else weights[:, :, :, 0].numel() * values.shape[-1]
    block = max(1, _TERM_ELEMENTS // max(1, per_token))
    for tokens in bad.split(block):
        only_bad = torch.where(finite[:, tokens], zero, values[:, tokens])
        if by_key:  # weights[..., t] (b,h,g,q,t) times only_bad (b,t,h,d) -> (b,h,g,q,t,d), summed over t
            term = weights[..., tokens].unsqueeze(-1) * only_bad.permute(0, 2, 1, 3)[:, :, None, None]
            if keep is not None:
                term = torch.where(keep[..., tokens].unsqueeze(-1), term, zero)
            result += term.sum(-2)
        else:  # weights[..., t, :] (b,h,g,t,k) times only_bad (b,t,h,g,d) -> (b,k,h,d), summed over g and t
            term = weights[:, :, :, tokens, :].unsqueeze(-1) * only_bad.permute(0, 2, 3, 1, 4).unsqueeze(-2)
            if keep is not None:
                term = torch.where(keep[:, :, :, tokens, :].unsqueeze(-1), term, zero)
            result += term.sum((2, 3)).permute(0, 2, 1, 3)
    return result


class _Einsum:
    """The reference's usual arithmetic: tile contractions as BLAS matrix products."""

    chunks = staticmethod(_chunks)

    @staticmethod
    def scores(qc, kc):  # (b, q, h, g, d) x (b, k, h, d) -> (b, h, g, q, k)
        return torch.einsum("bqhgd,bkhd->bhgqk", qc, kc)

    @staticmethod
    def rows_from_keys(weights, values, keep):
        return _contract(_ROWS_FROM_KEYS, weights, values, keep)

    @staticmethod
    def keys_from_rows(weights, values, keep):
        return _contract(_KEYS_FROM_ROWS, weights, values, keep)


class _ShapeIndependent:
    """cp_invariant arithmetic: every contraction an elementwise product summed over one contiguous last axis of
    fixed length, so an output element's rounding depends on nothing but its own operands (BLAS picks kernels, and
    with them summation orders, by matrix shape: a row computed in a 1-row call can differ from the same row in a
    128-row call; so can a multi-axis torch reduction).  Smaller tiles bound the products' memory; masked pairs are
    selected away before the sum, so non-finite values there cannot leak."""

    @staticmethod
    def chunks(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        # keys in the canonical tiles of the fixed-point dq: a tile's contribution is one sum over its keys
        return max(1, min(seqlen_q, 32)), max(1, min(seqlen_k, fixed_point.KEY_TILE))

    @staticmethod
    def _sum_last(product: torch.Tensor, keep, order) -> torch.Tensor:
        """product (b,h,g,q,k,d), masked pairs zeroed, permuted so that the summed axes come last (contiguous)."""
        if keep is not None:
            product = torch.where(keep.unsqueeze(-1), product, torch.zeros((), dtype=product.dtype))
        return product.permute(*order).contiguous().sum(-1)

    @staticmethod
    def scores(qc, kc):  # (b, q, h, g, d) x (b, k, h, d) -> (b, h, g, q, k)
        product = qc.permute(0, 2, 3, 1, 4).unsqueeze(-2) * kc.permute(0, 2, 1, 3)[:, :, None, None]
        # the product takes its operands' layout: inputs whose head_dim is not their innermost axis (a transposed
        # view) would put the summed axis off the contiguous end, and torch sums a strided axis in another order
        return (product if product.stride(-1) == 1 else product.contiguous()).sum(-1)

    @classmethod
    def rows_from_keys(cls, weights, values, keep):  # (b,h,g,q,k) x (b,k,h,d) -> (b,h,g,q,d), summed over k
        product = weights.unsqueeze(-1) * values.permute(0, 2, 1, 3)[:, :, None, None]
        return cls._sum_last(product, keep, (0, 1, 2, 3, 5, 4))

    @classmethod
    def keys_from_rows(cls, weights, values, keep):  # (b,h,g,q,k) x (b,q,h,g,d) -> (b,k,h,d), summed over (g, q)
        product = weights.unsqueeze(-1) * values.permute(0, 2, 3, 1, 4).unsqueeze(-2)
        if keep is not None:
            product = torch.where(keep.unsqueeze(-1), product, torch.zeros((), dtype=product.dtype))
        return product.permute(0, 4, 1, 5, 2, 3).contiguous().flatten(-2).sum(-1)


def _forward_dense(p: AttentionProblem, q, k, v, q_offset: int, k_offset: int):
    """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D[v]) -> out (B, Sq, Hq, Dv), lse (B, Hq, Sq), in the accumulation dtype;
    mask, scale and softcap from the problem, offsets of this sequence given."""
    acc = accum_dtype(q.dtype)
    scale, ops = p.softmax_scale, _ops(p)
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group = heads_q // heads_kv
    out = torch.zeros(batch, seqlen_q, heads_kv, group, head_dim_v, dtype=acc, device=q.device)
    lse = torch.full((batch, heads_kv, group, seqlen_q), float("-inf"), dtype=acc, device=q.device)
    q_chunk, k_chunk = ops.chunks(seqlen_q, seqlen_k)
    pv_weight = _pv_weight(v, acc, p.mask, seqlen_q, q_offset, k_offset)
    for qs in range(0, seqlen_q, q_chunk):
        ql = min(q_chunk, seqlen_q - qs)
        qc = q[:, qs : qs + ql].to(acc).view(batch, ql, heads_kv, group, -1)
        row_max = torch.full((batch, heads_kv, group, ql), float("-inf"), dtype=acc, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc_out = torch.zeros(batch, heads_kv, group, ql, head_dim_v, dtype=acc, device=q.device)
        sees_a_key = torch.zeros(ql, dtype=torch.bool, device=q.device)  # from the mask alone, not the values
        row_weight = pv_weight[:, :, :, qs : qs + ql]
        for ks in _key_tiles(ql, seqlen_k, q_offset + qs, k_offset, p.mask, k_chunk):
            kl = min(k_chunk, seqlen_k - ks)
            vis, mask = _tile_mask(ql, kl, q_offset + qs, k_offset + ks, p.mask, q.device)
            if vis is Visibility.NONE:
                continue
            sees_a_key |= True if mask is None else mask.any(-1)
            kc, vc = k[:, ks : ks + kl].to(acc), v[:, ks : ks + kl].to(acc)
            # the products scaled, not q: q * scale can overflow where every score is finite (16-bit inputs,
            # a large scale), and the backward recomputes the same scores this way
            scores = _capped(ops.scores(qc, kc).mul_(scale), p.softcap)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            new_max = torch.maximum(row_max, scores.amax(-1))
            shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
            probs = torch.exp(scores - shift.unsqueeze(-1))
            rescale = torch.exp(row_max - shift)
            row_sum = row_sum * rescale + probs.sum(-1)
            acc_out = acc_out * rescale.unsqueeze(-1) + ops.rows_from_keys(probs * row_weight, vc, mask)
            row_max = new_max
        # Rows that see keys: lse from the running max and sum, NaN where the softmax is undefined (a sum of 0 from
        # -inf scores, or NaN); -inf only for rows that see no key at all.
        defined = row_sum > 0
        shift = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        nan = torch.full_like(row_sum, float("nan"))
        # the log and the division take 1 where their result is not used (a keyless row, an undefined one): a
        # 0 there would give NaN derivatives through the unused branch of torch.where (create_graph=True)
        safe_sum = torch.where(defined, row_sum, torch.ones_like(row_sum))
        row_lse = torch.where(defined, shift + torch.log(safe_sum), nan)
        lse[..., qs : qs + ql] = torch.where(sees_a_key, row_lse, torch.full_like(row_sum, -torch.inf))
        # (keyless rows: 0 / weight, then 0 below)
        denominator = torch.where(defined | ~sees_a_key, safe_sum * row_weight.squeeze(-1), nan)
        normalized = acc_out / denominator.unsqueeze(-1)
        normalized = torch.where(sees_a_key.unsqueeze(-1), normalized, torch.zeros((), dtype=acc))
        out[:, qs : qs + ql] = normalized.permute(0, 3, 1, 2, 4)
    return out.view(batch, seqlen_q, heads_q, head_dim_v), lse.view(batch, heads_q, seqlen_q)


def _rescaled_dprobs_minus_delta(ops, doc, vc, out_c, acc, dlse_c=None):
    """(u (dP - delta), 1 / u): dS = P * (dout . v - rowsum(dout * out)) where both dot products can overflow
    although their difference need not (1e37 x 64 terms), and dS, and its sums over keys and queries, can overflow
    too where the gradients (times the scores' scale) do not.  The unit u = sigma tau is a power of two per
    key/value head (b, h_kv): tau from this tile's values and the chunk's out, sigma from the chunk's output
    gradients, which it brings below 1; the dot products are computed with each row of dout scaled to below 1
    (sigma_q), then brought to the unit (sigma / sigma_q).  The bits of the unscaled form times u wherever the
    scaled products stay normal.  1 / u comes as two factors (1 / tau, 1 / sigma), each a normal number, to be
    applied one after the other.  ``dlse_c`` (b, q, h, g): the lse's gradient, taken from delta (in the same unit;
    sigma_q and sigma bring |dlse| tau below 1 too: small values and outputs make tau large)."""
    row_max = _finite_absmax(doc, -1).to(acc)  # (b, q, h, g)
    tau = fixed_point.power_of_two_below(torch.maximum(_finite_absmax(vc, (1, 3)).to(acc),
                                            _finite_absmax(out_c, (1, 3, 4)).to(acc)))  # (b, h)
    if dlse_c is not None:  # it enters delta times sigma_q tau: the row's factor brings |dlse| tau below 1 too
        finite = torch.where(torch.isfinite(dlse_c), dlse_c.abs(), torch.zeros((), dtype=acc, device=doc.device))
        row_max = torch.maximum(row_max, (finite * tau[:, None, :, None]).clamp(max=torch.finfo(acc).max))
    sigma = fixed_point.power_of_two_below(row_max.amax(dim=(1, 3)))  # (b, h)
    sigma_row = fixed_point.power_of_two_below(row_max).unsqueeze(-1)  # (b, q, h, g, 1)
    doc = doc * sigma_row
    delta = (doc * (out_c * tau[:, None, :, None, None])).sum(-1)  # sigma_q tau delta (b, q, h, g)
    if dlse_c is not None:
        delta = delta - dlse_c * sigma_row.squeeze(-1) * tau[:, None, :, None]
    to_unit = (sigma[:, None, :, None, None] / sigma_row).squeeze(-1)  # sigma / sigma_q <= 1
    to_unit, delta = (t.permute(0, 2, 3, 1).unsqueeze(-1) for t in (to_unit, delta))  # (b, h, g, q, 1)
    return (ops.scores(doc, vc * tau[:, None, :, None]) - delta) * to_unit, (1 / tau, 1 / sigma)


def _score_grads(p, ops, probs, dprobs_minus_delta, scores, keep, qc, kc, from_unit=()):
    """(dq, dk) of one tile, (b, q, h, g, d) and (b, k, h, d), from dS = P * (dP - delta) (masked pairs: nothing),
    ``dprobs_minus_delta`` given in a unit whose inverse is the factors ``from_unit`` ((b, h_kv) each)."""
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    dscores = torch.where(keep, probs * dprobs_minus_delta, zero)
    if p.softcap is not None:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2 (masked pairs stay 0)
        dscores = torch.where(keep, dscores * (1 - (scores / p.softcap) ** 2), zero)
    dq_tile = ops.rows_from_keys(dscores, kc, keep).permute(0, 3, 1, 2, 4) * p.softmax_scale
    dk_tile = ops.keys_from_rows(dscores, qc, keep) * p.softmax_scale
    for factor in from_unit:  # one after the other: each is a normal number, their product need not be
        dq_tile, dk_tile = dq_tile * factor[:, None, :, None, None], dk_tile * factor[:, None, :, None]
    return dq_tile, dk_tile


def _backward_dense(p: AttentionProblem, dout, q, k, v, out, lse, q_offset: int, k_offset: int, dq_scale=None,
                    dlse=None):
    """Gradients of one dense block given the *global* out and lse: returns dq, dk, dv in the accumulation dtype
    (dq in int64 fixed point with ``dq_scale``, (b, h, s): one term per key tile, fa4dist.kernels.fixed_point).
    ``dlse`` (lse's layout): the lse's gradient, which joins delta (d lse / d s = P: dS = P (dP - (delta - dlse)))."""
    acc = accum_dtype(q.dtype)
    scale, ops = p.softmax_scale, _ops(p)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    dq = torch.zeros(batch, seqlen_q, heads_kv, group, head_dim, dtype=acc if dq_scale is None else torch.int64,
                     device=q.device)
    dk = torch.zeros(batch, seqlen_k, heads_kv, head_dim, dtype=acc, device=q.device)
    dv = torch.zeros(batch, seqlen_k, heads_kv, v.shape[-1], dtype=acc, device=q.device)
    # delta_i = sum_d dout_i * out_i (rowsum of dP * P), from the global output.
    delta = (dout.to(acc) * out.to(acc)).sum(-1).view(batch, seqlen_q, heads_kv, group).permute(0, 2, 3, 1)
    if dlse is not None:
        dlse = dlse.to(acc).view(batch, heads_kv, group, seqlen_q)
        delta = delta - dlse
    lse = lse.to(acc).view(batch, heads_kv, group, seqlen_q)
    q_chunk, k_chunk = ops.chunks(seqlen_q, seqlen_k)
    for qs in range(0, seqlen_q, q_chunk):
        ql = min(q_chunk, seqlen_q - qs)
        qc = q[:, qs : qs + ql].to(acc).view(batch, ql, heads_kv, group, -1)
        doc = dout[:, qs : qs + ql].to(acc).view(batch, ql, heads_kv, group, -1)
        out_c = out[:, qs : qs + ql].to(acc).view(batch, ql, heads_kv, group, -1)
        lse_c = lse[..., qs : qs + ql]
        # lse = -inf: the row saw no key and has no gradient; a NaN lse (undefined softmax) propagates.
        lse_seen = ~torch.isneginf(lse_c).unsqueeze(-1)
        lse_shift = torch.where(torch.isneginf(lse_c), torch.zeros_like(lse_c), lse_c).unsqueeze(-1)
        delta_c = delta[..., qs : qs + ql].unsqueeze(-1)
        zero = torch.zeros((), dtype=acc, device=q.device)
        if dq_scale is not None:  # (b, h, ql) -> (b, ql, h_kv, group, 1), as dq's rows
            row_scale = dq_scale[..., qs : qs + ql].reshape(batch, heads_kv, group, ql).permute(0, 3, 1, 2)[..., None]
        for ks in _key_tiles(ql, seqlen_k, q_offset + qs, k_offset, p.mask, k_chunk):
            kl = min(k_chunk, seqlen_k - ks)
            vis, mask = _tile_mask(ql, kl, q_offset + qs, k_offset + ks, p.mask, q.device)
            if vis is Visibility.NONE:
                continue
            kc, vc = k[:, ks : ks + kl].to(acc), v[:, ks : ks + kl].to(acc)
            scores = _capped(ops.scores(qc, kc) * scale, p.softcap)
            keep = lse_seen if mask is None else (lse_seen & mask)
            probs = torch.where(keep, torch.exp(scores - lse_shift), zero)
            dv[:, ks : ks + kl] += ops.keys_from_rows(probs, doc, keep)
            dq_tile, dk_tile = _score_grads(p, ops, probs, ops.scores(doc, vc) - delta_c, scores, keep, qc, kc)
            # Overflow (values near the top of the range) gives inf or NaN, never a finite number: the rows and keys
            # it reached (through pairs they see, or their sums) take the rescaled form, the others keep their bits.
            # (Rows that see a NaN or inf are non-finite in both forms.)
            if not (bool(torch.isfinite(dq_tile).all()) and bool(torch.isfinite(dk_tile).all())):
                dlse_c = None if dlse is None else dlse[..., qs : qs + ql].permute(0, 3, 1, 2)
                rescaled, from_unit = _rescaled_dprobs_minus_delta(ops, doc, vc, out_c, acc, dlse_c)
                dq_re, dk_re = _score_grads(p, ops, probs, rescaled, scores, keep, qc, kc, from_unit)
                dq_tile = torch.where(torch.isfinite(dq_tile), dq_tile, dq_re)
                dk_tile = torch.where(torch.isfinite(dk_tile), dk_tile, dk_re)
            if dq_scale is None:
                dq[:, qs : qs + ql] += dq_tile
            else:
                dq[:, qs : qs + ql] += fixed_point.to_fixed(dq_tile, row_scale)
            dk[:, ks : ks + kl] += dk_tile
    return dq.view(batch, seqlen_q, heads_q, head_dim), dk, dv


def _per_sequence(problem: AttentionProblem, tensors):
    """Yields (segment info, tensors sliced to one sequence with a batch dim of 1), for non-uniform problems."""
    for b, q_start, q_len, k_start, k_len, q_off, k_off in problem.segments():
        sliced = []
        for t, side in tensors:
            if problem.varlen:
                start, length = (q_start, q_len) if side == "q" else (k_start, k_len)
                sliced.append(t[start : start + length].unsqueeze(0))
            else:
                sliced.append(t[b : b + 1])
        yield (b, q_start, q_len, k_start, k_len, q_off, k_off), sliced


def _ops(problem: AttentionProblem):
    return _ShapeIndependent if problem.cp_invariant else _Einsum


def no_autocast(device: torch.device):
    """A context with autocast off on ``device``: the reference computes in the inputs' accumulation dtype (fp32 /
    fp64), and an ambient ``torch.autocast`` would otherwise run its matrix products (einsum -> bmm, and their
    derivatives) in bf16 / fp16 under an fp32 result."""
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def _without_autocast(fn):
    """``fn(problem, ...)`` run under :func:`no_autocast` of the problem's device."""

    @functools.wraps(fn)
    def wrapper(problem: AttentionProblem, *args, **kwargs):
        with no_autocast(problem.device):
            return fn(problem, *args, **kwargs)

    return wrapper


@_without_autocast
def forward(problem: AttentionProblem, q, k, v):
    """Returns (out, lse) in the accumulation dtype with the contract's shapes."""
    p = problem
    if not p.varlen and p.uniform_offsets and p.batch > 0:  # (an empty batch has no offset: the loop's empties)
        return _forward_dense(p, q, k, v, p.q_offsets[0], p.k_offsets[0])
    acc = accum_dtype(q.dtype)
    out = torch.zeros(p.out_shape(), dtype=acc, device=q.device)
    lse = torch.full(p.lse_shape(), float("-inf"), dtype=acc, device=q.device)
    for (b, qs, ql, _, _, qo, ko), (qb, kb, vb) in _per_sequence(p, [(q, "q"), (k, "k"), (v, "k")]):
        ob, lb = _forward_dense(p, qb, kb, vb, qo, ko)
        if p.varlen:
            out[qs : qs + ql] = ob[0]
            lse[:, qs : qs + ql] = lb[0]
        else:
            out[b], lse[b] = ob[0], lb[0]
    return out, lse


@_without_autocast
def backward(problem: AttentionProblem, dout, q, k, v, out, lse, dq_scale=None, dlse=None):
    """Returns (dq, dk, dv) in the accumulation dtype for the block, given the global out and lse; with
    ``dq_scale`` (lse's layout) dq is int64 fixed point (fa4dist.kernels.fixed_point; cp_invariant problems);
    ``dlse`` (lse's layout): the lse's gradient, added."""
    p = problem
    if dq_scale is not None and not p.cp_invariant:
        raise ValueError("the fixed-point dq (dq_scale=) is computed on the canonical key tiles of cp_invariant=True")
    if not p.varlen and p.uniform_offsets and p.batch > 0:
        return _backward_dense(p, dout, q, k, v, out, lse, p.q_offsets[0], p.k_offsets[0], dq_scale, dlse)
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc if dq_scale is None else torch.int64, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    lse_t = lse.transpose(0, 1) if p.varlen else lse  # packed lse is (heads, total): slice along tokens
    tensors = [(dout, "q"), (q, "q"), (k, "k"), (v, "k"), (out, "q"), (lse_t, "q")]
    row_vectors = {name: t for name, t in (("dq_scale", dq_scale), ("dlse", dlse)) if t is not None}
    tensors += [(t.transpose(0, 1) if p.varlen else t, "q") for t in row_vectors.values()]
    for (b, qs, ql, ks, kl, qo, ko), (dob, qb, kb, vb, ob, lb, *rows_b) in _per_sequence(p, tensors):
        if p.varlen:  # (1, ql, heads) -> (1, heads, ql)
            lb, rows_b = lb.transpose(1, 2), [t.transpose(1, 2) for t in rows_b]
        dqb, dkb, dvb = _backward_dense(p, dob, qb, kb, vb, ob, lb, qo, ko, **dict(zip(row_vectors, rows_b)))
        if p.varlen:
            dq[qs : qs + ql], dk[ks : ks + kl], dv[ks : ks + kl] = dqb[0], dkb[0], dvb[0]
        else:
            dq[b], dk[b], dv[b] = dqb[0], dkb[0], dvb[0]
    return dq, dk, dv


class ReferenceBackend:
    """Registry entry for the reference: supports every problem on every device (every mask, softcap; sinks are
    merged by the contract); always deterministic."""

    name = "reference"
    priority = 0
    fused_epilogue = False
    cp_invariant = True  # row- and key-independent arithmetic on request (problem.cp_invariant)
    fixed_point_dq = True  # dq in int64 fixed point on request (dq_scale=; fa4dist.kernels.fixed_point)
    lse_gradient = True  # the lse's gradient joins the backward (dlse=)

    def available(self, device) -> bool:
        return True

    def supports(self, problem: AttentionProblem, direction: str):
        return None

    def forward(self, problem, q, k, v):
        return forward(problem, q, k, v)

    def backward(self, problem, dout, q, k, v, out, lse, deterministic, dq_scale=None, dlse=None):
        return backward(problem, dout, q, k, v, out, lse, dq_scale, dlse)
