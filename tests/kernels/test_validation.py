"""Bad input gets a clear error that names the argument."""


import pytest
import torch

import fa4dist
from fa4dist.kernels import attention_backward, attention_forward


def qkv(b=1, s=8, h=2, d=16, hkv=None, dtype=torch.float32):
    hkv = hkv or h
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, hkv, d, dtype=dtype),
            torch.randn(b, s, hkv, d, dtype=dtype))


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        attention_forward(q, k.numpy(), v)


def test_not_a_tensor_is_named_by_fa4dist_attention():
    """Its torch.func check ran first and raised torch's "is_functorch_wrapped_tensor(): incompatible function
    arguments" for a list, naming no argument."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        fa4dist.attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match=r"sinks must be a torch.Tensor of shape \(2,\) or None, got list"):
        fa4dist.attention(q, k, v, sinks=[0.0, 0.0])


def test_mismatched_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="share a dtype"):
        attention_forward(q, k.double(), v)


def test_integer_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q must be float16, bfloat16, float32 or float64"):
        attention_forward(q.long(), k, v)


def test_mismatched_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        attention_forward(q, k.to("meta"), v)


def test_meta_tensors_are_refused_by_name():
    q, k, v = (t.to("meta") for t in qkv())
    with pytest.raises(ValueError, match="meta device"):
        attention_forward(q, k, v)


@pytest.mark.parametrize("layout", ["sparse", "nested", "jagged"])
def test_tensors_without_a_strided_layout_are_refused_by_name(layout):
    """A sparse or nested tensor has no strided memory for the kernels to read: refused naming the argument (it
    failed deep inside, in the reference's slicing or a data_ptr() of the memory checks, naming nothing)."""
    q, k, v = qkv()
    if layout == "sparse":
        bad = {"q": q.to_sparse(), "sinks": torch.zeros(2).to_sparse()}
    else:
        nested = torch.nested.nested_tensor([q[0], q[0, :3]], layout=torch.jagged if layout == "jagged" else None)
        bad = {"q": nested}
    for name, t in bad.items():
        args = {**dict(q=q, k=k, v=v, sinks=None), name: t}
        with pytest.raises(TypeError, match=f"{name} must be a dense .strided. tensor"):
            attention_forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    out, lse = attention_forward(q, k, v)
    with pytest.raises(TypeError, match="dout must be a dense .strided. tensor"):
        attention_backward(out.to_sparse(), q, k, v, out, lse)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a dense .strided. tensor"):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        attention_forward(q[0], k[0], v[0], cu_seqlens_q=cu.to_sparse(), cu_seqlens_k=cu)


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, seqlen, heads, head_dim\)"):
        attention_forward(q[0], k, v)


def test_heads_do_not_divide():
    q, k, v = qkv(h=3, hkv=2)
    with pytest.raises(ValueError,
                       match=r"query heads \(3\) must be a multiple of the number of key/value heads \(2\)"):
        attention_forward(q, k, v)


def test_head_dim_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="share the head dim"):
        attention_forward(q, k[..., :8], v)


def test_kv_mismatch_and_batch_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k and v must agree"):
        attention_forward(q, k, v[:, :4])
    with pytest.raises(ValueError, match="batch size"):
        attention_forward(q, torch.cat([k, k]), torch.cat([v, v]))


def test_backend_head_dim_out_of_range():
    q, k, v = qkv(d=12)
    with pytest.raises(ValueError, match="sdpa_flash.*CUDA|not available"):
        attention_forward(q, k, v, backend="sdpa_flash")


def test_unknown_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        attention_forward(q, k, v, backend="nope")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0])
def test_non_finite_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        attention_forward(q, k, v, softmax_scale=scale)


def _packed(cu_q, cu_k=None, total=10):
    q = torch.randn(total, 2, 8)
    return q, q.clone(), q.clone(), cu_q, cu_q if cu_k is None else cu_k


def test_cu_seqlens_wrong_dtype():
    q, k, v, cq, ck = _packed(torch.tensor([0, 4, 10], dtype=torch.int64))
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        attention_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)


def test_cu_seqlens_not_monotone():
    q, k, v, cq, ck = _packed(torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        attention_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)


