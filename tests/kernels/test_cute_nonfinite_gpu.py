"""Masked keys contribute exactly nothing in the Hopper CuTe DSL kernels (forward and backward), on the GPU.

NaN / inf planted in k, v (and q, dout) at positions that the mask hides from some rows of the same tile: a
future key of a causal tile, the first tokens of the next packed document, garbage past a sequence end that is
not a multiple of the tile. Expected, per the contract: a query row's out / lse / dq depend only on the keys it
sees (rows that see a planted value are non-finite, lse NaN, never -inf); a key's dk / dv depend only on the
queries that see it. Clean rows and keys are compared with the fp64 oracle (tests/oracle.py) computed on inputs
where the planted values are replaced by zeros (clean rows never see them), outputs poisoned with NaN first.
"""

import pytest
import torch
from cute_gpu import hang_watchdog, skip_module_without_cute  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
skip_module_without_cute()

from fa4dist.kernels.cute.backward import backward  # noqa: E402
from fa4dist.kernels.cute.forward import forward  # noqa: E402
from oracle import REL_TOL, naive_attention, rel_error  # noqa: E402

NAN, INF = float("nan"), float("inf")
DEVICE = "cuda"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# problem: tokens of each segment, which (query, key) pairs are visible, planted values


class Problem:
    """One attention call. Dense: q (b, s, h, d); packed: q (t, h, d) with cu_seqlens (equal q / k segments)."""

    def __init__(self, *, dense_shape=None, lens=None, heads=(4, 2), d=128, causal=True, dtype=torch.bfloat16,
                 trailing=0, seed=0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        hq, hk = heads
        self.causal, self.dtype, self.d = causal, dtype, d
        if dense_shape is not None:
            b, s = dense_shape
            self.segments = [(i, s) for i in range(b)]  # (batch index, length)
            qshape, kshape = (b, s, hq, d), (b, s, hk, d)
            self.cu = None
        else:
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            self.segments = list(zip(starts[:-1], lens))  # (first token, length)
            total = starts[-1] + trailing  # tokens past the last segment: garbage the kernel must not read
            qshape, kshape = (total, hq, d), (total, hk, d)
            self.cu = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        rnd = lambda shape: torch.randn(shape, device=DEVICE, dtype=torch.float32, generator=g).to(dtype)  # noqa
        self.q, self.k, self.v, self.dout = rnd(qshape), rnd(kshape), rnd(kshape), rnd(qshape)
        self.planted = {name: [] for name in ("q", "k", "v", "dout")}  # token indices (tuples) per tensor

    def token(self, seg, pos):
        """Index tuple of position pos of segment seg."""
        first, _ = self.segments[seg]
        return (seg, pos) if self.cu is None else (first + pos,)

    def plant(self, name, idx, value):
        """Set every head of token idx of tensor name to value in channel 0 (and remember it)."""
        getattr(self, name)[idx + (slice(None), 0)] = value
        self.planted[name].append(idx)

    def clean(self, t, name):
        out = t.clone()
        for idx in self.planted[name]:
            out[idx] = 0
        return out

    def visible(self, seg):
        """(len, len) bool: query i of the segment sees key j."""
        n = self.segments[seg][1]
        ar = torch.arange(n, device=DEVICE)
        return ar[None, :] <= ar[:, None] if self.causal else torch.ones(n, n, dtype=torch.bool, device=DEVICE)

    def rows(self, seg):
        """Index tuples of the tokens of one segment, in order (for gathering per-token flags)."""
        return [self.token(seg, p) for p in range(self.segments[seg][1])]

    def flags(self, seg, name):
        """(len,) bool: the segment's tokens planted in tensor name."""
        bad = torch.zeros(self.segments[seg][1], dtype=torch.bool, device=DEVICE)
        for p, idx in enumerate(self.rows(seg)):
            if idx in self.planted[name]:
                bad[p] = True
        return bad

    def kw(self):
        if self.cu is None:
            return dict(causal=self.causal)
        n = max(length for _, length in self.segments)
        return dict(causal=self.causal, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, max_seqlen_q=n, max_seqlen_k=n)

    def oracle(self, with_grads):
        """fp64 out / lse (and dq, dk, dv) on the cleaned inputs, in the kernels' layouts."""
        q, k, v, dout = (self.clean(getattr(self, n), n).double() for n in ("q", "k", "v", "dout"))
        if with_grads:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        kw = dict(causal=self.causal)
        if self.cu is not None:
            # the oracle takes exactly the segments' tokens: drop any trailing garbage
            end = int(self.cu[-1])
            q, k, v, dout = (t[:end] for t in (q, k, v, dout))
            kw.update(cu_seqlens_q=self.cu, cu_seqlens_k=self.cu)
        out, lse = naive_attention(q, k, v, **kw)
        if not with_grads:
            return out.detach(), lse.detach()
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out.detach(), lse.detach(), dq, dk, dv


def affected(prob: Problem):
    """Per segment, which results must be non-finite: a NaN-propagation model of attention over the visible pairs
    only (masked pairs contribute nothing), for generic values. Planted k values are NaN (a score of exactly -inf
    from an inf key is a legitimate finite case this model does not cover). Returns dicts of bool vectors:
    lse (NaN), out, dq per query row; dk, dv per key."""
    result = []
    for seg in range(len(prob.segments)):
        vis = prob.visible(seg)
        bq, bk, bv, bdo = (prob.flags(seg, n) for n in ("q", "k", "v", "dout"))
        sees = lambda bad: (vis & bad[None, :]).any(1)  # noqa: E731 - per row: sees a flagged key
        lse_nan = bq | sees(bk)  # scores NaN: softmax undefined
        out_bad = lse_nan | sees(bv)
        d_nan = out_bad | bdo  # rowsum(dO * O)
        p_nan = (lse_nan | bq)[:, None] | bk[None, :]  # per visible pair
        dp_nan = bdo[:, None] | bv[None, :]
        ds_nan = vis & (p_nan | dp_nan | d_nan[:, None])
        dq = (ds_nan | (vis & bk[None, :])).any(1)
        dk = (ds_nan | (vis & bq[:, None])).any(0)
        dv = (vis & (p_nan | bdo[:, None])).any(0)
        result.append(dict(lse=lse_nan, out=out_bad, dq=dq, dk=dk, dv=dv))
    return result


def _check_rows(name, got, want, bad_rows, prob, dtype, *, lse=False):
    """got / want in the kernels' layouts; rows of each segment flagged bad must hold a non-finite value (lse: be
    NaN), the others must match the oracle."""
    clean_got, clean_want = [], []
    for seg in range(len(prob.segments)):
        for p, idx in enumerate(prob.rows(seg)):
            if lse:  # lse (b, h, s) | (h, t): token index last
                g = got[(idx[0], slice(None), idx[1])] if prob.cu is None else got[:, idx[0]]
                w = want[(idx[0], slice(None), idx[1])] if prob.cu is None else want[:, idx[0]]
            else:
                g, w = got[idx], want[idx]
            if bad_rows[seg][p]:
                if lse:
                    assert torch.isnan(g).all(), f"{name}: row {idx} lse must be NaN (not -inf), got {g}"
                else:
                    assert not torch.isfinite(g).all(), f"{name}: row {idx} sees a planted value but is finite"
            else:
                clean_got.append(g.reshape(-1))
                clean_want.append(w.reshape(-1))
    if clean_got:
        g, w = torch.cat(clean_got).double(), torch.cat(clean_want).double()
        assert torch.isfinite(g).all(), f"{name}: non-finite values leaked into rows that see no planted value"
        if lse:
            assert (g - w).abs().max().item() < 2e-2, f"{name}: lse of clean rows off by {(g - w).abs().max():.3e}"
        else:
            err = rel_error(g.cpu(), w.cpu())
            assert err < 2 * REL_TOL[dtype], f"{name}: clean rows rel error {err:.2e}"


def run_forward(prob: Problem):
    out = torch.full(prob.q.shape, NAN, dtype=prob.dtype, device=DEVICE)
    lse_shape = (prob.q.shape[1], prob.q.shape[0]) if prob.cu is not None else (
        prob.q.shape[0], prob.q.shape[2], prob.q.shape[1])
    lse = torch.full(lse_shape, NAN, dtype=torch.float32, device=DEVICE)
    forward(prob.q, prob.k, prob.v, out, lse, **prob.kw())
    _sync()
    return out, lse


def check_forward(prob: Problem):
    out, lse = run_forward(prob)
    ref_out, ref_lse = prob.oracle(False)
    aff = affected(prob)
    _check_rows("out", out, ref_out, [a["out"] for a in aff], prob, prob.dtype)
    _check_rows("lse", lse, ref_lse, [a["lse"] for a in aff], prob, prob.dtype, lse=True)


def check_backward(prob: Problem):
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = prob.oracle(True)
    aff = affected(prob)
    # the global out / lse a forward hands over: NaN where the forward gives it (the model's lse / out)
    out = torch.zeros(prob.q.shape, dtype=torch.float64, device=DEVICE)
    lse = torch.zeros((prob.q.shape[0], prob.q.shape[2], prob.q.shape[1]) if prob.cu is None else
                      (prob.q.shape[1], prob.q.shape[0]), dtype=torch.float64, device=DEVICE)
    if prob.cu is None:
        out[:], lse[:] = ref_out, ref_lse
    else:
        end = int(prob.cu[-1])
        out[:end], lse[:, :end] = ref_out, ref_lse
    for seg, a in enumerate(aff):
        for p, idx in enumerate(prob.rows(seg)):
            if a["out"][p]:
                out[idx] = NAN
            if a["lse"][p]:
                if prob.cu is None:
                    lse[idx[0], :, idx[1]] = NAN
                else:
                    lse[:, idx[0]] = NAN
    grads = [torch.full(t.shape, NAN, dtype=prob.dtype, device=DEVICE) for t in (prob.q, prob.k, prob.v)]
    backward(prob.dout, prob.q, prob.k, prob.v, out.to(prob.dtype), lse.float(), *grads, **prob.kw())
    _sync()
    if prob.cu is not None:  # gradients of trailing garbage tokens are not defined: compare the segments only
        end = int(prob.cu[-1])
        grads = [g[:end] for g in grads]
    for i, name in enumerate(("dq", "dk", "dv")):
        _check_rows(name, grads[i], (ref_dq, ref_dk, ref_dv)[i], [a[name] for a in aff], prob, prob.dtype)


# ----------------------------------------------------------------------------------------------------------------
# cases


def dense_causal(d, dtype=torch.bfloat16):
    """Causal, sequence length not a multiple of any tile: a NaN key and an inf / NaN value in the middle of a
    diagonal tile (rows before them in the same tile must stay clean) and at the last position."""
    prob = Problem(dense_shape=(2, 300), heads=(4, 2), d=d, dtype=dtype, seed=d)
    prob.plant("k", (0, 200), NAN)
    prob.plant("v", (1, 150), INF)
    prob.plant("v", (1, 299), NAN)
    prob.plant("v", (0, 257), -INF)
    return prob


def packed_causal(d, dtype=torch.bfloat16):
    """Packed documents sharing tiles: planted values late in document 1 and at the first token of document 2
    are hidden from document 0, from document 1's earlier rows, and from each other's documents."""
    prob = Problem(lens=[130, 77, 200, 5], heads=(4, 4), d=d, dtype=dtype, seed=7 + d)
    prob.plant("k", prob.token(1, 70), NAN)
    prob.plant("v", prob.token(2, 0), INF)
    prob.plant("v", prob.token(2, 150), NAN)
    return prob


def packed_full_trailing(d):
    """Non-causal packed documents and garbage past the last document: the last document's key tile runs into
    the garbage (a sequence end that is not a multiple of the tile); only document 1 sees its planted value."""
    prob = Problem(lens=[100, 140, 33], heads=(2, 1), d=d, causal=False, trailing=40, seed=11)
    end = int(prob.cu[-1])
    for name in ("q", "k", "v", "dout"):
        getattr(prob, name)[end:] = NAN
    prob.plant("v", prob.token(1, 139), NAN)
    return prob


@pytest.mark.parametrize("d", [128, 64])
def test_forward_dense_causal(d):
    check_forward(dense_causal(d))


@pytest.mark.parametrize("d", [128, 64])
def test_backward_dense_causal(d):
    check_backward(dense_causal(d))


def test_fp16_dense_causal():
    check_forward(dense_causal(128, torch.float16))
    check_backward(dense_causal(128, torch.float16))


@pytest.mark.parametrize("d", [128, 64])
def test_forward_packed_causal(d):
    check_forward(packed_causal(d))


@pytest.mark.parametrize("d", [128, 64])
def test_backward_packed_causal(d):
    check_backward(packed_causal(d))


def test_forward_packed_trailing_garbage():
    check_forward(packed_full_trailing(128))


def test_backward_packed_trailing_garbage():
    check_backward(packed_full_trailing(128))


def test_backward_bad_query_and_dout_rows():
    """A NaN q row and an inf dout row: their own dq is NaN, the keys they see get NaN dk / dv, and the keys
    after them (in their tiles, hidden by the causal mask) stay clean."""
    prob = Problem(dense_shape=(2, 260), heads=(4, 2), d=128, seed=3)
    prob.plant("q", (0, 100), NAN)
    prob.plant("dout", (1, 201), INF)
    check_backward(prob)


def test_lse_is_nan_not_neg_inf():
    """+inf in q: the row's softmax is undefined (lse NaN); -inf is reserved for rows that see no key."""
    prob = Problem(dense_shape=(1, 200), heads=(2, 2), d=128, seed=5)
    prob.q[0, 10, :, 0] = INF
    out, lse = run_forward(prob)
    assert torch.isnan(lse[0, :, 10]).all() and not torch.isfinite(out[0, 10]).any()
    others = torch.ones(200, dtype=torch.bool, device=DEVICE)
    others[10] = False
    assert torch.isfinite(lse[0][:, others]).all() and torch.isfinite(out[0][others]).all()


def test_rows_that_see_no_key_keep_neg_inf():
    """Shifted causal block: the first rows see no key (lse -inf, out 0) even with garbage in every key."""
    g = torch.Generator(device=DEVICE).manual_seed(9)
    q, k, v = (torch.randn(1, 256, 2, 128, device=DEVICE, generator=g).to(torch.bfloat16) for _ in range(3))
    k[0, 200:] = NAN  # query i sees keys j <= i - 64 <= 191: never these
    v[0, 200:] = INF
    out = torch.full_like(q, NAN)
    lse = torch.full((1, 2, 256), NAN, device=DEVICE)
    forward(q, k, v, out, lse, causal=True, q_offset=0, k_offset=64)
    _sync()
    assert torch.isneginf(lse[0, :, :64]).all() and (out[0, :64] == 0).all()
    assert torch.isfinite(out[0, 64:]).all() and torch.isfinite(lse[0, :, 64:]).all()
