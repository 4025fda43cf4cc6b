"""fa4dist.kernels.api: the buffers a call writes (out, lse, dq, dk, dv, dsinks) are refused by name when they cannot
hold its results: elements that share memory, or memory shared with what the call reads; and its results carry no
autograd history, whatever the inputs require."""

import math

import pytest
import torch

from fa4dist.kernels import WorkItem, attention_backward, attention_backward_items, attention_forward, \
    attention_forward_items


def _qkv(b=2, s=8, h=2, d=8):
    torch.manual_seed(0)
    return tuple(torch.randn(b, s, h, d) for _ in range(3))


def test_expanded_forward_buffers_are_refused_by_name():
    """An expanded (stride 0) out or lse has one memory cell for several results: a ValueError naming it, not
    torch's in-place error from inside the merge."""
    q, k, v = _qkv()
    out, lse = attention_forward(q, k, v)
    with pytest.raises(ValueError, match="out .*share memory"):
        attention_forward(q, k, v, out=torch.zeros(1, 8, 2, 8).expand(2, 8, 2, 8))
    with pytest.raises(ValueError, match="lse .*share memory"):
        attention_forward(q, k, v, out=out.clone(), lse=lse[:1].clone().expand(2, 2, 8), accumulate=True)
    with pytest.raises(ValueError, match="dq .*share memory"):
        attention_backward(out, q, k, v, out, lse, dq=torch.zeros(1, 8, 2, 8).expand(2, 8, 2, 8))


def test_written_buffers_that_alias_the_inputs_are_refused_by_name():
    """out (or a gradient buffer) over q, k or v's memory would overwrite an operand other rows still read (a fused
    kernel races on it; a work list's later items read the rows earlier items wrote): refused by name."""
    q, k, v = _qkv()
    out, lse = attention_forward(q, k, v)
    with pytest.raises(ValueError, match="out shares memory with v"):
        attention_forward(q, k, v, out=v)
    with pytest.raises(ValueError, match="out shares memory with q"):
        attention_forward(q, k, v, out=q)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="dk shares memory with k"):
        attention_backward(dout, q, k, v, out, lse, dk=k)
    with pytest.raises(ValueError, match="dv shares memory with dk"):
        buf = torch.zeros(2, 8, 2, 8)
        attention_backward(dout, q, k, v, out, lse, dq=torch.zeros_like(q), dk=buf, dv=buf, accumulate=True)


def test_a_work_list_whose_out_aliases_v_is_refused_before_it_writes():
    """The silent wrong answer this guards against: out over v's memory, items run in order, the later items read
    the values the earlier ones overwrote."""
    q, k, v = (t[0] for t in _qkv())
    items = [WorkItem(0, 4, 0, 8), WorkItem(4, 4, 0, 8)]
    v_before = v.clone()
    with pytest.raises(ValueError, match="out shares memory with v"):
        attention_forward_items(q, k, v, items, v, torch.full((2, 8), -math.inf), fresh=True)
    assert torch.equal(v, v_before)
    out, lse = attention_forward(q[None], k[None], v[None])
    with pytest.raises(ValueError, match="dk shares memory with k"):
        attention_backward_items(out[0], q, k, v, out[0], lse[0], items, None, k, torch.zeros_like(v))


def test_interleaved_gradient_views_of_one_buffer_are_accepted():
    """dq, dk, dv as interleaved views of one (batch, seqlen, 3, heads, dim) buffer (flash-attn's qkv-packed form)
    share a storage and a byte range but no element: accepted, and equal to separate buffers."""
    q, k, v = _qkv()
    out, lse = attention_forward(q, k, v, causal=True)
    dout = torch.randn_like(out)
    want = attention_backward(dout, q, k, v, out, lse, causal=True)
    packed = torch.empty(2, 8, 3, 2, 8)
    got = attention_backward(dout, q, k, v, out, lse, causal=True, dq=packed[:, :, 0], dk=packed[:, :, 1],
                             dv=packed[:, :, 2])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # out and lse in one buffer, side by side: no shared element either
    flat = torch.empty(2 * 8 * 2 * 8 + 2 * 2 * 8)
    o, m = flat[:256].view(2, 8, 2, 8), flat[256:].view(2, 2, 8)
    attention_forward(q, k, v, causal=True, out=o, lse=m)
    assert torch.equal(o, out) and torch.equal(m, lse)