def test_cu_seqlens_disagree_with_token_count():
    q, k, v, cq, ck = _packed(torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 9 disagrees with the token count 10"):
        attention_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)


def test_cu_seqlens_only_one_side_or_different_lengths():
    q, k, v, cq, _ = _packed(torch.tensor([0, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="given together"):
        attention_forward(q, k, v, cu_seqlens_q=cq)
    with pytest.raises(ValueError, match="same length"):
        attention_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=torch.tensor([0, 10], dtype=torch.int32))


def test_cu_seqlens_made_under_inference_mode():
    """A tensor made under torch.inference_mode has no version counter: packed calls (and packed work lists, whose
    cu_seqlens are made inside the call) must still run, re-reading such cu_seqlens every time (an in-place change
    is seen, a bad one refused)."""
    from fa4dist.kernels.worklist import WorkItem, attention_forward_items

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        out, _ = attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        want, _ = attention_forward(q, q, q, cu_seqlens_q=cu.clone(), cu_seqlens_k=cu.clone(), causal=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        cu[1] = 6
        moved, _ = attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        want, _ = attention_forward(q, q, q, cu_seqlens_q=cu.clone(), cu_seqlens_k=cu.clone(), causal=True)
        torch.testing.assert_close(moved, want, rtol=0, atol=0)
        assert not torch.equal(moved[4:6], out[4:6])
        cu[1] = 11
        with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
            attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
        run_out, run_lse = torch.zeros(10, 2, 8, dtype=torch.float64), torch.full((2, 10), -torch.inf,
                                                                                   dtype=torch.float64)
        attention_forward_items(q, q, q, [WorkItem(0, 10, 0, 10, causal=True)], run_out, run_lse)
    torch.testing.assert_close(run_out, attention_forward(q[None], q[None], q[None], causal=True)[0][0])


def test_cpu_cu_seqlens_changed_where_torch_does_not_count_it_are_read_again():
    """A CPU cu_seqlens buffer refilled in place without a version bump (through the NumPy array it shares memory
    with, .data, or a collective such as dist.broadcast / scatter into it) gave the old documents (the host copy
    was remembered per tensor and version): silently wrong attention whenever the token count stayed the same.
    A CPU tensor's remembered values are now compared with it (no device sync), in validate_inputs and in
    int32_cu_seqlens alike."""
    import numpy as np

    from fa4dist.kernels import problem

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    buffer = np.array([0, 4, 10], dtype=np.int32)
    for cu, refill in ((torch.from_numpy(buffer), lambda: buffer.__setitem__(1, 7)),
                       (torch.tensor([0, 4, 10], dtype=torch.int32), None)):
        refill = refill or (lambda: cu.data.__setitem__(1, 7))
        first, _ = attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        version = cu._version
        refill()
        assert cu._version == version, "the refill must be one torch does not count, or this proves nothing"
        got, _ = attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        want, _ = attention_forward(q, q, q, cu_seqlens_q=cu.clone(), cu_seqlens_k=cu.clone(), causal=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got[4:7], first[4:7])
    source = np.array([0, 4, 10], dtype=np.int64)
    src = torch.from_numpy(source)
    assert problem.int32_cu_seqlens("cu", src)[1] == (0, 4, 10)
    source[1] = 7
    cu, values = problem.int32_cu_seqlens("cu", src)
    assert values == (0, 7, 10) and cu.tolist() == [0, 7, 10]


def test_int32_cu_seqlens_are_remembered_per_source_tensor_and_version(monkeypatch):
    """int32_cu_seqlens of one tensor: one int32 tensor and one read, which validate_inputs' check of that int32
    tensor shares; a change in place of the source or of the int32 copy, or a tensor made under inference mode, is
    read again; the entry goes with its source."""
    import gc

    from fa4dist.kernels import problem

    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(t):
        reads.append(t.dtype)
        return tolist(t)

    src = torch.tensor([0, 4, 10])
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    cu, values = problem.int32_cu_seqlens("cu", src)
    again, _ = problem.int32_cu_seqlens("cu", src)
    assert again is cu and cu.dtype == torch.int32 and values == (0, 4, 10) and reads == [torch.int64]
    q = torch.randn(10, 2, 8)
    attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert reads == [torch.int64]
    src[1] = 6
    moved, values = problem.int32_cu_seqlens("cu", src)
    assert moved is not cu and values == (0, 6, 10) and len(reads) == 2
    moved[1] = 4  # the int32 copy changed: not given out again
    fresh, values = problem.int32_cu_seqlens("cu", src)
    assert fresh is not moved and values == (0, 6, 10) and len(reads) == 3
    assert torch.equal(fresh, torch.tensor([0, 6, 10], dtype=torch.int32))
    with torch.inference_mode():
        frozen = torch.tensor([0, 4, 10])
        problem.int32_cu_seqlens("cu", frozen)
        problem.int32_cu_seqlens("cu", frozen)
    assert len(reads) == 5
    entries = [key for key, entry in problem._INT32_CACHE.items() if entry[0]() is src]
    assert entries
    del src, moved, fresh
    gc.collect()
    assert not set(entries) & set(problem._INT32_CACHE)


def test_offsets_wrong_count():
    q, k, v = qkv(b=2)
    with pytest.raises(ValueError, match="q_offset must have one entry per sequence/segment"):
        attention_forward(q, k, v, causal=True, q_offset=[0, 1, 2])


def test_numpy_integer_windows_and_offsets_are_taken_as_ints():
    """A NumPy integer window side or offset (one for all, or one per sequence) was refused with a TypeError while
    the other integer arguments (check_int) take them: now each is the Python int's, bit for bit."""
    np = pytest.importorskip("numpy")
    import fa4dist

    q, k, v = qkv(b=2, dtype=torch.float64)
    dout = torch.randn_like(q)
    as_ints = dict(causal=True, window=(3, 0), q_offset=5, k_offset=[2, 0])
    as_numpy = dict(causal=True, window=(np.int64(3), np.int32(0)), q_offset=np.int64(5),
                    k_offset=[np.int16(2), np.uint8(0)])
    want = attention_forward(q, k, v, **as_ints)
    got = attention_forward(q, k, v, **as_numpy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(attention_backward(dout, q, k, v, *want, **as_numpy),
                    attention_backward(dout, q, k, v, *want, **as_ints)):
        assert torch.equal(a, b)
    assert torch.equal(fa4dist.attention(q, k, v, **as_numpy), want[0])
    # an integer array as a tensor of offsets is (as make_plan takes cu_seqlens arrays)
    arrays = dict(as_ints, k_offset=np.array([2, 0], dtype=np.int32))
    assert all(torch.equal(a, b) for a, b in zip(attention_forward(q, k, v, **arrays), want))
    # still refused: NumPy's bool (not an integer), a float, an array of floats
    with pytest.raises(TypeError, match=r"window left must be an int >= -1 .*got np.True_"):
        attention_forward(q, k, v, window=(np.bool_(True), 0))
    with pytest.raises(TypeError, match=r"k_offset must be an int or a sequence / tensor / NumPy array of ints, got "
                                        r"numpy.float64$"):
        attention_forward(q, k, v, causal=True, k_offset=np.float64(3))
    with pytest.raises(TypeError, match=r"q_offset must hold integers, got NumPy dtype float64$"):
        attention_forward(q, k, v, causal=True, q_offset=np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"q_offset must be a plain integer array, got a NumPy masked array"):
        attention_forward(q, k, v, causal=True, q_offset=np.ma.masked_array([1, 2], mask=[0, 1]))
    with pytest.raises(TypeError, match=r"q_offset must hold ints, got \[np.True_, 0\]"):
        attention_forward(q, k, v, causal=True, q_offset=[np.bool_(True), 0])


def test_accumulate_needs_fp32_buffers():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="accumulate=True needs the running out and lse"):
        attention_forward(q, k, v, accumulate=True)
    out = torch.zeros(q.shape, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        attention_forward(q, k, v, out=out, lse=lse, accumulate=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 8\)"):
        attention_forward(q, k, v, out=out.float(), lse=lse[..., :4], accumulate=True)


def test_backward_buffers():
    q, k, v = qkv()
    out, lse = attention_forward(q, k, v)
    with pytest.raises(ValueError, match="dout must have shape"):
        attention_backward(out[:, :4], q, k, v, out, lse)
    with pytest.raises(ValueError, match="accumulate=True needs fp32 buffers to add into"):
        attention_backward(out, q, k, v, out, lse, accumulate=True)
    with pytest.raises(ValueError, match="give dk and dv both, or neither"):
        attention_backward(out, q, k, v, out, lse, accumulate=True, dq=torch.zeros(q.shape), dk=torch.zeros(k.shape))


def test_backward_skips_the_gradients_without_a_buffer():
    """accumulate=True with dq only, or dk and dv only: the others are not computed (None), the given ones are
    the same bytes as when all three are asked for."""
    q, k, v = qkv()
    dout = torch.randn_like(q)
    out, lse = attention_forward(q, k, v, causal=True)
    full = [torch.zeros(t.shape) for t in (q, k, v)]
    attention_backward(dout, q, k, v, out, lse, causal=True, dq=full[0], dk=full[1], dv=full[2], accumulate=True)
    dq = torch.zeros(q.shape)
    got = attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, accumulate=True)
    assert got[1] is None and got[2] is None and torch.equal(dq, full[0])
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    got = attention_backward(dout, q, k, v, out, lse, causal=True, dk=dk, dv=dv, accumulate=True)
    assert got[0] is None and torch.equal(dk, full[1]) and torch.equal(dv, full[2])
    with pytest.raises(ValueError, match="needs lse"):
        attention_backward(out, q, k, v, out, None)


def test_cu_seqlens_and_offsets_on_meta_or_of_the_wrong_rank_name_the_argument():
    """A meta cu_seqlens or offset tensor holds no values to read, and a 2-D offset tensor is not one entry per
    segment: each is refused naming the argument (not "Cannot copy out of meta tensor", not flattened)."""
    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, name: cu.to("meta")}
        with pytest.raises(ValueError, match=f"{name} is on the meta device"):
            attention_forward(q, q, q, **kw)
    for name in ("q_offset", "k_offset"):
        with pytest.raises(ValueError, match=rf"{name} must be 0-D or 1-D .*got shape \(2, 1\)"):
            attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, **{name: torch.tensor([[0], [3]])})
        with pytest.raises(ValueError, match=f"{name} is on the meta device"):
            attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, **{name: torch.tensor([0, 3]).to("meta")})
    out, _ = attention_forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=torch.tensor([0, 3]))
    assert out.shape == q.shape


