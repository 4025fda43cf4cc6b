"""Compile-only tests of the Hopper CuTe DSL backward kernels (no GPU needed).

Each variant (preprocess, main kernel, dQ convert) is traced and compiled for sm_90a with fake tensors. The main
kernel's PTX must target sm_90a and use wgmma, TMA, setmaxnreg and the bulk fp32 reduction; ptxas must report no
register spills. CI compiles a representative subset (every static option at least once); set
FA4DIST_COMPILE_ALL=1 for the full product of dtypes x head dims x causal x varlen x accumulate x deterministic.
"""

import dataclasses
import itertools
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")
torch = pytest.importorskip("torch")

from fa4dist.kernels.cute import backward as bwd  # noqa: E402
from fa4dist.kernels.cute import host  # noqa: E402
from ptxas_log import assert_ptxas_clean  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (dtype, head_dim, causal, varlen, accumulate, deterministic, extra) -- every option at least once, few twice (CI
# time: each variant compiles three kernels)
SUBSET = [
    (BF16, 128, False, False, False, False, {}),
    (BF16, 128, True, False, False, True, {}),
    (FP16, 64, True, True, False, False, {}),
    (BF16, 64, False, True, True, True, {}),
    (BF16, 128, True, True, True, False, {"seg_offsets": True}),
    (FP16, 128, False, False, False, False, {"o_fp32": True, "do_fp32": True, "grads_fp32": True}),
    (FP16, 64, True, True, True, False, {"window_left": 200, "seg_offsets": True}),
    (BF16, 64, False, False, False, False, {"softcap": 50.0}),
    (BF16, 128, True, False, False, False, {"window_left": 1000}),  # the ascending order with a window band
    (BF16, 128, True, False, True, True, {"grads": "dq"}),  # the cp_invariant engine's two passes
    (BF16, 64, True, True, True, True, {"grads": "dkv", "seg_offsets": True}),
    # the fixed-point dQ (cp_invariant): int64 scratch, .add.u64, no tickets even when deterministic
    (FP16, 64, True, True, True, True, {"dq_fixed": True, "seg_offsets": True}),
    (BF16, 128, True, True, True, True, {"dq_fixed": True, "softcap": 30.0, "window_left": 4096}),
    # int64 dQ converted to a float dq (fresh bf16 through TMA; fp32 added): the written form of one device's
    # cp_invariant calls, and the deterministic GQA backward's det_dq="fixed"
    (BF16, 128, True, False, False, True, {"dq_fixed": True, "fixed_to_float": True}),
    # one launch over a work list's item table (pre, main and convert read the table; deterministic: each
    # item's tickets). bench/cute_ptx_dev.py compiles these subsets; the GPU tests run the other work-list variants
    (BF16, 128, True, True, True, True, {"worklist": True}),
    # a work list's fresh dK / dV (fresh_dkv: written as 0 + x, dQ still through the scratch and an added convert)
    (FP16, 64, True, True, True, False, {"worklist": True, "write_dkv": True, "window_left": 300}),
    # deterministic non-causal fresh gradients: the rotated order by default (backward.default_det_resident), and
    # for short sequences on the persistent grid (backward.default_persistent_ctas), every tile claimed
    (BF16, 64, False, True, False, True, {"softcap": 30.0, "persistent_ctas": 132}),
    # the default of a short dense causal call at hdim 64: the persistent grid, dK / dV through TMA stores, long
    # and short key tiles interleaved (backward.default_interleave_lengths)
    (BF16, 64, True, False, False, False, {"persistent_ctas": 132, "max_seqlen_k": 1024}),
    # hdim 96 (the dQ GEMM's 48 head-dim columns per warpgroup: K and the dQ staging tile on 32-byte swizzle
    # atoms; the preprocess's rows on 8 threads of 12 elements)
    (BF16, 96, False, False, False, False, {}),
    (FP16, 96, True, True, True, True, {}),
    (BF16, 96, True, False, False, True, {"dq_fixed": True, "fixed_to_float": True}),
    # a causal launch of few waves with its longest key tiles in parts (backward.split_keys_variant): the parts'
    # fp32 dK / dV scratch, the arrival counters, the last part's sum in part order
    (BF16, 128, True, False, False, False, {"split_keys": True, "persistent_ctas": 132}),
]


# measurement knobs and a second combination of an option: compiled by FA4DIST_COMPILE_ALL=1 and
# bench/cute_ptx_dev.py, not by CI's subset (CI's time)
EXTRA = [
    (BF16, 128, False, False, False, True, {"stmatrix_ds": False}),
    (BF16, 128, True, True, False, True, {"det_chunk": 8}),
    (BF16, 128, True, False, False, False, {"masked_last": True, "window_left": 1000}),  # the band last (a knob)
    (FP16, 64, True, True, True, True, {"dq_fixed": True, "fixed_to_float": True}),
    (BF16, 128, True, False, False, True, {"softcap": 30.0, "window_left": 4096}),  # also with dq_fixed in SUBSET
    # a persistent grid claiming key tiles from a counter (a knob, measured in the eleventh session), deterministic:
    # the tickets across claimed tiles, the sanitizer's stages and landing barriers running on from tile to tile
    (BF16, 128, True, False, False, True, {"persistent_ctas": 132}),
    (FP16, 64, True, True, False, False, {"persistent_ctas": 132}),  # packed on the persistent grid
    # deterministic orders that need a sequence's key tiles resident at once: non-causal rotated (SUBSET has the
    # default's), dense and packed merging on the persistent grid
    (BF16, 128, False, False, False, True, {"det_resident": True}),
    (BF16, 64, False, True, True, True, {"det_resident": True, "persistent_ctas": 132}),
    (BF16, 128, True, False, False, True, {"det_resident": True}),  # causal: longest first when the tiles fit
    # the forward's wait and conversion forms in the step (fifteenth session: within noise at hdim 128; at hdim 64
    # ptxas serializes the wgmmas with both forms on, either alone does not, measured -10-13%)
    (BF16, 128, False, False, False, True, {"try_waits": True}),
    # the dQ tickets' other forms: a spinning poll, an explicit fence before the release (knobs; the default
    # releases with red.release alone)
    (BF16, 128, False, False, False, True, {"ticket_sleep_ns": 0, "release_fence": True}),
    (BF16, 128, True, False, False, False, {"try_waits": True}),
    # the descriptor bases left to the DSL in every step (the knob's off position, sixteenth session)
    (BF16, 128, False, False, False, True, {"hoist_descriptors": False}),
    # long and short causal key tiles interleaved in the launch order on one CTA per tile
    (BF16, 128, True, False, False, False, {"interleave_lengths": True}),
    # dense non-deterministic 4k: the persistent grid without the interleaved order, causal and not
    (BF16, 64, True, False, False, False, {"max_seqlen_k": 4096}),
    (BF16, 128, False, False, False, False, {"max_seqlen_k": 4096}),
    # hdim 96 beside the product's plain options: a work list, one-gradient passes, softcap and window, the
    # persistent grid, per-segment offsets
    (BF16, 96, True, True, True, True, {"worklist": True}),
    (BF16, 96, True, True, True, False, {"grads": "dq", "seg_offsets": True}),
    (FP16, 96, True, True, True, True, {"grads": "dkv"}),
    (BF16, 96, True, False, False, False, {"softcap": 30.0, "window_left": 1000}),
    (BF16, 96, False, False, False, True, {"persistent_ctas": 132, "max_seqlen_k": 1024}),
    (BF16, 96, True, True, True, True, {"dq_fixed": True, "softcap": 30.0, "window_left": 4096}),
    (FP16, 64, True, False, False, False, {"split_keys": True, "persistent_ctas": 132, "softcap": 30.0}),
    (BF16, 96, True, False, False, False, {"split_keys": True, "persistent_ctas": 132}),
    (BF16, 128, False, False, False, False, {"split_keys": True, "persistent_ctas": 132}),  # the last wave's
    (BF16, 128, True, False, False, False, {"lpt_over_heads": True, "persistent_ctas": 132}),
    (BF16, 128, True, False, False, True, {"lpt_over_heads": True}),  # deterministic: shortest first over heads
    (BF16, 128, True, False, False, False, {"lpt_over_heads": True, "lpt_group": 8}),  # ... in groups of 8 heads
    (BF16, 128, True, True, False, False, {"lpt_over_heads": True, "max_seqlen_k": 4096}),  # ... packed sequences
]


def _all_variants():
    for dt, d, causal, varlen, acc, det in itertools.product(
        (BF16, FP16), bwd.BWD_HEAD_DIMS, (False, True), (False, True), (False, True), (False, True)
    ):
        yield (dt, d, causal, varlen, acc, det, {})
    yield (BF16, 128, True, False, False, True, {"seg_offsets": True})


VARIANTS = list(_all_variants()) + SUBSET + EXTRA if os.environ.get("FA4DIST_COMPILE_ALL") else SUBSET


def _id(v):
    dt, d, causal, varlen, acc, det, extra = v
    parts = [str(dt).split(".")[-1], f"d{d}", "causal" if causal else "full", "varlen" if varlen else "dense"]
    if acc:
        parts.append("acc")
    if det:
        parts.append("det")
    parts += [f"{k}={val}" for k, val in extra.items()]
    return "-".join(parts)


def _configs(v):
    dt, d, causal, varlen, acc, det, extra = v
    extra = dict(extra)
    grads = FP32 if (acc or extra.pop("grads_fp32", False)) else dt
    o_dt = FP32 if extra.pop("o_fp32", False) else dt
    do_dt = FP32 if extra.pop("do_fp32", False) else dt
    seg = extra.pop("seg_offsets", False)
    write_dkv = extra.pop("write_dkv", False)
    pre, main, post = bwd.make_configs(
        dt, d, causal=causal, varlen=varlen, seg_offsets=seg, accumulate=acc, deterministic=det, dq_dtype=grads,
        dkv_dtype=grads, o_dtype=o_dt, do_dtype=do_dt, **extra,
    )
    if write_dkv:  # as backward_worklist(write_dkv=True) makes it
        main = dataclasses.replace(main, accumulate=False)
    return pre, main, post


@pytest.mark.cute
@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v) for v in VARIANTS])
def test_compile_backward_variant(variant, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory
    pre, main, post = _configs(variant)
    pre_ptx, post_ptx = (host.compile_config(cfg, extra_options="--keep-ptx").artifacts.PTX for cfg in (pre, post))
    assert ".target sm_90a" in pre_ptx and ".target sm_90a" in post_ptx
    # a dense 16-bit dq leaves the convert through smem and a TMA store; fp32 or packed dq, stores from registers
    tma_store = not post.accumulate and not post.varlen and not post.dq_fp32
    assert ("stmatrix" in post_ptx and "cp.async.bulk.tensor" in post_ptx) == tma_store, post
    compiled = host.compile_config(main, extra_options="--keep-ptx remarks{ptx}")
    ptx = compiled.artifacts.PTX
    assert ptx and ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    # fresh 16-bit dK / dV of a dense call leave through a staging tile and TMA stores; otherwise from registers
    tma_dkv = not main.accumulate and not main.varlen and not main.dkv_fp32 and main.grads != "dq" \
        and not main.dq_fixed
    assert ("cp.async.bulk.tensor.4d.global.shared::cta" in ptx) == tma_dkv, main
    # (a split_keys part writes its fp32 dK / dV to the scratch)
    assert ("st.global" in ptx) == ((not tma_dkv or main.split_keys) and main.grads != "dq"), main
    # dQ accumulation (and its tickets), unless the variant computes no dQ
    add = "u64" if main.dq_fixed else "f32"
    dq_adds = f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.{add}" in ptx
    assert dq_adds == (main.grads != "dkv")
    if main.dq_fixed:
        assert not main.deterministic and "cvt.rzi.s64.f32" in ptx
    if (main.dq_fixed or main.worklist) and not main.accumulate:
        # written dK / dV plus +0: the accumulating form's bits, -0 included; no read of the rows they replace
        assert len(re.findall(r"add\.f32\s+%r\d+, %r\d+, 0f00000000;", ptx)) >= 64
        assert main.dq_fixed or "ld.global.v2.b32" not in ptx
    if post.fixed_to_float:  # each row's integer rounded to fp32, divided exactly by its power of two
        assert "cvt.rn.f32.s64" in post_ptx and ("rcp.rn.f32" in post_ptx or "div.rn.f32" in post_ptx)
    assert len(re.findall(r"setmaxnreg\.(inc|dec)", ptx)) == 2
    # a persistent CTA claims its next key tile with an atomic add on the launch's counter, after the grid's
    # blockIdx.x tiles; a deterministic grid claims its first tile too, so that no dQ ticket waits on a CTA without
    # an SM (tile_scheduler.TileClaims): it never reads its block index
    assert ("atom.global.add.u32" in ptx) == main.takes_tile_counter
    blockidx_first = main.takes_tile_counter and not main.deterministic
    assert ("%nctaid.x" in ptx) == blockidx_first
    if main.takes_tile_counter and main.deterministic:
        assert "%ctaid.x" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    # the streamed operands' descriptor bases computed once per tile (loop_invariant_descriptors: Q, dO, dS and the
    # transposes a variant's GEMMs use)
    assert ("%dynamic_smem_size" in ptx) == main.hoist_descriptors
    if main.deterministic:
        assert ("ld.global.acquire.gpu" in ptx and "red.release.gpu" in ptx) == (main.grads != "dkv")

    if main.causal or main.varlen:  # K (and masked-step Q / dO) tiles go through the sanitizer warps
        assert "bar.red.or.pred" in ptx and ("fma.rn.bf16x2" in ptx or "fma.rn.f16x2" in ptx)
    log = capfd.readouterr()
    assert_ptxas_clean(log.out + log.err, _spill_budget(main))


def _spill_budget(main) -> int:
    """Bytes of spill stores a main-kernel variant may have: none, except the soft-capped hdim-64 backward on its
    128-row query tiles, whose masked steps spill 8-40 bytes (the cap's derivative recovered from P needs each
    query's lse again next to the dPsum values). Measured on the H200 (bench/RESULTS.md, 2026-12-01, sixth session):
    0.97-1.00x the 64-row tiles with the derivative in registers, which do not spill; the 128-row tiles are kept so
    that a capped call shares the uncapped calls' tiles (the ring's shared query side has one). And the causal
    hdim-64 backward on the persistent grid (the default for short sequences), whose tile loop keeps a few values
    beside the 128-row tiles' registers: 16 bytes, 24 with the dK / dV TMA stores (bench/RESULTS.md, thirteenth
    session: +6-10% against one CTA per tile, +5% for the TMA stores, spills included). And, at hdim 128, the causal
    kernels on the persistent grid with their step's vectors read early: 4 bytes, 12 in the split variant of few-wave
    launches (fourteenth session, deterministic: +3-6% at 1k; fifty-sixth, non-deterministic: +2-4% at 1k-8k and 0 to
    +1.6% split, the spills included). And the causal hdim-64 kernel of one CTA per tile with the dK / dV TMA stores
    (long sequences, deterministic or not): 4 bytes since those stores came in (thirteenth session, measured with
    it); Nsight Compute counts one spill store and one load per warp and CTA, outside the step loop (seventeenth
    session). And the soft-capped hdim-128 backward with the cap's derivative in registers
    (backward.default_softcap_grad_regs): 8 bytes causal, 16 on the persistent grid, 20-32 deterministic causal or
    windowed, none non-causal; measured with them on the H200 (bench/RESULTS.md, twentieth session: +6% causal at 4k
    and 16k with 8 bytes; 2026-12-01: +3-5% with 20-36). And the deterministic hdim-96 work list: 8 bytes (the item
    table's reads beside the tickets; thirty-first session, compiled only)."""
    if main.head_dim == 96 and main.worklist and main.deterministic:
        return 8
    if main.softcap > 0 and main.head_dim == 64 and main.tile_m == 128:
        return 64
    if main.softcap > 0 and main.head_dim == 128 and main.softcap_grad_regs:
        return 32
    if main.early_vectors and main.causal and main.persistent_ctas > 0:
        return 12 if main.split_keys else 4  # the causal kernels of short sequences (backward.default_early_vectors)
    dense_fresh = main.tma_store_dkv and not (main.accumulate or main.varlen or main.dq_fixed)  # (the TMA stores)
    if main.causal and main.head_dim == 64 and main.tile_m == 128 and dense_fresh and not main.persistent_ctas:
        return 4
    return 32 if main.causal and main.head_dim == 64 and main.tile_m == 128 and main.persistent_ctas > 0 else 0


@pytest.mark.cute
@pytest.mark.parametrize("layout", ["dense", "varlen", "worklist"])
def test_compile_preprocess_with_the_lse_gradient(layout, tmp_path, monkeypatch):
    """dlse= (the lse's gradient) joins the preprocess's row sums: a variant of its own that reads one more fp32
    vector in lse's layout (more scalar loads than the plain one); the main kernel and convert unchanged.  The
    work-list backward's own preprocess (its rows from the item table) takes it too."""
    monkeypatch.chdir(tmp_path)
    kw = dict(causal=True, varlen=layout != "dense", seg_offsets=False, accumulate=layout == "worklist",
              deterministic=False, dq_dtype=torch.float32 if layout == "worklist" else BF16,
              dkv_dtype=torch.float32 if layout == "worklist" else BF16, o_dtype=BF16, do_dtype=BF16,
              worklist=layout == "worklist")
    plain, with_dlse = (bwd.make_configs(BF16, 128, **kw, dlse=flag) for flag in (False, True))
    assert with_dlse[0].dlse and not plain[0].dlse and with_dlse[1:] == plain[1:]
    ptx = {cfg.dlse: host.compile_config(cfg, extra_options="--keep-ptx").artifacts.PTX
           for cfg in (plain[0], with_dlse[0])}
    assert ".target sm_90a" in ptx[True]
    loads = {flag: len(re.findall(r"ld\.global\.b32", text)) for flag, text in ptx.items()}  # (scalar loads)
    assert loads[True] > loads[False], loads


@pytest.mark.cute
def test_persistent_grid_takes_a_counter(monkeypatch):
    """Off for a call whose key length is not given; asked for, the launch passes a tile counter; a deterministic
    grid larger than the SM count is refused (its tickets need every CTA resident), before any kernel runs."""
    main = _configs(SUBSET[0])[1]
    assert main.persistent_ctas == 0 and not main.takes_tile_counter
    assert bwd._FIELDS["persistent_ctas"]("132") == 132
    pers = bwd.make_configs(BF16, 128, causal=True, varlen=False, seg_offsets=False, accumulate=False,
                            deterministic=True, dq_dtype=BF16, dkv_dtype=BF16, o_dtype=BF16, do_dtype=BF16,
                            persistent_ctas=132)[1]
    assert pers.takes_tile_counter and pers.build().persistent
    assert len(pers.fake_args()) == len(main.fake_args())  # the counter's slot is None without it
    monkeypatch.setattr(host, "_SM_COUNT", [132])
    q, k, v, dout = (torch.randn(1, 256, 2, 128, dtype=BF16) for _ in range(4))
    lse = torch.zeros(1, 2, 256)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="persistent_ctas=133 exceeds the 132 SMs"):
        bwd.launch_steps(dout, q, k, v, q, lse, *grads, causal=True, deterministic=True, persistent_ctas=133)


