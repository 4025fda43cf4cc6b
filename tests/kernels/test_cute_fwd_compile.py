"""Compile-only tests of the Hopper CuTe DSL forward kernel (no GPU needed).

Every variant is traced and compiled for sm_90a with fake tensors; the PTX must target sm_90a and use wgmma,
TMA and setmaxnreg, and ptxas must report no register spills.  CI compiles a representative subset (each static
option at least once); set FA4DIST_COMPILE_ALL=1 to compile the full product of dtypes x head dims x causal x
varlen x accumulate.  A variant that can split a few-wave launch's tail compiles its unsplit kernel, which most
launches run; the entries with ``split_tail`` compile the split one.
"""

import dataclasses
import functools
import itertools
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")
torch = pytest.importorskip("torch")

from fa4dist.kernels.cute import forward as cute_fwd  # noqa: E402
from fa4dist.kernels.cute import host, split_plans  # noqa: E402
from ptxas_log import assert_ptxas_clean  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16)

# (dtype, head_dim, causal, varlen, accumulate, extra config) -- every option at least once
SUBSET = [
    (torch.bfloat16, 128, False, False, False, {}),
    (torch.bfloat16, 128, True, False, False, {}),
    (torch.float16, 64, True, True, False, {}),
    (torch.bfloat16, 96, False, True, True, {}),
    (torch.bfloat16, 128, True, True, True, {"seg_offsets": True}),
    (torch.float16, 128, True, False, False, {"out_fp32": True}),
    (torch.bfloat16, 64, False, False, True, {"rescale_threshold": 0.0}),
    (torch.float16, 64, False, False, False, {"tma_store_o": True, "tile_m": 128, "num_stages": 4}),
    (torch.bfloat16, 128, True, False, False, {"window_left": 4096}),
    (torch.bfloat16, 64, True, True, True, {"window_left": 200, "seg_offsets": True}),
    (torch.float16, 128, True, False, False, {"window_left": 100, "intra_wg_overlap": False}),
    (torch.bfloat16, 128, True, False, False, {"softcap": 30.0, "split_tail": True}),
    (torch.bfloat16, 64, False, True, True, {"softcap": 50.0}),
    (torch.bfloat16, 128, True, False, False, {"sinks": True}),  # TMA-store epilogue
    (torch.float16, 64, True, True, False, {"sinks": True, "window_left": 127, "softcap": 20.0}),  # direct
    (torch.bfloat16, 128, True, True, True, {"worklist": True}),  # one launch over a work list's item table
    # ... started while the launch before it finishes (programmatic dependent launch: a ring's merges in turn)
    (torch.bfloat16, 128, True, True, True, {"worklist": True, "pdl": True}),
    # ... on a persistent grid, tiles claimed from a counter (packed launches are persistent only this way), merging
    # with fixed roundings
    (torch.bfloat16, 64, True, True, True, {"worklist": True, "persistent_ctas": 132, "dynamic_tiles": True,
                                            "exact_merge": True}),
    # hdim 64 causal short sequences: two 64-row tiles per SM on the persistent grid (forward.short_queries,
    # short_two_ctas); with a window, 128-row tiles
    (torch.bfloat16, 64, True, False, False, {"short": True}),
    (torch.bfloat16, 64, True, False, False, {"short": True, "window_left": 300}),
    (torch.bfloat16, 64, True, True, False, {"short": True, "seg_offsets": True}),  # packed short documents
    (torch.bfloat16, 64, True, False, False, {"short": True, "tiny": True}),  # <= 512 rows: 64-key tiles
    # hdim 128 causal sequences of at most 2k: long and short tiles interleaved (forward.interleaved_launch)
    (torch.bfloat16, 128, True, False, False, {"interleave": True, "split_tail": True}),
    # hdim 128 sequences of 16k+ keys (forward.wide_tiles_launch): non-causal, the row max in chains
    # (forward.chained_max_launch) on 176-key tiles, O stored directly; causal, 160-key tiles
    (torch.bfloat16, 128, False, False, False, {"chained": True, "wide": True}),
    (torch.bfloat16, 128, False, False, False, {"chained": True, "wide": True, "split_tail": True}),
    (torch.bfloat16, 128, True, False, False, {"wide": True}),
    (torch.bfloat16, 128, True, False, False, {"wide": True, "split_tail": True}),
    # hdim 64's default 192-row tiles on the persistent grid, unsplit and split
    (torch.bfloat16, 64, False, False, False, {}),
    (torch.float16, 64, True, False, False, {"split_tail": True}),
    # hdim 96 causal on the persistent grid: its producer takes 32 registers (forward.default_regs_producer)
    (torch.bfloat16, 96, True, False, False, {}),
    # hdim 256 (Gemma 2 / 3) on 128 x 64 tiles: dense, packed merging, Gemma 2's soft-cap with its window, sinks
    (torch.bfloat16, 256, False, False, False, {}),
    (torch.float16, 256, True, True, True, {}),
    (torch.bfloat16, 256, True, False, False, {"softcap": 50.0, "window_left": 4095}),
    (torch.bfloat16, 256, True, True, False, {"sinks": True, "seg_offsets": True}),
]