@pytest.mark.parametrize("offset", [2**63, -(2**63) - 1, 2**62, [0, 2**64]])
def test_offsets_out_of_range_name_the_argument(offset):
    q = torch.randn(2 if isinstance(offset, list) else 1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"q_offset must be a token position in \[-2\*\*62, 2\*\*62\)"):
        attention_forward(q, q, q, causal=True, q_offset=offset)
    with pytest.raises(ValueError, match="k_offset must be a token position"):
        attention_backward(q, q, q, q, q, torch.zeros(q.shape[0], 2, 4), causal=True, k_offset=offset)


def test_buffer_dtype_message_names_each_dtype_once():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match=r"lse must have dtype torch.float32, got torch.float16$"):
        attention_forward(q, q, q, lse=torch.zeros(1, 2, 4, dtype=torch.float16))


def test_merge_partials_shape_errors_are_named():
    from fa4dist.kernels import merge_into_, merge_partials

    out, lse = torch.randn(2, 8, 4, 16), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"partial 1: lse must have shape \(2, 4, 4\) for out of shape"):
        merge_partials([out, out[:, :4]], [lse, lse])
    with pytest.raises(ValueError, match=r"partial 1: out has shape \(2, 8, 4, 8\) but the other partial results"):
        merge_partials([out, out[..., :8]], [lse, lse])
    with pytest.raises(ValueError, match="merge_partials: out must be a tensor of shape"):
        merge_partials([out], [lse], out=torch.zeros(3))
    with pytest.raises(ValueError, match=r"the block: lse must have shape \(2, 4, 8\)"):
        merge_into_(out.clone(), lse.clone(), out, lse.transpose(1, 2))