@pytest.mark.cute
def test_persistent_grid_is_the_default_for_short_fresh_gradients(monkeypatch):
    """Calls that write fresh dq, dk and dv (deterministic or not) on key sequences of at most
    PERSISTENT_MAX_SEQLEN_K tokens (dense non-deterministic: PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET; dense
    causal at hdim 64 without a window or a cap: any length, deterministic up to
    PERSISTENT_MAX_SEQLEN_K_DENSE_DET_CAUSAL) run on a grid of the SM count
    (backward.default_persistent_ctas); longer or unknown lengths, merges, one-gradient calls, work lists and the
    fixed-point dQ keep one CTA per tile; asking wins."""
    monkeypatch.setattr(host, "_SM_COUNT", [114])
    limit = bwd.PERSISTENT_MAX_SEQLEN_K

    def ctas(max_seqlen_k=1024, accumulate=False, deterministic=False, head_dim=64, causal=True, **kw):
        grads = FP32 if accumulate else BF16
        varlen = kw.pop("varlen", True)
        return bwd.make_configs(BF16, head_dim, causal=causal, varlen=varlen, seg_offsets=False,
                                accumulate=accumulate, deterministic=deterministic, dq_dtype=grads,
                                dkv_dtype=grads, o_dtype=BF16, do_dtype=BF16, max_seqlen_k=max_seqlen_k,
                                **kw)[1].persistent_ctas

    assert ctas() == ctas(max_seqlen_k=limit) == ctas(deterministic=True) == 114
    for kw in (dict(max_seqlen_k=limit + 1), dict(max_seqlen_k=None), dict(accumulate=True),
               dict(accumulate=True, grads="dq"), dict(accumulate=True, worklist=True),
               dict(accumulate=True, dq_fixed=True), dict(persistent_ctas=0)):
        assert ctas(**kw) == 0, kw
    assert ctas(max_seqlen_k=None, persistent_ctas=100) == 100
    # dense non-deterministic calls up to PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET keys (measured to 8k)
    dense_limit = bwd.PERSISTENT_MAX_SEQLEN_K_DENSE_NONDET
    for head_dim, causal in ((64, False), (128, True), (128, False)):
        assert ctas(max_seqlen_k=dense_limit, varlen=False, head_dim=head_dim, causal=causal) == 114
        assert ctas(max_seqlen_k=dense_limit + 1, varlen=False, head_dim=head_dim, causal=causal) == 0
    assert ctas(max_seqlen_k=limit + 1, varlen=False, deterministic=True, head_dim=128) == 0
    assert ctas(max_seqlen_k=limit + 1, varlen=False, deterministic=True, causal=False) == 0
    # dense deterministic causal at hdim 64 with a plain mask up to PERSISTENT_MAX_SEQLEN_K_DENSE_DET_CAUSAL keys
    det_limit = bwd.PERSISTENT_MAX_SEQLEN_K_DENSE_DET_CAUSAL
    assert ctas(max_seqlen_k=det_limit, varlen=False, deterministic=True) == 114
    assert ctas(max_seqlen_k=det_limit + 1, varlen=False, deterministic=True) == 0
    assert ctas(max_seqlen_k=limit + 1, varlen=False, deterministic=True, window_left=4096) == 0
    # ... and at any length causal at hdim 64 with a plain mask (measured to 32k)
    assert ctas(max_seqlen_k=32768, varlen=False) == 114
    for mask in (dict(window_left=4096), dict(softcap=30.0)):
        assert ctas(max_seqlen_k=dense_limit + 1, varlen=False, **mask) == 0, mask

    # launch_steps passes the key length: a dense call's own, a packed call's max_seqlen_k
    seen = []
    monkeypatch.setattr(bwd, "make_configs", lambda *a, **kw: seen.append(kw["max_seqlen_k"]) or 1 / 0)
    q, k, v, dout = (torch.randn(2, 300, 2, 64, dtype=BF16) for _ in range(4))
    lse = torch.zeros(2, 2, 300)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for kw in (dict(), dict(cu_seqlens_q=torch.tensor([0, 100, 600], dtype=torch.int32),
                            cu_seqlens_k=torch.tensor([0, 100, 600], dtype=torch.int32), max_seqlen_k=500)):
        packed = "max_seqlen_k" in kw
        args = [t.flatten(0, 1) if packed else t for t in (dout, q, k, v, q)]
        with pytest.raises(ZeroDivisionError):
            bwd.launch_steps(*args, lse.permute(1, 0, 2).flatten(1) if packed else lse,
                             *[g.flatten(0, 1) if packed else g for g in grads], causal=True, **kw)
    assert seen == [300, 500]