# measurement knobs: compiled by FA4DIST_COMPILE_ALL=1 and bench/cute_ptx_dev.py, not by CI's subset (CI's time;
# intra_wg_overlap=False stays in the subset with a window)
EXTRA = [
    # two independent 64-row tiles per SM, one CTA per tile (the default's is persistent: SUBSET)
    (torch.bfloat16, 64, True, False, False, {"tile_m": 64, "ctas_per_sm": 2, "persistent_ctas": 0}),
    (torch.bfloat16, 128, True, False, False, {"intra_wg_overlap": False}),
    (torch.bfloat16, 128, True, False, False, {"tma_store_o": False, "rescale_threshold": 8.0}),
    (torch.bfloat16, 128, False, False, True, {"prefetch_running": False}),
    # the static walk of a persistent grid, with the sanitizer's walk over masked tiles
    (torch.bfloat16, 128, True, False, False, {"window_left": 300, "dynamic_tiles": False}),
    (torch.bfloat16, 64, True, True, True, {"worklist": True}),  # a ring step's work list
    # hdim 96 causal on the persistent grid (32 / 232 registers by default): options, packed documents, a window
    (torch.float16, 96, True, False, False, {"softcap": 20.0, "sinks": True}),
    (torch.bfloat16, 96, True, True, False, {"seg_offsets": True}),
    (torch.bfloat16, 96, True, False, False, {"window_left": 300}),
    # flash-attn-4's wait and conversion forms (late_pv_wait, default but at hdim 64 causal: forward.
    # default_late_pv_wait) switched the other way
    (torch.bfloat16, 128, False, False, False, {"late_pv_wait": False}),
    (torch.bfloat16, 64, True, False, False, {"late_pv_wait": True}),
    # the descriptor bases left to the DSL in every step (the knob's off position, sixteenth session)
    (torch.bfloat16, 128, False, False, False, {"hoist_descriptors": False}),
    (torch.bfloat16, 64, True, False, False, {"hoist_q_slices": False}),  # the bases hoisted, Q's slices not
    # long and short causal tiles interleaved in the launch order: dense with head groups (a merge), packed
    (torch.bfloat16, 128, True, False, True, {"interleave_lengths": True}),
    (torch.bfloat16, 64, True, True, False, {"interleave_lengths": True}),
    # a masked block's bad-V marks right after its softmax (the knob's off position: the consumer waits for the
    # sanitizer before the next S GEMM), with a window's bottom blocks
    (torch.bfloat16, 128, True, False, False, {"defer_v_marks": False, "window_left": 300}),
    (torch.bfloat16, 64, True, False, False, {"defer_v_marks": True}),  # ... and deferred on 192-row tiles
    # a fresh zeroed tile counter per launch (the knob's off position: by default the launch's last claim sets the
    # counter back to 0 and the host reuses the stream's counter)
    (torch.bfloat16, 128, True, False, False, {"reset_counter": False}),
    # the overlapped step's stage releases by elect.sync (no S2R of %tid in the loop): the default of hdim-64 causal
    # launches only (default_elect_release), so its other positions here
    (torch.bfloat16, 64, True, False, False, {"elect_release": False}),
    (torch.bfloat16, 128, True, False, False, {"elect_release": True}),
    # the tile's elect.sync winner held through the loop, the K release after the step's softmax: the default of
    # hdim-64 non-causal launches only (default_late_k_release), so its other positions here
    (torch.bfloat16, 64, False, False, False, {"late_k_release": False}),
    (torch.bfloat16, 128, True, False, True, {"late_k_release": True, "window_left": 300}),
    # hdim 256 on the persistent grid (O stored directly: no room for its staging tile), and a work list
    (torch.bfloat16, 256, False, False, False, {"tma_store_o": False, "persistent_ctas": 132}),
    (torch.bfloat16, 256, True, True, True, {"worklist": True}),
    # hdim 128 non-causal sequences of 8k-16k keys: the row max in chains on 128-key tiles
    (torch.bfloat16, 128, False, False, False, {"chained": True}),
]


def _all_variants():
    for dt, d, causal, varlen, acc in itertools.product(
        DTYPES, cute_fwd.SUPPORTED_HEAD_DIMS, (False, True), (False, True), (False, True)
    ):
        yield (dt, d, causal, varlen, acc, {})


