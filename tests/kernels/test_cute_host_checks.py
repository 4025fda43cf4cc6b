"""Host-side checks of the cute backend that run without a GPU (meta tensors, a problem placed on "cuda")."""

from dataclasses import replace

import pytest
import torch

from fa4dist.kernels.cute import backend as cute_backend
from fa4dist.kernels.cute import host
from fa4dist.kernels.problem import validate_inputs
from fa4dist.kernels.worklist import WorkItem


def _supports(direction, **kw):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="meta")
    problem = replace(validate_inputs(q, q, q, **kw), device=torch.device("cuda"))
    return cute_backend.CuteSm90Backend().supports(problem, direction)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_supports_takes_no_diagonal_the_launches_refuse(direction):
    """The backward's launch refuses a causal diagonal |q_offset - k_offset| > INT32_MAX // 4 (the forward's
    > INT32_MAX // 2): supports() must decline such calls (auto then picks another backend) instead of taking them
    and failing at launch."""
    limit = host.INT32_MAX // 4
    assert _supports(direction, causal=True, q_offset=limit) is None
    for diag in (limit + 1, 2**30):
        assert _supports(direction, causal=True, q_offset=diag) is not None, diag
        assert _supports(direction, causal=True, k_offset=diag) is not None, diag
    assert _supports(direction, q_offset=2**30 + 5) is None  # no causal diagonal: the offsets do not matter
    item = WorkItem(0, 8, 0, 8, limit + 1, 0, causal=True)
    assert cute_backend.CuteSm90Backend._band(item) is None
    assert cute_backend.CuteSm90Backend._band(replace(item, q_offset=limit)) is not None


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_right_window_edge_past_the_diagonal_range_falls_back_saying_so(direction):
    """The kernels fold a window's right edge into the causal diagonal: an edge past its range (offsets of 0) was
    refused without a fallback, blaming q_offset - k_offset, which the caller never set."""
    limit = host.INT32_MAX // 4
    assert _supports(direction, window=(-1, limit)) is None
    refusal = _supports(direction, window=(-1, limit + 1))
    assert refusal is not None and refusal.fallback and "right edge" in str(refusal), refusal
    refusal = _supports(direction, causal=True, q_offset=limit + 1)  # the offsets themselves: named as such
    assert refusal is not None and "q_offset - k_offset" in str(refusal)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_supports_declines_a_score_scale_beyond_one_float32(direction):
    """The kernels take softmax_scale / softcap (or softmax_scale * log2(e)) as one float32: in range each, the
    ratio can still overflow or underflow it (a kernel would compute inf * 0 = NaN for a zero score). supports()
    declines such calls, naming both, so that "auto" takes another backend and a named "cute" says why."""
    assert _supports(direction, softcap=30.0) is None
    assert _supports(direction, softmax_scale=1e30, softcap=30.0) is None
    for kw in (dict(softmax_scale=1e30, softcap=1e-30), dict(softmax_scale=1e-30, softcap=1e30),
               dict(softmax_scale=3e38)):
        refusal = _supports(direction, **kw)
        assert refusal is not None and "float32" in refusal.reason and "softmax_scale" in refusal.reason, kw