def test_merge_partials_out_must_be_the_merge_dtype_and_device():
    """out= receives the fp32 (fp64 for fp64 partials) merge: an out of another dtype or device is refused by name
    instead of being rounded into (or written to) silently."""
    from fa4dist.kernels import merge_partials

    f32, f64 = torch.float32, torch.float64
    for dtype, want in ((torch.float16, f32), (torch.bfloat16, f32), (f64, f64)):
        out, lse = torch.randn(2, 8, 4, 16, dtype=dtype), torch.randn(2, 4, 8)
        for wrong in (torch.float16, f32 if want == f64 else f64):
            with pytest.raises(TypeError, match=f"merge_partials: out must have dtype {want}, got {wrong}"):
                merge_partials([out, out], [lse, lse], out=torch.empty(2, 8, 4, 16, dtype=wrong))
        with pytest.raises(ValueError, match="merge_partials: out must be on cpu, got meta"):
            merge_partials([out, out], [lse, lse], out=torch.empty(2, 8, 4, 16, dtype=want, device="meta"))
        given = torch.empty(2, 8, 4, 16, dtype=want)
        merged, _ = merge_partials([out, out], [lse, lse], out=given)
        assert merged is given and torch.equal(given, out.to(want))


def test_sink_grad_checks_dout():
    """A dout that merely broadcasts against out (one row, one head) is refused by name, not summed silently."""
    from fa4dist.kernels import sink_grad

    out, lse, sinks = torch.randn(2, 8, 4, 16), torch.randn(2, 4, 8), torch.zeros(4)
    for shape in ((2, 1, 4, 16), (2, 8, 1, 16), (16,), (2, 8, 4, 16, 1)):
        with pytest.raises(ValueError, match=r"sink_grad: dout must have shape \(2, 8, 4, 16\), got"):
            sink_grad(torch.randn(shape), out, lse, sinks)
    with pytest.raises(TypeError, match="sink_grad: dout must be a torch.Tensor, got float"):
        sink_grad(1.0, out, lse, sinks)
    with pytest.raises(ValueError, match="sink_grad: dout must be on cpu, got meta"):
        sink_grad(torch.empty(out.shape, device="meta"), out, lse, sinks)
    assert sink_grad(torch.ones_like(out, dtype=torch.bfloat16), out, lse, sinks).shape == (4,)