VARIANTS = list(_all_variants()) + SUBSET + EXTRA if os.environ.get("FA4DIST_COMPILE_ALL") else SUBSET


def _id(v):
    dt, d, causal, varlen, acc, extra = v
    parts = [str(dt).split(".")[-1], f"d{d}", "causal" if causal else "full", "varlen" if varlen else "dense"]
    if acc:
        parts.append("acc")
    parts += [f"{k}={val}" for k, val in extra.items()]
    return "-".join(parts)


@pytest.mark.cute
@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v) for v in VARIANTS])
def test_compile_variant(variant, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory
    dt, d, causal, varlen, acc, extra = variant
    cfg = cute_fwd.make_config(dt, d, causal=causal, varlen=varlen, accumulate=acc, **extra)
    if cfg.split_tail and "split_tail" not in extra:
        # forward() runs the unsplit kernel for every launch its plan does not split (most of them); the split
        # kernels compile in the entries that ask for split_tail
        cfg = dataclasses.replace(cfg, split_tail=False)
    compiled = host.compile_config(cfg, extra_options="--keep-ptx remarks{ptx}")
    ptx = compiled.artifacts.PTX
    assert ptx, "no PTX kept"
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert len(re.findall(r"setmaxnreg\.(inc|dec)", ptx)) == 2
    assert "ld.local" not in ptx and "st.local" not in ptx
    if acc:
        # reads the running out (two floats per load) / lse, asked from L2 ahead by the producer warp
        assert "ld.global.v2.b32" in ptx
        assert ("cp.async.bulk.prefetch.L2.global" in ptx) == cfg.prefetch_running
    if cfg.tma_store_o and not varlen and not acc and not extra.get("out_fp32"):
        assert "stmatrix" in ptx and "cp.async.bulk.tensor.4d.global.shared" in ptx
    if extra.get("softcap"):
        assert "tanh.approx.f32" in ptx  # the hardware tanh (softmax.softcap_scores)
        # bf16 and c <= 50: a constant row max (softmax.softcap_fixed_row_max), so no per-score max reductions
        fixed = dt == torch.bfloat16 and extra["softcap"] <= 50
        assert (ptx.count("max.NaN.f32") < 64) == fixed
    # a persistent CTA walks the tiles by the grid's size (the default for 16-bit writes)
    assert ("%nctaid.x" in ptx) == cfg.persistent
    assert ("atom.global.add.u32" in ptx) == cfg.takes_tile_counter  # the dynamic walk's claims
    assert ("mul.rn.f32" in ptx) == cfg.exact_merge  # the merge's separately rounded product
    # pdl: the CTAs let the next launch start, and the epilogue waits for the previous grid
    assert ("griddepcontrol.launch_dependents" in ptx) == ("griddepcontrol.wait" in ptx) == cfg.pdl
    # the descriptor bases computed once per tile (common_sm90.loop_invariant_descriptors: Q, K, V)
    assert ("%dynamic_smem_size" in ptx) == cfg.hoist_descriptors
    if causal or varlen:  # masked V tiles go through the sanitizer warps (packed fp16/bf16 FMA check)
        assert "bar.red.or.pred" in ptx and ("fma.rn.bf16x2" in ptx or "fma.rn.f16x2" in ptx)
    log = capfd.readouterr()
    assert_ptxas_clean(log.out + log.err)


@pytest.mark.cute
@pytest.mark.parametrize("num_m_blocks", [1, 2, 5, 8, 33])
def test_causal_launch_orders_are_permutations(num_m_blocks):
    """tile_scheduler.causal_m_block: longest first, or long and short interleaved (n-1, 0, n-2, 1, ...): each a
    permutation of the query tiles, the interleaved one pairing neighbours to the same work."""
    from fa4dist.kernels.cute.tile_scheduler import causal_m_block

    n = num_m_blocks
    longest = [causal_m_block(p, n, False) for p in range(n)]
    mixed = [causal_m_block(p, n, True) for p in range(n)]
    assert longest == list(range(n - 1, -1, -1))
    assert sorted(mixed) == list(range(n))
    assert mixed[:4] == [n - 1, 0, n - 2, 1][:n]
    assert all(mixed[p] + mixed[p + 1] == n - 1 for p in range(0, n - 1, 2))


@pytest.mark.cute
def test_config_is_hashable_cache_key():
    a = cute_fwd.make_config(torch.bfloat16, 128, causal=True, varlen=False, accumulate=False)
    b = cute_fwd.make_config(torch.bfloat16, 128, causal=True, varlen=False, accumulate=False)
    c = cute_fwd.make_config(torch.bfloat16, 128, causal=False, varlen=False, accumulate=False)
    assert a == b and hash(a) == hash(b) and a != c


def test_supports_reports_reasons():
    q = torch.empty(1, 4, 2, 160, dtype=torch.bfloat16)
    ok, reason = cute_fwd.supports(q, q, q)
    assert not ok and "head dim" in reason
    q32 = torch.empty(1, 4, 2, 128, dtype=torch.float32)
    ok, reason = cute_fwd.supports(q32, q32, q32)
    assert not ok and "dtype" in reason


def test_persistent_grid_default_and_the_sms_variable(monkeypatch):
    """16-bit writes, dense or packed, causal or not, run on a persistent grid of the SM
    count that claims its tiles from a counter; merges, fp32 writes, packed windows and the non-overlapped consumer
    one CTA per tile (forward.default_persistent_ctas); FA4DIST_CUTE_SMS=N caps the grid."""
    monkeypatch.setattr(host, "_SM_COUNT", [])
    monkeypatch.delenv(host.SMS_ENV, raising=False)
    full = cute_fwd.make_config(torch.bfloat16, 128, causal=False, varlen=False, accumulate=False)
    assert full.persistent and full.persistent_ctas == host.sm_count() > 0 and full.takes_tile_counter
    for kw in (dict(causal=True, varlen=False, accumulate=False, window_left=9),
               dict(causal=True, varlen=True, accumulate=False, seg_offsets=True),
               dict(causal=False, varlen=True, accumulate=False, worklist=True)):
        cfg = cute_fwd.make_config(torch.bfloat16, 64, **kw)
        assert cfg.persistent and cfg.takes_tile_counter, kw
    for kw in (dict(causal=True, varlen=True, accumulate=True), dict(causal=True, varlen=False, accumulate=True),
               dict(causal=False, varlen=False, accumulate=False, out_fp32=True),
               dict(causal=True, varlen=False, accumulate=False, intra_wg_overlap=False),
               dict(causal=True, varlen=True, accumulate=False, window_left=100)):
        cfg = cute_fwd.make_config(torch.bfloat16, 128, **kw)
        assert cfg.persistent_ctas == 0 and not cfg.persistent and not cfg.takes_tile_counter, kw
    # programmatic dependent launch takes one CTA per tile (a persistent grid's counter would be shared with the
    # launch it overlaps): a write that would be persistent is not, and a forced persistent grid is refused
    pdl = cute_fwd.make_config(torch.bfloat16, 64, causal=False, varlen=True, accumulate=False, worklist=True, pdl=True)
    assert pdl.pdl and not pdl.persistent and not pdl.takes_tile_counter
    with pytest.raises(ValueError, match="pdl needs one CTA per tile"):
        cute_fwd.make_config(torch.bfloat16, 64, causal=False, varlen=True, accumulate=True, worklist=True, pdl=True,
                             persistent_ctas=132)
    # hdim 96's causal kernel is persistent with 32 producer registers (24 spill there); elsewhere the usual split
    d96 = cute_fwd.make_config(torch.float16, 96, causal=True, varlen=False, accumulate=False)
    assert d96.persistent and d96.regs_producer == 32
    assert cute_fwd.make_config(torch.float16, 96, causal=True, varlen=False, accumulate=True).regs_producer == 0
    assert cute_fwd.make_config(torch.float16, 96, causal=False, varlen=False, accumulate=False).persistent
    monkeypatch.setattr(host, "_SM_COUNT", [])
    monkeypatch.setenv(host.SMS_ENV, "100")
    capped = cute_fwd.make_config(torch.bfloat16, 128, causal=False, varlen=False, accumulate=False)
    assert capped.persistent_ctas == min(100, full.persistent_ctas)
    for bad in ("lots", "0", "\u00b2", "-3"):
        monkeypatch.setattr(host, "_SM_COUNT", [])
        monkeypatch.setenv(host.SMS_ENV, bad)
        with pytest.raises(ValueError, match="FA4DIST_CUTE_SMS must be a positive number"):
            host.sm_count()


def test_an_mps_client_limit_lowers_the_sm_count(monkeypatch):
    """Under an MPS client limit the process holds only that share of the SMs at once: the persistent grids and
    the deterministic orders that need CTAs resident together must count those, or the orders could hang."""
    monkeypatch.setattr(host, "_SM_COUNT", [])
    monkeypatch.delenv(host.SMS_ENV, raising=False)
    monkeypatch.delenv(host.MPS_ENV, raising=False)
    full = host.sm_count()
    monkeypatch.setattr(host, "_SM_COUNT", [])
    monkeypatch.setenv(host.MPS_ENV, "25")
    quarter = host.sm_count()
    assert quarter == max(1, int(full * 0.25))
    from fa4dist.kernels.cute import backward as cute_bwd

    main = cute_bwd.make_configs(torch.bfloat16, 128, causal=False, varlen=False, seg_offsets=False,
                                 accumulate=False, deterministic=True, dq_dtype=torch.bfloat16,
                                 dkv_dtype=torch.bfloat16, o_dtype=torch.bfloat16, do_dtype=torch.bfloat16)[1]
    assert main.det_resident == quarter // 2  # rotated sequences fit in what the process can hold
    monkeypatch.setattr(host, "_SM_COUNT", [])
    monkeypatch.setenv(host.MPS_ENV, "100")
    assert host.sm_count() == full


def test_short_causal_hdim64_sequences_take_short_tiles():
    """hdim 64 causal dense 16-bit launches of at most SHORT_CAUSAL_ROWS query rows: 64-row tiles two per SM on a
    grid of twice the SMs (128-row tiles with a window, soft-cap or sinks); longer ones, non-causal ones, packed,
    merge and fp32 launches and other head dims keep theirs (forward.short_queries, short_two_ctas)."""
    n = cute_fwd.SHORT_CAUSAL_ROWS
    assert cute_fwd.short_queries(64, True, True, n) and cute_fwd.short_queries(64, True, True, 1)
    for args in ((64, True, True, n + 1), (64, False, True, 512), (64, True, False, 512), (128, True, True, 512)):
        assert not cute_fwd.short_queries(*args), args
    make = functools.partial(cute_fwd.make_config, torch.bfloat16, 64, causal=True, varlen=False, accumulate=False)
    short, long = make(short=True), make(short=False)
    assert (short.tile_m, short.ctas_per_sm, short.persistent_ctas) == (64, 2, 2 * host.sm_count())
    assert (long.tile_m, long.ctas_per_sm) == (192, 1)
    for options in (dict(window_left=300), dict(softcap=30.0), dict(sinks=True)):
        cfg = make(short=True, **options)
        assert (cfg.tile_m, cfg.ctas_per_sm) == (128, 1), options
    forced = make(short=True, tile_m=128)  # a forced tile keeps one CTA per SM
    assert (forced.tile_m, forced.ctas_per_sm) == (128, 1)
    # at most TINY_CAUSAL_ROWS rows: 64-key tiles in three stages, on the two-CTA tiles only
    assert cute_fwd.tiny_tiles(True, cute_fwd.TINY_CAUSAL_ROWS) and not cute_fwd.tiny_tiles(True, n)
    assert not cute_fwd.tiny_tiles(False, 256)
    tiny = make(short=True, tiny=True)
    assert (tiny.tile_m, tiny.ctas_per_sm, tiny.tile_n, tiny.num_stages) == (64, 2, 64, 3)
    assert (short.tile_n, short.num_stages) == (128, 2)
    assert make(short=True, tiny=True, tile_n=128).num_stages == 2  # a forced key tile keeps its stages


def test_short_packed_causal_hdim64_documents_take_two_ctas_per_sm():
    """Packed hdim-64 causal launches writing a 16-bit out whose documents have at most SHORT_CAUSAL_ROWS query
    rows take short_two_ctas' tiles; longer documents, a window, soft-cap or sinks, fp32 / merge outs, non-causal
    launches and other head dims keep the 192-row (or their own) tiles (forward.short_documents)."""
    n = cute_fwd.SHORT_CAUSAL_ROWS
    assert cute_fwd.short_documents(64, True, True, n, -1, 0.0, False)
    assert cute_fwd.short_documents(64, True, True, 1, -1, None, False)
    for args in ((64, True, True, n + 1, -1, 0.0, False), (64, True, False, 512, -1, 0.0, False),
                 (64, False, True, 512, -1, 0.0, False), (128, True, True, 512, -1, 0.0, False),
                 (64, True, True, 512, 100, 0.0, False), (64, True, True, 512, -1, 30.0, False),
                 (64, True, True, 512, -1, 0.0, True)):
        assert not cute_fwd.short_documents(*args), args
    cfg = cute_fwd.make_config(torch.bfloat16, 64, causal=True, varlen=True, accumulate=False, seg_offsets=True,
                               short=True)
    assert (cfg.tile_m, cfg.ctas_per_sm, cfg.persistent_ctas) == (64, 2, 2 * host.sm_count())
    assert cfg.dynamic_tiles  # packed launches are persistent only with the dynamic walk


def test_short_dense_causal_launches_interleave_long_and_short_tiles():
    """Dense causal launches writing a 16-bit out, without a window, of at most INTERLEAVE_MAX_ROWS query rows
    alternate long and short tiles; longer ones, non-causal, packed, merge / fp32 and windowed launches and hdim
    64's short-sequence tiles keep longest first (forward.interleaved_launch); make_config takes the caller's
    choice, an override wins."""
    n, short = cute_fwd.INTERLEAVE_MAX_ROWS, cute_fwd.SHORT_CAUSAL_ROWS
    assert cute_fwd.interleaved_launch(128, True, True, n) and cute_fwd.interleaved_launch(128, True, True, 1)
    assert cute_fwd.interleaved_launch(64, True, True, n) and cute_fwd.interleaved_launch(64, True, True, short + 1)
    for args in ((128, True, True, n + 1), (128, False, True, 512), (128, True, False, 512),
                 (128, True, True, 512, 100), (64, True, True, short)):
        assert not cute_fwd.interleaved_launch(*args), args
    make = functools.partial(cute_fwd.make_config, torch.bfloat16, 128, varlen=False, accumulate=False)
    assert make(causal=True, interleave=True).interleave_lengths
    assert not make(causal=True).interleave_lengths
    assert not make(causal=True, interleave=True, interleave_lengths=False).interleave_lengths
    assert not make(causal=False, interleave_lengths=True).interleave_lengths  # one length: one kernel


def _assert_long_dense_hdim128_scope(rule, n, causal_too):
    """``rule(head_dim, causal, dense_plain, seqlen_k, window_left, softcap, sinks)`` holds for dense non-causal
    hdim-128 launches of ``n``+ keys without a window, soft-cap or sinks, for causal ones too where ``causal_too``,
    and for no shorter, hdim-64, packed or merge / fp32, windowed, soft-capped or sink launch."""
    assert rule(128, False, True, n) and rule(128, False, True, 4 * n)
    assert rule(128, True, True, n) == causal_too
    for causal in (False, True):
        for args in ((128, causal, True, n - 1), (64, causal, True, n), (128, causal, False, n),
                     (128, causal, True, n, 100), (128, causal, True, n, -1, 30.0),
                     (128, causal, True, n, -1, 0.0, True)):
            assert not rule(*args), args


def test_long_dense_non_causal_hdim128_launches_chain_the_row_max():
    """Launches of CHAINED_MAX_MIN_KEYS+ keys take the row max in chains, the others keep the tree
    (forward.chained_max_launch); make_config takes the caller's choice, an override wins."""
    _assert_long_dense_hdim128_scope(cute_fwd.chained_max_launch, cute_fwd.CHAINED_MAX_MIN_KEYS, causal_too=False)
    make = functools.partial(cute_fwd.make_config, torch.bfloat16, 128, causal=False, varlen=False, accumulate=False)
    assert make(chained=True).chained_max and not make().chained_max
    assert not make(chained=True, chained_max=False).chained_max


def test_long_dense_hdim128_launches_take_wide_key_tiles():
    """Launches of WIDE_TILES_MIN_KEYS+ keys take wider key tiles, the others 128-key tiles (forward.wide_tiles_launch,
    wide_tile_fields): 176 keys with O stored directly non-causal, 160 keys with O staged and 32 producer registers
    causal; make_config takes the caller's choice, and an override of the tile or the O store wins."""
    _assert_long_dense_hdim128_scope(cute_fwd.wide_tiles_launch, cute_fwd.WIDE_TILES_MIN_KEYS, causal_too=True)
    for causal, tile_n, tma_store_o, regs_producer in ((False, 176, False, 0), (True, 160, True, 32)):
        make = functools.partial(cute_fwd.make_config, torch.bfloat16, 128, causal=causal, varlen=False,
                                 accumulate=False)
        wide, plain = make(wide=True), make()
        assert (wide.tile_n, wide.tma_store_o, wide.regs_producer) == (tile_n, tma_store_o, regs_producer)
        assert (plain.tile_n, plain.tma_store_o, plain.regs_producer) == (128, True, 0)
        assert wide.persistent and wide.split_tail  # the persistent grid and its tail splits as on 128-key tiles
        assert make(wide=True, tile_n=128).tile_n == 128 and make(wide=True, tma_store_o=True).tile_n == 128
        assert make(wide=True, regs_producer=24).regs_producer == 24


def test_split_plan_splits_a_partial_last_wave_where_the_model_says_it_pays():
    """split_plans.split_plan: no split without a tail, after SPLIT_MAX_WHOLE_WAVES whole waves, when the tail is
    nearly a whole wave, or when the tiles are too short for parts of SPLIT_MIN_PART_BLOCKS; otherwise the tail's
    tiles, after every whole wave, in the parts count of least modelled time, never more than SPLIT_MAX_PARTS."""
    plan = split_plans.split_plan
    assert plan(264, 132, 32) == (264, 1)  # whole waves
    assert plan(1248, 132, 32) == (1248 - 60, 2)  # 9 waves and 60 tiles of 32 blocks: one round of halves
    assert plan(832, 132, 32) == (832 - 40, 3)  # 6 waves and 40 tiles: one round of thirds
    assert plan(2048, 132, 32) == (2048, 1)  # 15 whole waves: measured no faster split
    assert plan(160, 132, 32) == (132, 4)  # 28 tiles: one round of quarters
    assert plan(192, 132, 64) == (132, 2)
    assert plan(7 * 132 + 112, 132, 128) == (7 * 132 + 112, 1)  # a tail of 112 tiles: nearly a whole wave
    assert plan(160, 132, 7) == (160, 1)  # tiles of 7 blocks: too short to split
    cfg = cute_fwd.make_config(torch.bfloat16, 128, causal=False, varlen=False, accumulate=False,
                               persistent_ctas=132)
    assert cute_fwd.dense_split_plan(cfg, (1, 4000, 5, 128), 4050) == (132, 4)  # 5 x 32 query tiles of 32 blocks
    assert plan(64, 132, 8) == (0, 2)  # one partial wave: halves of 4 blocks
    for tiles in range(1, 600, 7):
        for n_blocks in (1, 4, 9, 32, 100):
            start, parts = plan(tiles, 132, n_blocks)
            assert 1 <= parts <= split_plans.SPLIT_MAX_PARTS and (parts == 1) == (start == tiles)
            assert parts == 1 or (n_blocks >= parts * split_plans.SPLIT_MIN_PART_BLOCKS and start % 132 == 0)


def test_split_tail_default_scope():
    """The split of a few-wave launch's tail (FwdConfig.split_tail) by default on dense launches, causal or not,
    writing a fresh 16-bit out on the dynamic persistent grid, one CTA per SM, hdim <= 128, no window or sinks
    (forward.split_tail_fits); not on packed, merging, fp32-out, windowed, sink or hdim-256 launches, nor on one
    CTA per tile or two per SM. Forcing it where it does not fit is an error naming the field."""
    make = functools.partial(cute_fwd.make_config, torch.bfloat16)
    for d in (64, 96, 128):
        for causal in (False, True):
            assert make(d, causal=causal, varlen=False, accumulate=False).split_tail, d
            assert make(d, causal=causal, varlen=False, accumulate=False, softcap=30.0).split_tail, d
    for kw in (dict(causal=False, varlen=True, accumulate=False), dict(causal=True, varlen=True, accumulate=False),
               dict(causal=False, varlen=False, accumulate=True), dict(causal=False, varlen=False, accumulate=False,
                                                                       out_fp32=True),
               dict(causal=False, varlen=False, accumulate=False, sinks=True),
               dict(causal=True, varlen=False, accumulate=False, window_left=100),
               dict(causal=True, varlen=False, accumulate=False, persistent_ctas=0)):
        assert not make(128, **kw).split_tail, kw
    assert not make(256, causal=False, varlen=False, accumulate=False).split_tail
    assert not make(64, causal=True, varlen=False, accumulate=False, short=True).split_tail  # two CTAs per SM
    with pytest.raises(ValueError, match="split_tail .forced by FA4DIST_FWD_OVERRIDE or a variant.s overrides. needs"):
        make(128, causal=True, varlen=False, accumulate=False, window_left=100, split_tail=True)


def test_causal_split_plan_splits_the_longest_tiles_of_a_launch_of_few_waves():
    """split_plans.causal_split_plan: a causal launch of one wave or less ends with its longest tiles, so every head's
    longest rows of tiles run in parts (claimed first) where the simulated claims say it pays; no split from
    SPLIT_CAUSAL_MAX_WAVES waves on, nor where parts would be shorter than SPLIT_MIN_PART_BLOCKS blocks."""
    plan = split_plans.causal_split_plan
    assert plan(4, 4096, 4096, 0, 128, 128, 132) == (36, 2)  # 4 heads of 32 tiles: the 9 longest rows in halves
    assert plan(1, 16384, 16384, 0, 128, 128, 132) == (118, 2)
    assert plan(1, 4096, 4096, 0, 128, 128, 132) == (17, 4)
    assert plan(8, 4096, 4096, 0, 128, 128, 132) == (0, 1)  # two waves: longest first balances them
    assert plan(6, 4096, 4096, 0, 128, 128, 132) == (0, 1)  # 1.45 waves: the model gains < 10%
    assert plan(64, 512, 512, 0, 128, 128, 132) == (0, 1)  # tiles of 1-4 blocks: too short to split
    assert plan(4, 4096, 4096, -5000, 128, 128, 132) == (0, 1)  # no query sees a key
    for heads in (1, 2, 3, 5, 8):
        for s in (1000, 2048, 4000, 8192):
            for diag in (0, -300, 1000):
                edge, parts = plan(heads, s, s, diag, 128, 128, 132)
                assert 1 <= parts <= split_plans.SPLIT_MAX_PARTS and (parts == 1) == (edge == 0)
                assert edge % heads == 0 and edge <= heads * -(-s // 128)
                if parts > 1:  # the shortest split tile still gives parts of the minimum length
                    m = -(-s // 128) - edge // heads
                    blocks = -(-min(s, (m + 1) * 128 + diag) // 128)
                    assert blocks >= parts * split_plans.SPLIT_MIN_PART_BLOCKS
    cfg = cute_fwd.make_config(torch.bfloat16, 128, causal=True, varlen=False, accumulate=False,
                               persistent_ctas=132)
    assert cute_fwd.dense_split_plan(cfg, (1, 4096, 4, 128), 4096) == (36, 2)
    assert cute_fwd.split_tile_count(cfg, (1, 4096, 4, 128), (36, 2)) == 36


@pytest.mark.parametrize("causal", [False, True])
def test_split_rows_are_the_rows_of_the_split_tiles(causal):
    """forward.split_rows marks whole query tiles (the last one cut at s_q), as many as split_tile_count counts:
    causal each (batch, head)'s last, non-causal the launch-order tiles from the edge on; none for an unsplit plan."""
    cfg = cute_fwd.make_config(torch.bfloat16, 128, causal=causal, varlen=False, accumulate=False,
                               persistent_ctas=132)
    shape = (2, 1000, 3, 128)  # 8 query tiles of 128 rows, the last one of 104
    plan = (3 * 6, 2) if causal else (29, 3)  # causal: 3 tiles of each of the 6 (batch, head)s
    rows = cute_fwd.split_rows(cfg, shape, plan)
    assert rows.shape == (2, 3, 1000)
    tiles = rows[..., ::128]  # each tile's first row
    assert torch.equal(rows, tiles.repeat_interleave(128, dim=2)[..., :1000])
    assert int(tiles.sum()) == cute_fwd.split_tile_count(cfg, shape, plan)
    if causal:
        assert tiles[..., 5:].all() and not tiles[..., :5].any()
    else:
        assert not tiles.flatten()[:29].any() and tiles.flatten()[29:].all()
    assert not cute_fwd.split_rows(cfg, shape, (0, 1)).any()


def test_sum_from_old_follows_the_head_dim_only():
    """The row sum's order (FwdConfig.sum_from_old) is a function of the head dim alone, so that every variant of
    one head dim sums alike: persistent or not, short tiles or not, merge, packed, work list (their bits are
    compared with each other). On at hdim 64, off at 96 and 128 (measured, forward.default_sum_from_old); the O
    rescale is unconditional by default everywhere (rescale_threshold 0)."""
    for d, want in ((64, True), (96, False), (128, False)):
        for kw in (dict(varlen=False, accumulate=False), dict(varlen=False, accumulate=False, short=True),
                   dict(varlen=True, accumulate=True), dict(varlen=True, accumulate=True, worklist=True)):
            for causal in (False, True):
                cfg = cute_fwd.make_config(torch.bfloat16, d, causal=causal, **kw)
                assert cfg.sum_from_old is want and cfg.rescale_threshold == 0.0, (d, causal, kw)


def test_defer_v_marks_default_scope():
    """A masked block's bad-V marks are deferred (FwdConfig.defer_v_marks) on kernels of one or two consumer
    warpgroups (hdim 128, hdim 64's short two-CTA launches), not on hdim 64's 192-row tiles (measured slower, and
    spilling with softcap: forward.default_defer_v_marks); an override wins."""
    def cfg(d, **kw):
        return cute_fwd.make_config(torch.bfloat16, d, causal=True, varlen=False, accumulate=False, **kw)
    assert cfg(128).defer_v_marks and cfg(128, softcap=30.0).defer_v_marks
    assert cfg(64, short=True).tile_m == 64 and cfg(64, short=True).defer_v_marks
    assert cfg(64).tile_m == 192 and not cfg(64).defer_v_marks and not cfg(64, softcap=30.0).defer_v_marks
    assert cfg(64, defer_v_marks=True).defer_v_marks and not cfg(128, defer_v_marks=False).defer_v_marks


def test_late_pv_wait_default_scope():
    """flash-attn-4's wait and conversion forms (FwdConfig.late_pv_wait) by default everywhere but hdim <= 64
    causal, where they measured no faster (forward.default_late_pv_wait); every variant of a call follows it."""
    for d in (64, 96, 128):
        for causal in (False, True):
            for kw in (dict(varlen=False, accumulate=False), dict(varlen=True, accumulate=True, worklist=True)):
                cfg = cute_fwd.make_config(torch.bfloat16, d, causal=causal, **kw)
                assert cfg.late_pv_wait is not (d == 64 and causal), (d, causal, kw)
    assert cute_fwd.make_config(torch.bfloat16, 128, causal=False, varlen=False, accumulate=False,
                                late_pv_wait=False).late_pv_wait is False