def test_an_empty_batch_still_checks_the_backend_name():
    """batch = 0 runs no backend, but a misspelt or unavailable one is still the error it is for any other batch
    (before: an empty result, and the typo surfaced only once a batch held a sequence)."""
    q, k, v = (t[:0] for t in _qkv())
    lse = torch.zeros(0, 2, 8)
    forward, backward = (lambda **kw: attention_forward(q, k, v, **kw),
                         lambda **kw: attention_backward(q, q, k, v, q, lse, **kw))
    for call in (forward, backward):
        with pytest.raises(ValueError, match="backend must be 'auto' or one of .*got 'nope'"):
            call(backend="nope")
        with pytest.raises(TypeError, match="backend must be a string, got int"):
            call(backend=3)
        with pytest.raises(ValueError, match="backend 'sdpa' is not available on device cpu"):
            call(backend="sdpa")
        assert call(backend="reference")[0].shape == (0, 8, 2, 8)


def test_buffers_whose_strides_overlap_their_own_elements_are_refused_by_name():
    """A written buffer whose strides are all non-zero but still map several elements to one address (an
    ``as_strided`` view with a row stride shorter than a row) cannot hold the results either: the call used to
    return it filled with whichever element was written last, silently."""
    q, k, v = _qkv()
    out, lse = attention_forward(q, k, v)
    overlapping_out = torch.zeros(2 * 8 * 2 * 8).as_strided((2, 8, 2, 8), (128, 16, 4, 1))  # heads overlap
    with pytest.raises(ValueError, match="out is written by the call, but some of its elements share memory"):
        attention_forward(q, k, v, out=overlapping_out)
    with pytest.raises(ValueError, match="lse is written by the call, but some of its elements share memory"):
        attention_forward(q, k, v, lse=torch.zeros(64).as_strided((2, 2, 8), (16, 1, 1)))
    with pytest.raises(ValueError, match="dq is written by the call, but some of its elements share memory"):
        attention_backward(out, q, k, v, out, lse, dq=torch.zeros(512).as_strided((2, 8, 2, 8), (128, 8, 8, 1)))
    items = [WorkItem(0, 8, 0, 8)]
    with pytest.raises(ValueError, match="out is written by the call, but some of its elements share memory"):
        attention_forward_items(q[0], k[0], v[0], items, torch.zeros(128).as_strided((8, 2, 8), (8, 4, 1)),
                                torch.full((2, 8), -math.inf))