def test_remembered_verdicts_follow_the_problem_and_the_direction():
    """supports() remembers its verdict per (problem, direction): asked in turn about calls that differ in one field
    (a diagonal past the kernels' range, a score scale past float32, a head dim they lack, a dtype), one backend
    instance answers each as a fresh one does. A packed call's verdict is not remembered (its key would hold the
    caller's cu_seqlens tensors)."""
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="meta")
    base = replace(validate_inputs(q, q, q, causal=True), device=torch.device("cuda"))
    far = host.INT32_MAX // 4 + 1
    problems = [base, replace(base, q_offsets=(far,)), replace(base, softmax_scale=3e38),
                replace(base, head_dim=72, head_dim_v=72), replace(base, dtype=torch.float32)]
    be = cute_backend.CuteSm90Backend()
    for _ in range(2):
        for problem in problems:
            for direction in ("forward", "backward"):
                fresh = cute_backend.CuteSm90Backend().supports(problem, direction)
                assert be.supports(replace(problem), direction) == fresh, (problem, direction)
    assert be.supports(base, "backward") is None and be.supports(problems[1], "backward") is not None
    packed_q = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device="meta")
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = replace(validate_inputs(packed_q, packed_q, packed_q, cu_seqlens_q=cu, cu_seqlens_k=cu),
                     device=torch.device("cuda"))
    kept = len(be._verdicts)
    assert be.supports(packed, "forward") is None and len(be._verdicts) == kept  # (no key holding cu's tensor)
    assert be.available(torch.device("cpu")) is False and be.available("cpu") is False
    assert be.available(torch.device("cuda", 0)) is (be.unavailable_reason("cuda:0") is None)
    be.available("cuda")
    assert "cuda" not in be._available_on  # the current device's answer is not remembered: it may change


def test_per_segment_offsets_beyond_int32_reach_the_kernels_as_diagonals():
    """Packed segments at global positions past 2^31 whose diagonals fit: supports() takes them, so the offsets the
    kernels get (int32 tensors, only their difference used) must be built without overflow, with the diagonals
    unchanged."""
    q = torch.zeros(12, 2, 64, dtype=torch.bfloat16, device="meta")
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    base = 3 * 2**31
    q_off, k_off = [base + 10, base + 500], [base, base + 7]
    for kw in (dict(causal=True), dict(window=(5, 2))):
        problem = replace(validate_inputs(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, q_offset=q_off,
                                          k_offset=k_off, **kw), device=torch.device("cuda"))
        assert cute_backend.CuteSm90Backend().supports(problem, "forward") is None
        causal, _, kq, kk = cute_backend.CuteSm90Backend._band_and_offsets(problem)
        assert causal
        shift = cute_backend.kernel_band(problem.mask)[2]
        tq, tk = (host.segment_offsets(x, 2, torch.device("cpu")) for x in (kq, kk))
        assert (tq - tk).tolist() == [qo + shift - ko for qo, ko in zip(q_off, k_off)]