@pytest.mark.cute
def test_rotated_deterministic_order_is_the_default_for_fresh_non_causal_gradients(monkeypatch):
    """A deterministic non-causal backward that writes fresh dq, dk and dv takes the rotated order on sequences of
    up to half the SMs' key tiles; causal calls, merges (the ring's steps, cp_invariant's passes), one-gradient
    calls, work lists and det_chunk keep the ascending order (backward.default_det_resident); asking wins."""
    monkeypatch.setattr(host, "_SM_COUNT", [132])

    def resident(causal=False, accumulate=False, deterministic=True, **kw):
        grads = FP32 if accumulate else BF16
        return bwd.make_configs(BF16, 128, causal=causal, varlen=False, seg_offsets=False, accumulate=accumulate,
                                deterministic=deterministic, dq_dtype=grads, dkv_dtype=grads, o_dtype=BF16,
                                do_dtype=BF16, **kw)[1].det_resident

    assert resident() == 66
    assert resident(persistent_ctas=100) == 50  # on the persistent grid, half its CTAs
    for kw in (dict(causal=True), dict(accumulate=True), dict(deterministic=False), dict(det_chunk=8),
               dict(accumulate=True, grads="dq"), dict(accumulate=True, worklist=True), dict(det_resident=False)):
        assert resident(**kw) == 0, kw
    assert resident(causal=True, det_resident=True) == 66