def test_sink_grad_checks_dlse():
    """The lse's gradient (dlse=) is checked as dout is: one that broadcasts against lse (a column, one value) was
    taken silently, an integer one too, and a float was an AttributeError naming nothing."""
    from fa4dist.kernels import sink_grad

    out, lse, sinks = torch.randn(2, 8, 4, 16), torch.randn(2, 4, 8), torch.zeros(4)
    dout = torch.randn(out.shape)
    for shape in ((4, 1), (1,), (1, 4, 8), (2, 8, 4)):
        with pytest.raises(ValueError, match=r"sink_grad: dlse must have shape \(2, 4, 8\), got"):
            sink_grad(dout, out, lse, sinks, torch.ones(shape))
    with pytest.raises(TypeError, match="sink_grad: dlse must have dtype"):
        sink_grad(dout, out, lse, sinks, torch.ones(lse.shape, dtype=torch.int32))
    with pytest.raises(TypeError, match="sink_grad: dlse must be a torch.Tensor, got float"):
        sink_grad(dout, out, lse, sinks, 1.0)
    with pytest.raises(ValueError, match="sink_grad: dlse must be on cpu, got meta"):
        sink_grad(dout, out, lse, sinks, torch.empty(lse.shape, device="meta"))
    dlse = torch.randn(lse.shape)  # (a row's term loses exp(sink - lse) dlse)
    want = sink_grad(dout, out, lse, sinks) + (torch.exp(sinks[:, None] - lse) * dlse).sum(dim=(0, 2))
    torch.testing.assert_close(sink_grad(dout, out, lse, sinks, dlse), want)