def test_a_cached_backward_plan_does_not_hide_the_scratch_limit_of_more_heads():
    """A work list's backward plan is None where a launch's own dQ scratch would outgrow 32-bit indexing, which
    depends on the number of query heads: a plan cached for the same list with fewer heads must not be reused."""
    from fa4dist.kernels.cute.backward import tile_m_for

    be = cute_backend.CuteSm90Backend()
    items = [WorkItem(0, 256, 0, 256, causal=True)]
    tm = tile_m_for(64)
    tiles = -(-256 // tm)
    many = -(-host.INT32_MAX // (tiles * tm * 64))  # heads whose scratch reaches 2^31 elements
    few = torch.empty(256, 4, 64, dtype=torch.bfloat16, device="meta")
    assert be._backward_plan(few, items, None, True) is not None
    huge = torch.empty(256, many, 64, dtype=torch.bfloat16, device="meta")
    assert be._backward_plan(huge, items, None, True) is None


def test_backward_split_parts_hold_the_minimum_steps_under_gqa():
    """The backward's split plans divide a key tile's query tiles among its parts (bwd_sm90.work_at: part p takes
    query tiles [m_min + p * n // parts, m_min + (p + 1) * n // parts)), each walked by the ``group`` query heads:
    every part must hold at least SPLIT_MIN_PART_BLOCKS steps (group x its query tiles). The plans counted steps as
    if they divided group x query tiles, so a GQA group of 8 over 2 query tiles took 4 parts, two of them empty."""
    from fa4dist.kernels.cute import backward as bwd
    from fa4dist.kernels.cute import split_plans

    tm = bwd.tile_m_for(128)

    def smallest_part(group, n_query_tiles, parts):
        return group * min((p + 1) * n_query_tiles // parts - p * n_query_tiles // parts for p in range(parts))

    split_any = 0
    for group in (1, 2, 4, 8, 16):
        for sq in (64, 128, 192, 256, 1000, 4096):
            for sk in (1024, 4096):
                for diag in (0, sk - sq):
                    for causal in (True, False):
                        cfg = bwd.make_configs(torch.bfloat16, 128, causal=causal, varlen=False, seg_offsets=False,
                                               accumulate=False, deterministic=False, dq_dtype=torch.bfloat16,
                                               dkv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
                                               do_dtype=torch.bfloat16, max_seqlen_k=sk)[1]
                        q_shape, k_shape = (1, sq, group, 128), (1, sk, 1, 128)
                        edge, parts = bwd.dense_split_keys_plan(cfg, q_shape, k_shape, diag if causal else 0)
                        if parts == 1:
                            continue
                        split_any += 1
                        n_tiles = bwd.split_key_tile_count(cfg, k_shape, (edge, parts))
                        # the shortest split key tile: causal the last split one (longest first), else all equal
                        n = n_tiles - 1 if causal else 0
                        q0 = max(n * bwd.TILE_N - (diag if causal else 0), 0)
                        n_query = -(-sq // tm) - q0 // tm
                        assert smallest_part(group, n_query, parts) >= split_plans.SPLIT_MIN_PART_BLOCKS, \
                            (group, sq, sk, diag, causal, edge, parts)
    assert split_any


def test_the_kernels_softcap_check_is_the_contracts():
    """The entry points (forward.forward, backward.backward, called directly by benches and tests) checked softcap
    with a copy of the contract's rule that took True as a cap of 1.0 and failed on a string with float()'s bare
    message; they now run the contract's check (kernels/problem.py) and keep their 0.0-for-off form."""
    assert host.check_softcap(None) == 0.0 and host.check_softcap(30) == 30.0
    for bad in (True, "30"):
        with pytest.raises(TypeError, match="^softcap must be a float > 0 or None"):
            host.check_softcap(bad)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^softcap must be finite and > 0"):
            host.check_softcap(bad)


def test_carve_gives_exact_disjoint_aligned_views_of_one_allocation():
    """host.carve: one view per part with its numel and dtype (None for None), all in one storage, pairwise
    disjoint, each starting on a 16-byte boundary; odd-sized parts are padded, never overlapped."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        parts = []
        for _ in range(int(torch.randint(1, 8, (1,), generator=g))):
            kind = int(torch.randint(0, 4, (1,), generator=g))
            numel = int(torch.randint(1, 300, (1,), generator=g))
            parts.append(None if kind == 3 else (numel, (torch.float32, torch.int32, torch.int64)[kind]))
        views = host.carve(torch.device("cpu"), tuple(parts))
        assert len(views) == len(parts)
        spans = []
        for part, view in zip(parts, views):
            if part is None:
                assert view is None
                continue
            assert (view.numel(), view.dtype, view.dim()) == (part[0], part[1], 1)
            start = view.storage_offset() * view.element_size()
            assert start % 16 == 0
            spans.append((start, start + view.numel() * view.element_size()))
        assert len({v.untyped_storage().data_ptr() for v in views if v is not None}) == min(len(spans), 1)
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    with pytest.raises(ValueError, match="whole 4-byte words"):
        host.carve(torch.device("cpu"), ((3, torch.bfloat16),))


@pytest.mark.parametrize("case", ["dense_causal", "deterministic", "packed", "dkv_only"])
def test_backward_scratch_is_one_carved_allocation_and_each_launch_zeroes_its_counter(monkeypatch, case):
    """launch_steps on CPU tensors with recording stand-ins for the compiled kernels: the preprocess and the main
    kernel get scratch views of one allocation (lse2 / dpsum tile_m words per chunk, the dQ accumulator tile_m x d
    per chunk, a flag per chunk), and every main launch, run again after its tile counter was overwritten, sees it
    zeroed: the counter is carved once per call and zeroed by each launch, as the fresh one it replaced was."""
    from fa4dist.kernels.cute import backward as bwd

    calls = []

    def compiled(cfg):
        def run(*args):
            calls.append((cfg, [a.clone() if isinstance(a, torch.Tensor) else a for a in args], args))
        return run

    monkeypatch.setattr(host, "get_compiled", compiled)
    monkeypatch.setattr(host, "sm_count", lambda *a, **k: 132)
    monkeypatch.setattr(bwd, "_FAST", {})
    d, h, bf = 128, 4, torch.bfloat16
    opts = dict(causal=case != "deterministic", deterministic=case == "deterministic")
    if case == "packed":
        cu = torch.tensor([0, 300, 700], dtype=torch.int32)
        q = torch.randn(700, h, d, dtype=bf)
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=400, max_seqlen_k=400)
        lse = torch.randn(h, 700)
        n_chunks = (700 // bwd.tile_m_for(d) + 2) * h
    else:
        q = torch.randn(2, 1000, h, d, dtype=bf)
        lse = torch.randn(2, h, 1000)
        n_chunks = 2 * -(-1000 // bwd.tile_m_for(d)) * h
    out, dout = torch.randn_like(q), torch.randn_like(q)
    if case == "dkv_only":
        grads = (None, torch.zeros(q.shape), torch.zeros(q.shape))
        opts["accumulate"] = True
    else:
        grads = (torch.empty_like(q), torch.empty_like(q), torch.empty_like(q))
    steps = bwd.launch_steps(dout, q, q, q, out, lse, *grads, **opts)
    for step in steps:
        step()
    pre, main = calls[0], calls[1]
    tm = bwd.tile_m_for(d)
    lse2, dpsum, clean, dq_words = pre[2][4:8]
    assert lse2.numel() == dpsum.numel() == n_chunks * tm and clean.numel() >= n_chunks
    if case != "dkv_only":
        assert dq_words.numel() == n_chunks * tm * d
    args = bwd.BwdKernelArgs(*main[2])
    scratch = [t for t in (args.lse2, args.dpsum, args.clean, args.dq_acc, args.sem, args.tile_counter,
                           args.split_dkv) if isinstance(t, torch.Tensor)]
    assert len({t.untyped_storage().data_ptr() for t in scratch}) == 1
    spans = sorted((t.storage_offset() * t.element_size(), (t.storage_offset() + t.numel()) * t.element_size())
                   for t in scratch)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and all(a % 16 == 0 for a, _ in spans)
    if args.tile_counter is not None:
        assert not bwd.BwdKernelArgs(*main[1]).tile_counter.any()
        args.tile_counter.fill_(7)  # a launch leaves its counter claimed: the next launch zeroes it first
        steps[1]()
        assert not bwd.BwdKernelArgs(*calls[-1][1]).tile_counter.any()


def test_a_named_cute_backend_that_cannot_run_says_what_is_missing(monkeypatch):
    """`backend="cute"` where it cannot run said only "not available on device ...": now what the device or the
    install lacks (a CUDA tensor, a Hopper GPU, the cute extra)."""
    from fa4dist.kernels import registry

    with pytest.raises(ValueError, match="not available on device cpu: the cute kernels run on CUDA tensors"):
        registry.check_backend("cute", torch.device("cpu"))
    reason = cute_backend.CuteSm90Backend.unavailable_reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "built for Hopper (sm_90), this GPU is sm_80" in reason("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(host, "cutlass_importable", lambda: False)
    assert "pip install 'fa4dist[cute]'" in reason("cuda:0")
    monkeypatch.setattr(host, "cutlass_importable", lambda: True)
    assert reason("cuda:0") is None