def test_shared_memory_past_a_ctas_share_is_refused_at_compile_time():
    """Every kernel's shared-storage struct is checked against the 227 KB a Hopper CTA may use when it is compiled
    (the hdim-64 fixed-point dQ backward takes exactly that much: 40 more bytes would fail every launch)."""
    import cutlass
    import cutlass.cute as cute

    from fa4dist.kernels.cute.common_sm90 import SMEM_BYTES, check_smem

    def storage(extra_bytes):
        fields = dict(tiles=cute.struct.Align[cute.struct.MemRange[cutlass.Int64, (SMEM_BYTES - 1024) // 8], 1024])
        if extra_bytes:
            fields["more"] = cute.struct.MemRange[cutlass.Int8, 1024 + extra_bytes]
        return cute.struct(type("S", (), {"__annotations__": fields}))

    check_smem(storage(0))
    # (a struct's size rounds up to its largest alignment, here a whole 1 KB more)
    with pytest.raises(ValueError, match=f"shared memory {SMEM_BYTES + 1024} bytes exceeds the {SMEM_BYTES}"):
        check_smem(storage(8))


def test_configs_are_hashable_cache_keys():
    a = _configs(SUBSET[0])
    b = _configs(SUBSET[0])
    c = _configs(SUBSET[1])
    assert a == b and hash(a) == hash(b) and a[1] != c[1]


def test_entry_point_imports_without_cutlass():
    # `import fa4dist` must keep working without cutlass: the entry point imports it lazily
    import subprocess
    import sys

    code = (
        "import sys; import fa4dist.kernels.cute.backward as b; "
        "assert not any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules), 'cutlass imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_early_vectors_default_scope():
    """The step's lse2 / dPsum read early (BwdConfig.early_vectors) by default where it measured faster: hdim 128
    (64-row query tiles), dense fresh calls with all gradients, causal or not (non-deterministic causal since the
    fifty-sixth session, beside the ascending order), no soft-cap; the ring's merges, packed calls, one-gradient
    calls, the fixed-point dQ and work lists keep the loads at their use. Its bits are the same either way (the GPU
    test compares them)."""
    def main(d=128, causal=False, det=False, **kw):
        return bwd.make_configs(BF16, d, causal=causal, varlen=kw.pop("varlen", False), seg_offsets=False,
                                accumulate=kw.pop("accumulate", False), deterministic=det, dq_dtype=BF16,
                                dkv_dtype=BF16, o_dtype=BF16, do_dtype=BF16, **kw)[1]

    assert main().early_vectors and main(det=True).early_vectors and main(causal=True, det=True).early_vectors
    assert main(causal=True).early_vectors and main(causal=True, window_left=4096).early_vectors
    assert main(max_seqlen_k=1024).early_vectors and main(causal=True, max_seqlen_k=1024).early_vectors  # persistent
    for off in (main(d=64), main(softcap=30.0), main(varlen=True), main(accumulate=True),
                main(grads="dq", accumulate=True), main(dq_fixed=True, accumulate=True, det=True),
                main(varlen=True, accumulate=True, worklist=True)):
        assert not off.early_vectors, off


def test_interleaved_key_tiles_default_scope():
    """Long and short key tiles alternate in the launch order (BwdConfig.interleave_lengths) by default for dense
    causal non-deterministic calls writing fresh gradients of at most INTERLEAVE_MAX_SEQLEN_K keys, without a
    window (measured faster there); longer sequences, deterministic, packed, merging, one-gradient and windowed
    calls keep their orders; an override wins, and the kernel's rule (causal, not deterministic) holds for it."""
    def main(causal=True, det=False, **kw):
        kw.setdefault("max_seqlen_k", 1024)
        return bwd.make_configs(BF16, 128, causal=causal, varlen=kw.pop("varlen", False), seg_offsets=False,
                                accumulate=kw.pop("accumulate", False), deterministic=det, dq_dtype=BF16,
                                dkv_dtype=BF16, o_dtype=BF16, do_dtype=BF16, **kw)[1]

    n = bwd.INTERLEAVE_MAX_SEQLEN_K
    assert main().interleave_lengths and main(max_seqlen_k=1).interleave_lengths
    for off in (main(max_seqlen_k=n + 1), main(max_seqlen_k=None), main(causal=False), main(det=True),
                main(varlen=True), main(accumulate=True), main(grads="dq", accumulate=True),
                main(window_left=100), main(interleave_lengths=False), main(det=True, interleave_lengths=True),
                main(causal=False, interleave_lengths=True)):
        assert not off.interleave_lengths, off
    assert main(max_seqlen_k=4096, interleave_lengths=True).interleave_lengths


def test_deterministic_gqa_takes_expanded_heads_where_measured_faster():
    # the cute backward's deterministic GQA dQ: K / V expanded per query head for long causal calls (16k keys at
    # hdim 128, 32k at hdim 64), the GQA tickets elsewhere: without GQA, non-causal, shorter, or of unknown length
    form = bwd.deterministic_gqa_form
    assert form(4, 128, True, 16384) == form(8, 64, True, 32768) == "expanded"
    assert form(1, 128, True, 65536) == form(4, 128, False, 65536) == form(4, 128, True, 16383) == "tickets"
    assert form(4, 64, True, 16384) == form(4, 128, True, None) == form(4, 96, True, 65536) == "tickets"


@pytest.mark.cute
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("form", ["fp32", "varlen", "worklist", "fixed", "fixed_to_float"])
def test_compile_accumulating_convert_adds_rows_in_bulk(d, form, tmp_path, monkeypatch):
    """An accumulating dQ convert stages its fragments in smem and adds each row with one bulk reduction (f32, or
    u64 for the fixed point's integers), with no global load or store of dq by the SM; a written one does not."""
    from fa4dist.kernels.cute.backward import PostConfig

    monkeypatch.chdir(tmp_path)
    fixed, to_float = form in ("fixed", "fixed_to_float"), form == "fixed_to_float"
    kw = dict(dtype="bf16", dq_fp32=True, head_dim=d, tile_m=bwd.tile_m_for(d), dq_fixed=fixed,
              varlen=form in ("varlen", "worklist"), fixed_to_float=to_float, worklist=form == "worklist")
    ptx = host.compile_config(PostConfig(accumulate=True, **kw), extra_options="--keep-ptx").artifacts.PTX
    add = "u64" if fixed and not to_float else "f32"
    assert f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.{add}" in ptx
    assert "st.global" not in ptx and "red.global" not in ptx
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
    if not fixed:
        written = host.compile_config(PostConfig(accumulate=False, **kw), extra_options="--keep-ptx").artifacts.PTX
        assert "cp.reduce.async.bulk" not in written and "st.global" in written


@pytest.mark.cute
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("finite_only", [False, True])
def test_compile_row_absmax(d, finite_only, tmp_path, monkeypatch):
    """The fixed-point scales' row maxima kernel (cute/row_absmax.py): 16-byte loads, a shuffle reduction over the
    row's threads, the finite-only select against inf's bits."""
    from fa4dist.kernels.cute.row_absmax import RowAbsMaxConfig

    monkeypatch.chdir(tmp_path)
    ptx = host.compile_config(RowAbsMaxConfig(d, "bf16", finite_only), extra_options="--keep-ptx").artifacts.PTX
    assert ".target sm_90a" in ptx and "ld.global.v4" in ptx
    assert ptx.count("shfl.sync.bfly") == (d // 8).bit_length() - 1
    assert ("32640" in ptx) == finite_only  # bf16 inf's bits, 0x7f80


@pytest.mark.cute
@pytest.mark.parametrize("sources", [1, 3, 8])
def test_compile_sum_into(sources, tmp_path, monkeypatch):
    """The ring backward's fused sum of returned partials (cute/sum_into.py): one 16-byte load per source and one of
    dst, one store, and the adds left to right (no fma, no other order)."""
    from fa4dist.kernels.cute.sum_into import SumIntoConfig

    monkeypatch.chdir(tmp_path)
    ptx = host.compile_config(SumIntoConfig(sources), extra_options="--keep-ptx").artifacts.PTX
    assert ".target sm_90a" in ptx
    assert ptx.count("ld.global.v4") == sources + 1 and ptx.count("st.global.v4") == 1
    assert ptx.count("add.f32") == 4 * sources and "fma" not in ptx


@pytest.mark.cute
def test_compile_row_dot(tmp_path, monkeypatch):
    """The sinks' gradient's row dot kernel (cute/row_dot.py): two 16-byte loads per thread, shuffle reductions over
    the row's threads (two maxima, one sum), the power-of-two factors from the maxima's exponent bits."""
    from fa4dist.kernels.cute.row_dot import RowDotConfig

    monkeypatch.chdir(tmp_path)
    ptx = host.compile_config(RowDotConfig(128), extra_options="--keep-ptx").artifacts.PTX
    assert ".target sm_90a" in ptx and ptx.count("ld.global.v4") == 2
    assert ptx.count("shfl.sync.bfly") == 3 * 4  # 16 threads per row: 4 steps, three reductions


def test_a_repeated_call_reuses_its_configs_and_kernels(monkeypatch):
    """launch_steps' configs and compiled kernels are remembered per distinct call (no make_configs or compile
    cache lookups on a repeat), never under a measurement knob, and forgotten when a knob is set."""
    compiled = []
    monkeypatch.setattr(host, "get_compiled", lambda cfg: compiled.append(cfg) or cfg)
    monkeypatch.setattr(bwd, "_FAST", {})
    kw = dict(causal=True, varlen=False, seg_offsets=False, accumulate=False, deterministic=False, dq_dtype=BF16,
              dkv_dtype=BF16, o_dtype=BF16, do_dtype=BF16, window_left=-1, softcap=0.0, grads="all",
              dq_fixed=False, fixed_to_float=False, max_seqlen_k=1024)
    first = bwd._compiled_configs((BF16, 128), kw, {}, shared=False, device="cuda:0")
    assert len(compiled) == 3 and set(first[3:]) == set(compiled) == set(first[:3])
    assert bwd._compiled_configs((BF16, 128), dict(kw), {}, shared=False, device="cuda:0") is first
    assert len(compiled) == 3
    # another call's options, the shared rows' main kernel alone, and a measurement knob each build their own
    other = bwd._compiled_configs((BF16, 128), dict(kw, max_seqlen_k=65536), {}, shared=False, device="cuda:0")
    assert other is not first and len(compiled) == 6
    shared = bwd._compiled_configs((BF16, 128), dict(kw, max_seqlen_k=None), {}, shared=True, device="cuda:0")
    assert shared[3] is None and shared[5] is None and len(compiled) == 7
    knob = bwd._compiled_configs((BF16, 128), kw, {"persistent_ctas": 0}, shared=False, device="cuda:0")
    assert knob[1].persistent_ctas == 0 and len(compiled) == 10
    assert bwd._compiled_configs((BF16, 128), kw, {"persistent_ctas": 0}, shared=False, device="cuda:0") is not knob
    bwd.set_override(stmatrix_ds=False)
    try:
        assert not bwd._FAST
        assert not bwd._compiled_configs((BF16, 128), kw, {}, shared=False, device="cuda:0")[1].stmatrix_ds
    finally:
        bwd.set_override()


def test_nondeterministic_gqa_form_expands_launches_of_few_kv_tiles():
    """backward.nondeterministic_gqa_form: K / V expanded per query head when the GQA launch's CTAs (key tile, kv
    head, each walking the group) leave SMs idle or end on the group's longest CTAs, and the expanded launch with
    the expansion's cost comes to at most GQA_EXPAND_MAX_RATIO of the GQA launch's time; never without a group. The
    cases measured (bench/RESULTS.md, thirty-second session: one kv head of 4 query heads, batch 1) come out as
    measured. _kv_tiles counts the CTAs (packed: at most)."""
    form = bwd.nondeterministic_gqa_form
    assert form(1, 10, 132) == "gqa" and form(4, 0, 132) == "gqa"
    # non-causal 4k / 8k: 2.4x / 1.5x expanded; 16k: 0.96x
    assert form(4, 32, 132, False, 32) == "expanded" and form(4, 64, 132, False, 64) == "expanded"
    assert form(4, 128, 132, False, 128) == "gqa"
    # causal 4k / 8k / 16k: 2.6x / 2.05x / 1.58x expanded
    for n in (32, 64, 128):
        assert form(4, n, 132, True, n) == "expanded", n
    assert form(4, 8 * 128, 132, True, 128) == "gqa"  # 8 kv heads (Llama-3-8B at 16k): the SMs are full
    assert form(4, 512, 132) == "gqa" and form(8, 128, 132) == "gqa" and form(2, 100, 132) == "gqa"
    k = torch.empty(2, 1000, 3, 64)
    assert bwd._kv_tiles(k, None) == 2 * 3 * 8
    assert bwd._kv_tiles(torch.empty(1000, 3, 64), torch.tensor([0, 300, 1000])) == 3 * (1000 // 128 + 2)


def test_split_keys_scope_and_plan():
    """backward.split_keys_variant: the non-deterministic dense calls writing fresh 16-bit dK / dV through TMA
    stores with every gradient, on the persistent grid; none for deterministic, packed, merging, windowed,
    fp32-gradient, one-gradient or fixed-point calls. split_plans.split_keys_plan splits the longest key tiles of
    causal launches under two waves where the simulated claims say it pays, in whole rows (every (batch, kv
    head)'s n-th key tile), never for two waves or more; a non-causal launch splits its last partial wave
    (split_plans.split_plan)."""
    from fa4dist.kernels.cute import split_plans

    def main(**kw):
        kw = dict(dict(causal=True, varlen=False, seg_offsets=False, accumulate=False, deterministic=False,
                       dq_dtype=BF16, dkv_dtype=BF16, o_dtype=BF16, do_dtype=BF16), **kw)
        return bwd.make_configs(BF16, 128, **kw)[1]

    split = bwd.split_keys_variant(main(max_seqlen_k=16384))
    assert split.split_keys and split.persistent_ctas == host.sm_count() and not split.interleave_lengths
    assert bwd.split_keys_variant(main(softcap=30.0)) is not None
    assert bwd.split_keys_variant(main(causal=False)) is not None
    for kw in (dict(deterministic=True), dict(varlen=True), dict(window_left=100),
               dict(accumulate=True, dq_dtype=FP32, dkv_dtype=FP32), dict(dkv_dtype=FP32),
               dict(accumulate=True, dq_dtype=FP32, dkv_dtype=FP32, grads="dq"), dict(dq_fixed=True)):
        assert bwd.split_keys_variant(main(**kw)) is None, kw
    plan = split_plans.split_keys_plan
    assert plan(4, 1, 4096, 4096, 0, 64, 128, 132) == (112, 2)  # 4 heads of 32 key tiles: 28 rows in halves
    assert plan(1, 1, 16384, 16384, 0, 64, 128, 132) == (124, 2)
    assert plan(8, 1, 4096, 4096, 0, 64, 128, 132) == (0, 1)  # two waves
    assert plan(4, 1, 4096, 4096, -5000, 64, 128, 132) == (0, 1)  # no key tile has work
    for heads in (1, 2, 3, 5):
        for group in (1, 4):
            for s in (1000, 4000, 8192):
                edge, parts = plan(heads, group, s, s, 0, 64, 128, 132)
                assert 1 <= parts <= split_plans.SPLIT_MAX_PARTS and (parts == 1) == (edge == 0)
                assert edge % heads == 0 and edge <= heads * -(-s // 128)
                if parts > 1:  # the shortest split key tile still gives parts of the minimum length
                    n = edge // heads - 1
                    assert group * (-(-s // 64) - n * 128 // 64) >= parts * split_plans.SPLIT_MIN_PART_BLOCKS
    cfg = main(max_seqlen_k=4096)
    assert bwd.dense_split_keys_plan(cfg, (1, 4096, 4, 128), (1, 4096, 4, 128), 0) == (112, 2)
    assert bwd.split_key_tile_count(cfg, (1, 4096, 4, 128), (112, 2)) == 112
    full = main(causal=False, max_seqlen_k=4096)  # 5 heads of 32 key tiles: the 28 past the first wave in quarters
    assert bwd.dense_split_keys_plan(full, (1, 4096, 5, 128), (1, 4096, 5, 128), 0) == (132, 4)
    assert bwd.split_key_tile_count(full, (1, 4096, 5, 128), (132, 4)) == 28
    assert bwd.dense_split_keys_plan(full, (1, 4096, 16, 128), (1, 4096, 16, 128), 0)[1] == 1  # 512: 3.9 waves


def test_lpt_over_heads_scope():
    """backward.over_heads_group: dense causal non-deterministic launches of at most 8 waves of key tiles whose
    query-side streams fit 128 MB take every head's longest key tile first (group 0), larger launches at hdim 128 so
    within groups of 4 (batch, kv head) pairs (lpt_over_heads_variant); deterministic, non-causal and packed calls
    keep the head-major order (None), short sequences their interleaved one."""
    def main(**kw):
        kw = dict(dict(causal=True, varlen=False, seg_offsets=False, accumulate=False, deterministic=False,
                       dq_dtype=BF16, dkv_dtype=BF16, o_dtype=BF16, do_dtype=BF16), **kw)
        return bwd.make_configs(BF16, kw.pop("d", 128), **kw)[1]

    def shapes(b, s, h, hk=None, d=128):
        return (b, s, h, d), (b, s, hk or h, d)

    cfg = main(max_seqlen_k=4096)
    assert not cfg.lpt_over_heads and bwd.lpt_over_heads_variant(cfg, 0).lpt_over_heads
    grouped = bwd.lpt_over_heads_variant(cfg, 4)
    assert grouped.lpt_over_heads and grouped.lpt_group == 4
    assert bwd.over_heads_group(cfg, *shapes(1, 4096, 8)) == 0  # 256 key tiles, 32 MB
    assert bwd.over_heads_group(cfg, *shapes(1, 4096, 32)) == 0  # 1024 key tiles, 128 MB
    assert bwd.over_heads_group(cfg, *shapes(4, 4096, 16)) == 4  # 2048 key tiles, 256 MB
    assert bwd.over_heads_group(cfg, *shapes(1, 16384, 16)) == 4
    assert bwd.over_heads_group(cfg, *shapes(1, 65536, 4)) is None  # one group of every pair: head-major kept
    assert bwd.over_heads_group(main(d=64, max_seqlen_k=4096), *shapes(4, 4096, 32, d=64)) is None  # (unmeasured)
    assert bwd.over_heads_group(cfg, *shapes(1, 8192, 32, hk=8)) == 4  # GQA: 512 key tiles, 256 MB of queries
    assert bwd.over_heads_group(cfg, *shapes(1, 8192, 16, hk=4)) == 0  # 256 key tiles, 128 MB
    for kw in (dict(deterministic=True), dict(causal=False), dict(varlen=True)):
        assert bwd.over_heads_group(main(max_seqlen_k=4096, **kw), *shapes(1, 4096, 8)) is None, kw
    # the knob itself: packed and deterministic configs take it, work lists and non-causal calls do not
    assert main(varlen=True, max_seqlen_k=4096, lpt_over_heads=True).lpt_over_heads
    assert main(deterministic=True, max_seqlen_k=4096, lpt_over_heads=True).lpt_over_heads
    assert not main(causal=False, max_seqlen_k=4096, lpt_over_heads=True).lpt_over_heads
    assert not main(varlen=True, worklist=True, max_seqlen_k=4096, lpt_over_heads=True).lpt_over_heads
    short = main(max_seqlen_k=1024)  # (the interleaved order of short sequences stays)
    assert short.interleave_lengths and bwd.over_heads_group(short, *shapes(1, 1024, 8)) is None


@pytest.mark.parametrize("heads_per_group", [0, 1, 2, 4, 5])
@pytest.mark.parametrize("shortest_first", [False, True], ids=["longest", "shortest"])
def test_over_heads_launch_orders(monkeypatch, heads_per_group, shortest_first):
    """tile_scheduler.bwd_work_tile's order over heads (BwdConfig.lpt_over_heads, lpt_group): a permutation of the
    (key tile, kv head, batch) tiles; within each group of heads every head's key tile j before any head's j + 1
    (longest first: key tile j; mirrored: key tile n - 1 - j), the groups one after another; mirrored, every key
    tile after the higher key tiles of its head (the deterministic tickets' waits stay on earlier launches). The
    decode's arithmetic in plain Python (cute.size and cutlass.min stand-ins)."""
    from types import SimpleNamespace

    import cutlass
    import cutlass.cute as cute

    from fa4dist.kernels.cute import tile_scheduler

    monkeypatch.setattr(cute, "size", lambda x: x)
    monkeypatch.setattr(cutlass, "min", min)
    n_blocks, heads_kv, batch = 5, 3, 2
    m_q, m_k = SimpleNamespace(shape=(640, 64, 6, batch)), SimpleNamespace(shape=(640, 64, heads_kv, batch))
    order = []
    for bid in range(n_blocks * heads_kv * batch):
        t = tile_scheduler.bwd_work_tile(m_q, m_k, n_blocks, batch, shortest_first=shortest_first, det_chunk=0,
                                         tile_idx=bid, longest_first_over_heads=True, heads_per_group=heads_per_group)
        order.append((t.block, t.batch * heads_kv + t.head_kv))
    assert sorted(order) == sorted((n, hb) for n in range(n_blocks) for hb in range(heads_kv * batch))
    group = heads_per_group or heads_kv * batch
    for i, (n, hb) in enumerate(order):
        assert hb // group == order[i - 1][1] // group or hb // group == order[i - 1][1] // group + 1 or i == 0
        j = n_blocks - 1 - n if shortest_first else n
        earlier = [(n2, hb2) for n2, hb2 in order[:i] if hb2 // group == hb // group]
        assert all((n_blocks - 1 - n2 if shortest_first else n2) <= j for n2, _ in earlier)
        if shortest_first:
            assert all((n2, hb) in order[:i] for n2 in range(n + 1, n_blocks))