def test_merge_sink_checks_the_running_result_and_the_sinks():
    """merge_sink_ merges into a running fp32 result in place, as merge_into_: a 16-bit (out, lse) is refused (it
    rounded the merged lse to fp16), and so are sinks that are not one float logit per head (integer and bool
    tensors were read as logits, a list failed deep inside)."""
    from fa4dist.kernels import merge_sink_, sink_grad

    out, lse = torch.randn(2, 8, 4, 16), torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match="the running out/lse must both be float32 .or float64., got torch.float16"):
        merge_sink_(out.half(), lse.half(), torch.zeros(4))
    with pytest.raises(TypeError, match="the running out/lse must both be float32 .or float64., got torch.float32 "
                                        "and torch.float64"):
        merge_sink_(out.clone(), lse.double(), torch.zeros(4))
    for sinks, err, match in ((torch.zeros(4, dtype=torch.int64), TypeError, "sinks must be float16, bfloat16"),
                              (torch.zeros(4, dtype=torch.bool), TypeError, "sinks must be float16, bfloat16"),
                              ([0.0] * 4, TypeError, r"sinks must be a torch.Tensor of shape \(4,\)"),
                              (torch.zeros(3), ValueError, r"sinks must have shape \(4,\): one logit per query head"),
                              (torch.zeros(4, device="meta"), ValueError, "sinks must be on the inputs' device cpu")):
        running = out.clone(), lse.clone()
        with pytest.raises(err, match=match):
            merge_sink_(*running, sinks)
        assert torch.equal(running[0], out) and torch.equal(running[1], lse)  # refused before any write
        with pytest.raises(err, match=match):
            sink_grad(torch.ones_like(out), out, lse, sinks)
    merge_sink_(out, lse, torch.zeros(4, dtype=torch.bfloat16))  # any float dtype of logits
    assert lse.dtype == torch.float32


def test_deterministic_flag_must_be_a_bool():
    """A truthy stand-in ("yes", 1) for deterministic is refused where it is given, not read as some mode: by
    fa4dist.attention (whose backward runs later) and by attention_backward."""
    import fa4dist
    from fa4dist.kernels import attention_backward, attention_forward

    q = torch.randn(1, 4, 2, 8)
    for value in ("yes", 1):
        with pytest.raises(TypeError, match=f"deterministic must be a bool or None, got {type(value).__name__}"):
            fa4dist.attention(q, q, q, deterministic=value)
    out, lse = attention_forward(q, q, q, backend="reference")
    with pytest.raises(TypeError, match="deterministic must be a bool or None, got str"):
        attention_backward(out, q, q, q, out, lse, backend="reference", deterministic="no")