def test_strided_but_non_overlapping_buffers_are_accepted():
    """Layouts whose elements each have their own address, found exactly also where the strides do not nest
    (shape (3, 2) with strides (2, 3): offsets 0, 3, 2, 5, 4, 7), are written as a compact buffer is."""
    q, k, v = _qkv(b=1, s=2, h=3, d=8)
    want, want_lse = attention_forward(q, k, v, causal=True)
    out = torch.zeros(64).as_strided((1, 2, 3, 8), (0, 3 * 8, 2 * 8, 1))  # (seq, heads) strides (3, 2) x 8
    lse = torch.zeros(8).as_strided((1, 3, 2), (0, 2, 3))  # (heads, seq) strides (2, 3)
    attention_forward(q, k, v, causal=True, out=out, lse=lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _writers(q, k, v):
    """Each entry point that writes caller buffers, as (buffers it writes, call): the last buffer is the one made
    unwritable, so a call that failed there would have written the others first."""
    from fa4dist.kernels import merge_partials
    from fa4dist.kernels.merge import merge_into_

    out, lse = attention_forward(q, k, v)
    dout = torch.randn_like(out)
    items = [WorkItem(0, 8, 0, 8)]
    unseen = (torch.zeros_like(out), torch.full_like(lse, -math.inf))
    grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    return [
        (unseen, lambda o, m: attention_forward(q, k, v, out=o, lse=m, accumulate=True)),
        (unseen, lambda o, m: merge_into_(o, m, out, lse)),
        ((unseen[0][0], unseen[1][0]), lambda o, m: attention_forward_items(q[0], k[0], v[0], items, o, m)),
        (grads, lambda *g: attention_backward(dout, q, k, v, out, lse, dq=g[0], dk=g[1], dv=g[2], accumulate=True)),
        (tuple(g[0] for g in grads),
         lambda *g: attention_backward_items(dout[0], q[0], k[0], v[0], out[0], lse[0], items, *g)),
        ((unseen[0],), lambda o: merge_partials([out], [lse], out=o)),
    ]


@pytest.mark.parametrize("how", ["leaf", "non-leaf", "inference"])
def test_a_buffer_autograd_or_inference_mode_forbids_writing_is_refused_before_any_is_written(how):
    """A buffer that requires grad (under grad mode) or an inference tensor (outside inference mode) cannot be
    written in place: torch raised inside the call ('a leaf Variable that requires grad is being used in an
    in-place operation', naming no argument) after the call had written the buffers before it (an accumulate
    merge left the running out merged and its lse not; a backward added dq and dk but not dv), or, for a non-leaf,
    recorded the reference's in-place writes in its graph where a fused kernel's are invisible. Now refused by
    name, nothing written; under torch.no_grad() / inference mode the same buffers are written."""
    q, k, v = _qkv()
    for buffers, call in _writers(q, k, v):
        buffers = [b.clone() for b in buffers]
        before = [b.clone() for b in buffers]
        if how == "inference":
            with torch.inference_mode():
                last = buffers[-1].clone()
            match = "is an inference tensor"
        else:
            last = buffers[-1].clone().requires_grad_()
            last = last if how == "leaf" else last * 1
            match = "requires grad"
        with pytest.raises(ValueError, match=match):
            call(*buffers[:-1], last)
        for b, w in zip(buffers, before):
            assert torch.equal(b, w)
        with torch.no_grad() if how != "inference" else torch.inference_mode():
            call(*buffers[:-1], last)


def test_inputs_that_require_grad_leave_no_autograd_history_in_the_results():
    """The contract is not differentiable (fa4dist.attention is): a fused kernel's results carry no history, and
    the reference's in-place merges used to record a graph into the caller's plain running buffers when q or the
    sinks (an nn.Parameter) required grad, so the next accumulate call refused those very buffers ('out requires
    grad'), and a plain call returned a graph over the sinks alone.  Now the same plain tensors, the same bits as
    under torch.no_grad()."""
    q, k, v = _qkv()
    sinks = torch.nn.Parameter(torch.randn(q.shape[2]))
    q_grad = q.clone().requires_grad_()
    for kwargs in ({}, {"sinks": sinks}):
        runs = []
        for query in (q_grad, q):
            out, lse = torch.zeros(q.shape), torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf)
            for start in (0, 4):  # two key blocks merged into the running result
                attention_forward(query, k[:, start:start + 4], v[:, start:start + 4], causal=True, k_offset=start,
                                  out=out, lse=lse, accumulate=True, **kwargs if start == 0 else {})
            plain_out, plain_lse = attention_forward(query, k, v, causal=True, **kwargs)
            grads = attention_backward(torch.ones_like(plain_out), query, k, v, plain_out, plain_lse, causal=True,
                                       **kwargs)
            runs.append((out, lse, plain_out, plain_lse, *grads))
        for with_grad, without in zip(*runs):
            assert not with_grad.requires_grad and with_grad.grad_fn is None
            assert torch.equal(with_grad, without)