def test_cp_invariant_option_errors(monkeypatch):
    import fa4dist

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="cp_invariant must be a bool or None, got str"):
        fa4dist.attention(q, q, q, cp_invariant="yes")
    monkeypatch.setenv("FA4DIST_CP_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="FA4DIST_CP_INVARIANT must be 1 .* or 0 .*, got 'maybe'"):
        fa4dist.attention(q, q, q)
    monkeypatch.setenv("FA4DIST_CP_INVARIANT", "1")
    out = fa4dist.attention(q, q, q, causal=True, sinks=torch.zeros(2))  # the environment variable turns it on
    monkeypatch.setenv("FA4DIST_CP_INVARIANT", "0")
    assert torch.allclose(out, fa4dist.attention(q, q, q, causal=True, sinks=torch.zeros(2)), atol=1e-6)


def test_cp_invariant_environment_spellings(monkeypatch):
    """FA4DIST_CP_INVARIANT: every spelling the parser takes is named in the error for one it does not (the
    message said '0 or 1' while true/yes/false/no and the empty string were taken too)."""
    from fa4dist.kernels import invariant

    for value, on in (("1", True), (" TRUE ", True), ("yes", True), ("0", False), ("false", False), ("no", False),
                      ("", False)):
        monkeypatch.setenv(invariant.ENV, value)
        assert invariant.enabled(None) is on, value
    for bad in ("2", "on", "01", "y"):
        monkeypatch.setenv(invariant.ENV, bad)
        with pytest.raises(ValueError) as err:
            invariant.enabled(None)
        assert all(word in str(err.value) for word in ("true", "yes", "false", "no", "empty", repr(bad))), err.value


def test_contract_and_work_list_flags_refuse_truthy_stand_ins():
    """cp_invariant="False" would turn the mode on, fresh="no" would overwrite the running result: both are
    refused by name, as the contract's other flags are."""
    from fa4dist.kernels import WorkItem, attention_forward_items

    q, k, v = qkv()
    with pytest.raises(TypeError, match="cp_invariant must be a bool, got str"):
        attention_forward(q, k, v, cp_invariant="False")
    out, lse = torch.zeros(q.shape), torch.full((1, 2, 8), float("-inf"))
    with pytest.raises(TypeError, match="fresh must be a bool, got str"):
        attention_forward_items(q, k, v, [WorkItem(0, 8, 0, 8)], out, lse, fresh="no")


def test_sinks_gradients_of_no_query_rows_are_zeros():
    """Sinks with no query row (a dense call of 0 queries, or packed documents that are all empty): zero gradients,
    and a given dsinks buffer written with zeros (accumulate=False), also for an empty batch."""
    import fa4dist

    s = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    q = torch.randn(1, 0, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    fa4dist.attention(q, k, k, sinks=s).sum().backward()
    assert torch.equal(s.grad, torch.zeros(2, dtype=torch.float64)) and q.grad.shape == q.shape
    s.grad = None
    qp, kp = torch.randn(0, 2, 4, dtype=torch.float64), torch.randn(3, 2, 4, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)
    fa4dist.attention(qp, kp, kp, sinks=s, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k).sum().backward()
    assert torch.equal(s.grad, torch.zeros(2, dtype=torch.float64))
    q0 = torch.randn(0, 3, 2, 4)
    out, lse = attention_forward(q0, q0, q0, sinks=torch.zeros(2))
    dsinks = attention_backward(torch.zeros_like(out), q0, q0, q0, out, lse, sinks=torch.zeros(2),
                                dsinks=torch.full((2,), 7.0))[3]
    assert torch.equal(dsinks, torch.zeros(2))


@pytest.mark.parametrize("flag", ["accumulate", "return_lse"])
def test_flags_refuse_truthy_stand_ins(flag):
    """accumulate="False" would merge: a bool is required, as for causal and deterministic."""
    import fa4dist

    q, k, v = qkv()
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        if flag == "accumulate":
            attention_forward(q, k, v, out=torch.zeros(q.shape), lse=torch.zeros(1, 2, 8), accumulate="False")
        else:
            fa4dist.attention(q, k, v, return_lse="False")
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        attention_backward(q, q, k, v, q, torch.zeros(1, 2, 8), accumulate=1)


@pytest.mark.parametrize("cp_invariant", [False, True])
def test_an_empty_batch_gives_empty_results(cp_invariant):
    """batch = 0: empty out, lse and gradients (and a zero sink gradient), through every entry point."""
    import fa4dist

    q, k, v = qkv(b=0)
    out, lse = attention_forward(q, k, v, causal=True)
    assert out.shape == q.shape and lse.shape == (0, 2, 8)
    assert all(g.shape == t.shape for g, t in zip(attention_backward(q, q, k, v, out, lse), (q, k, v)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fa4dist.attention(*leaves, causal=True, cp_invariant=cp_invariant).sum().backward()
    assert all(t.grad.shape == t.shape for t in leaves)
    if not cp_invariant:
        sinks = torch.zeros(2, requires_grad=True)
        fa4dist.attention(q, k, v, sinks=sinks).sum().backward()
        assert torch.equal(sinks.grad, torch.zeros(2))


def test_work_lists_check_the_whole_buffers():
    """The work-list entry points name the caller's buffers and their whole shapes, before any item's view."""
    from fa4dist.kernels import WorkItem, attention_backward_items, attention_forward_items

    q = k = v = torch.randn(20, 4, 8)
    item = [WorkItem(0, 10, 0, 10)]
    with pytest.raises(ValueError, match="needs out"):
        attention_forward_items(q, k, v, item, None, None)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 20\)"):
        attention_forward_items(q, k, v, item, torch.zeros(20, 4, 8), torch.zeros(20, 4))
    with pytest.raises(ValueError, match=r"out must have shape \(20, 4, 8\)"):
        attention_forward_items(q, k, v, item, torch.zeros(25, 4, 8), torch.zeros(4, 25), fresh=True)
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        attention_forward_items(q, k, v, item, torch.zeros(20, 4, 8, dtype=torch.float64), torch.zeros(4, 20))
    out, lse = torch.zeros(20, 4, 8), torch.zeros(4, 20)
    with pytest.raises(ValueError, match=r"dq must have shape \(20, 4, 8\)"):
        attention_backward_items(q, q, k, v, out, lse, item, torch.zeros(20, 4, 7), None, None)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 20\)"):
        attention_backward_items(q, q, k, v, out, lse[:, :10], item, torch.zeros(20, 4, 8), None, None)


def test_fused_kernels_read_cu_seqlens_contiguous_on_the_inputs_device():
    """A strided (or other-device) cu_seqlens is handed to fused kernels as a contiguous copy on q's device, with
    the values the checks read."""
    from fa4dist.kernels.problem import validate_inputs

    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 99, 4, 99, 10, 99], dtype=torch.int32)[::2]
    problem = validate_inputs(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for t in problem.device_cu_seqlens():
        assert t.is_contiguous() and t.device == q.device and t.dtype == torch.int32
        assert t.tolist() == [0, 4, 10] == list(problem.cu_seqlens_q)


def test_merges_in_place_refuse_a_block_or_running_result_sharing_memory():
    """merge_into_ scales the running out in place before it reads the block: a block that is (a view of) the
    running result was read after it had been scaled, and the merge was silently wrong (merging a result into
    itself gave out * 0.5 + out * 0.25 instead of out).  Such calls, an out over its own lse, and a running out
    with a stride of 0, are refused by name before anything is written; a running out with gaps still merges."""
    from fa4dist.kernels import merge_into_, merge_sink_

    out, lse = torch.randn(2, 8, 4, 16, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    for block_out, block_lse, name in ((out, lse.clone(), "block_out"), (out.clone(), lse, "block_lse"),
                                       (out[:, :, :, :1].expand(out.shape), lse.clone(), "block_out")):
        running = out.clone(), lse.clone()
        with pytest.raises(ValueError, match=f"{'out' if name == 'block_out' else 'lse'} shares memory with {name}"):
            merge_into_(out, lse, block_out, block_lse)
        assert torch.equal(out, running[0]) and torch.equal(lse, running[1])  # refused before any write
    flat = torch.randn(2 * 8 * 4 * 16 + 2 * 4 * 8, dtype=torch.float64)
    over = flat[: out.numel()].view(out.shape), flat[out.numel() - 64 :][: lse.numel()].view(lse.shape)
    for merge in (lambda: merge_into_(*over, out, lse), lambda: merge_sink_(*over, torch.zeros(4))):
        with pytest.raises(ValueError, match="lse shares memory with out"):
            merge()
    with pytest.raises(ValueError, match="out is written by the call, but some of its elements share memory"):
        merge_into_(torch.zeros(1, dtype=torch.float64).expand(out.shape), lse.clone(), out, lse)
    gapped = torch.zeros(2, 8, 4, 32, dtype=torch.float64)[..., ::2]
    gapped.copy_(out)
    running_lse = lse.clone()
    merge_into_(gapped, running_lse, out, lse)  # the same partial twice: out unchanged, lse + log 2
    torch.testing.assert_close(gapped, out, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(running_lse, lse + torch.log(torch.tensor(2.0, dtype=torch.float64)))


def test_merges_name_a_partial_of_another_device_or_a_non_float_dtype():
    """A partial on another device than the others failed deep inside torch ("Tensor on device meta is not on the
    expected device cpu"); an integer or bool out / lse was merged as if it were a result."""
    from fa4dist.kernels import merge_into_, merge_partials

    out, lse = torch.randn(2, 8, 4, 16), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="the block: out is on meta but the other partial results are on cpu"):
        merge_into_(out.clone(), lse.clone(), out.to("meta"), lse.to("meta"))
    with pytest.raises(ValueError, match="partial 1: lse is on meta but its out is on cpu"):
        merge_partials([out, out], [lse, lse.to("meta")])
    with pytest.raises(TypeError, match="partial 0 lse must be float16, bfloat16, float32 or float64, got torch.int64"):
        merge_partials([out, out], [lse.long(), lse])
    with pytest.raises(TypeError, match="the block out must be float16, bfloat16, float32 or float64, got torch.bool"):
        merge_into_(out.clone(), lse.clone(), out > 0, lse)
