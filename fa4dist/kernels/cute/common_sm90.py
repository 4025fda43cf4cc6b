"""Device-side helpers shared by the Hopper forward and backward kernels (fwd_sm90.py, bwd_*.py): inline PTX,
smem layouts and accumulator views, the wgmma issue loop, TMA partitions and pipeline setup.

This module imports cutlass at import time: import it lazily.
"""

import dataclasses
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import Boolean, T, dsl_user_op, if_generate
from cutlass.tensor_utils import LayoutEnum

_CONTEXT_TYPES: dict = {}


def Context(**values):
    """Trace-time values bound once per tile (operands, accumulators, pipelines, mask, softmax), handed to the
    step functions as one argument: an instance of a frozen dataclass with these fields. The DSL passes frozen
    dataclasses through dynamic control flow as read-only constants, so only tensors (written in place) and
    values fixed for the tile belong here; anything a dynamic loop updates (a pipeline state) stays an explicit
    loop-carried value."""
    names = tuple(values)
    cls = _CONTEXT_TYPES.get(names)
    if cls is None:
        cls = dataclasses.make_dataclass("Context", names, frozen=True)
        _CONTEXT_TYPES[names] = cls
    return cls(**values)


def extend_context(ctx, **values):
    """A Context with ``ctx``'s fields and ``values`` (per-tile values added to per-CTA ones bound once)."""
    return Context(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}, **values)


# ----------------------------------------------------------------------------
# inline PTX
# ----------------------------------------------------------------------------


@dsl_user_op
def bulk_reduce_add_f32(smem_ptr, gmem_ptr, num_bytes, *, loc=None, ip=None):
    """cp.reduce.async.bulk (non-tensor) fp32 add of `num_bytes` contiguous bytes smem -> gmem.

    Issue from a single thread; completion is tracked by that thread's bulk async-groups."""
    _bulk_reduce_add("f32", smem_ptr, gmem_ptr, num_bytes, loc=loc, ip=ip)


@dsl_user_op
def bulk_reduce_add_u64(smem_ptr, gmem_ptr, num_bytes, *, loc=None, ip=None):
    """As bulk_reduce_add_f32 for 64-bit integers (two's complement: signed sums too): the fixed-point dQ."""
    _bulk_reduce_add("u64", smem_ptr, gmem_ptr, num_bytes, loc=loc, ip=ip)


def _void_asm(asm: str, constraints: str, operands: list) -> None:
    """One PTX instruction with side effects and no result."""
    llvm.inline_asm(None, operands, asm, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


def _bulk_reduce_add(kind, smem_ptr, gmem_ptr, num_bytes, *, loc=None, ip=None):
    s = smem_ptr.toint(loc=loc, ip=ip).ir_value()
    g = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
    _void_asm(f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.{kind} [$0], [$1], $2;", "l,r,r",
              [g, s, Int32(num_bytes).ir_value(loc=loc, ip=ip)])


@dsl_user_op
def prefetch_l2_bulk(gmem_ptr, num_bytes, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2: ask L2 for `num_bytes` (a multiple of 16) contiguous bytes at a 16-byte aligned
    address; a hint with no completion to wait for."""
    _void_asm("cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
              [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(num_bytes).ir_value(loc=loc, ip=ip)])


@dsl_user_op
def prefetch_l2(gmem_ptr, *, loc=None, ip=None):
    """prefetch.global.L2: ask L2 for the line holding one address (any alignment)."""
    _void_asm("prefetch.global.L2 [$0];", "l", [gmem_ptr.toint(loc=loc, ip=ip).ir_value()])


def _f32_asm(asm: str, operands: list, *, loc=None, ip=None) -> cutlass.Float32:
    res = llvm.inline_asm(T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in operands], asm,
                          "=f" + ",f" * len(operands), has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return cutlass.Float32(res)


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> cutlass.Float32:
    """a * b + c rounded once (fma.rn.f32), whatever the surrounding code: ptxas fuses a plain mul and add by its
    own choice, which can differ between two kernels compiled from one source."""
    return _f32_asm("fma.rn.f32 $0, $1, $2, $3;", [a, b, c], loc=loc, ip=ip)


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> cutlass.Float32:
    """a * b rounded on its own (mul.rn.f32: never fused into a following add)."""
    return _f32_asm("mul.rn.f32 $0, $1, $2;", [a, b], loc=loc, ip=ip)


@dsl_user_op
def cvt_pack_16x2(lo, hi, dtype, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to nearest into one register of 16-bit pairs (cvt.rn.bf16x2.f32 / .f16x2, ``lo`` in
    the low half): the instruction ``.to(dtype)`` lowers to, so the same bits."""
    op = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    val = llvm.inline_asm(T.i32(), [cutlass.Float32(hi).ir_value(loc=loc, ip=ip),
                                    cutlass.Float32(lo).ir_value(loc=loc, ip=ip)],
                          f"cvt.rn.{op}.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(val)


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """dst (16-bit registers) = src (fp32, same size) rounded to nearest, one inline cvt per pair. An opaque
    instruction stays where the source puts it: LLVM moves a plain ``.to()`` of a loop-carried operand through the
    loop's phi (converting at the loop's top and carrying the fp32 values)."""
    dst_pairs = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_pairs)):
        dst_pairs[i] = cvt_pack_16x2(src[2 * i], src[2 * i + 1], dst.element_type)


@cute.jit
def to_16bit(src: cute.Tensor, dst: cute.Tensor, inline_cvt: cutlass.Constexpr[bool]):
    """dst = src rounded to nearest in dst's 16-bit type: with ``inline_cvt`` through :func:`convert_to_16bit`
    (where the source puts it), else a ``.to()`` conversion (which LLVM may move). The same bits either way."""
    if cutlass.const_expr(inline_cvt):
        convert_to_16bit(src, dst)
    else:
        dst.store(src.load().to(dst.element_type))


@cute.jit
def stage_wait(pipe, state, try_first: cutlass.Constexpr[bool]):
    """A consumer's wait for a pipeline stage: with ``try_first`` one non-blocking try, the blocking loop only if it
    failed (flash-attn-4's form: ptxas then schedules other work around the wait), else the blocking loop alone.
    The same acquire either way."""
    if cutlass.const_expr(try_first):
        pipe.consumer_wait(state, pipe.consumer_try_wait(state))
    else:
        pipe.consumer_wait(state)


def elected_lane():
    """A predicate true in one lane of the warp (``elect.sync``'s winner; taken where the warp is converged)."""
    return Boolean(nvvm.elect_sync())


def stage_release(pipe, state, winner=None):
    """A consumer warp's release of a pipeline stage (one arrival per warp). ``winner``: the arrival in the lane
    where this predicate is true (:func:`elected_lane`) instead of by the pipeline's lane-0 predicate, which comes
    from the thread index: under the forward's register pressure ptxas reads %tid again (an S2R) in every step."""
    if winner is None:
        pipe.consumer_release(state)
    else:  # (predicated as consumer_release predicates it on the lane's)
        if_generate(winner, lambda: pipe.sync_object_empty.arrive(state.index, pipe.consumer_mask))


@dsl_user_op
def true_after(x, *, loc=None, ip=None) -> Boolean:
    """True, computed from ``x`` (x >= -inf, or unordered: every float, NaN included) in inline PTX that neither
    LLVM nor ptxas folds: what it predicates is ordered after x is computed."""
    val = llvm.inline_asm(
        T.i32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; setp.geu.f32 p, $1, 0fFF800000; selp.u32 $0, 1, 0, p; }", "=r,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(val) != 0


@dsl_user_op
def ld_acquire_gpu(ptr, *, loc=None, ip=None) -> Int32:
    addr = ptr.toint(loc=loc, ip=ip).ir_value()
    val = llvm.inline_asm(
        T.i32(),
        [addr],
        "ld.global.acquire.gpu.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(val)


@dsl_user_op
def red_release_add_gpu(ptr, val, *, loc=None, ip=None) -> None:
    _void_asm("red.release.gpu.global.add.s32 [$0], $1;", "l,r",
              [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(val).ir_value(loc=loc, ip=ip)])


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    _void_asm("nanosleep.u32 $0;", "r", [Int32(ns).ir_value(loc=loc, ip=ip)])


# ----------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------


def smem_layout_kmajor(dtype, rows: int, cols: int, stages: Optional[int] = None, atom_cols: Optional[int] = None):
    """Swizzled smem layout of a (rows, cols[, stages]) tile with `cols` contiguous. The same bytes
    serve as a K-major operand (K = cols) and, through transpose_smem, as an MN-major one (MN = cols).
    ``atom_cols``: the widest swizzle atom must divide it too (an MN-major operand split into pieces of
    that width, as the backward's dQ GEMM splits K^T's head dim over its two warpgroups: dq_wg_cols)."""
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, math.gcd(cols, atom_cols or cols))
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """(a, b, ...) smem view -> (b, a, ...) view of the same bytes."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(modes)))


def acc_rows_cols(acc_layout):
    """wgmma accumulator layout ((2, 2, V), M, N) -> ((2, M), (2, V, N)): (rows, cols)."""
    cm = cute.make_layout(acc_layout.shape)
    shape = ((cm.shape[0][1], cm.shape[1]), (cm.shape[0][0], cm.shape[0][2], cm.shape[2]))
    stride = ((cm.stride[0][1], cm.stride[1]), (cm.stride[0][0], cm.stride[0][2], cm.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def mn_view(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(t.iterator, acc_rows_cols(t.layout))


def acc_to_operand_a(t: cute.Tensor) -> cute.Tensor:
    """View an accumulator ((2, 2, V), M, N) (already converted to 16 bit) as the register A operand
    ((2, 2, 2), M, (V / 2, N)) of a wgmma whose K is this accumulator's N."""
    parts = cute.logical_divide(t.layout, ((None, None, 2), None, None))
    shape = (
        (parts.shape[0][0], parts.shape[0][1], parts.shape[0][2][0]),
        parts.shape[1],
        (parts.shape[0][2][1], parts.shape[2]),
    )
    stride = (
        (parts.stride[0][0], parts.stride[0][1], parts.stride[0][2][0]),
        parts.stride[1],
        (parts.stride[0][2][1], parts.stride[2]),
    )
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def dq_wg_cols(tile_m: int, head_dim: int) -> int:
    """Head-dim columns of dQ one MMA warpgroup computes (dq_tiled_mma): all of them on 128-row query tiles,
    half on 64-row ones. A swizzle atom of the tiles staged in that fragment order (K^T, dQ) must divide it."""
    assert tile_m in (64, 128), tile_m
    return head_dim if tile_m == 128 else head_dim // 2


def dq_tiled_mma(dtype, tile_m: int, head_dim: int):
    """dQ = dS @ K over two MMA warpgroups: split along M when tile_m == 128, along the head dim
    when tile_m == 64. Shared by the main kernel and the dQ convert kernel (which needs the same
    thread -> element map to undo the fragment order of the dQ accumulator scratch)."""
    cols = dq_wg_cols(tile_m, head_dim)
    atom, tiler = ((2, 1, 1), (64, cols)) if tile_m == 128 else ((1, 2, 1), (64, cols))
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        cute.nvgpu.OperandMajorMode.K,
        cute.nvgpu.OperandMajorMode.MN,
        cutlass.Float32,
        atom_layout_mnk=atom,
        tiler_mn=tiler,
    )


# fp32 values of one warpgroup's dQ accumulator, stored as float4 per thread and per step:
# element (v, t, i) of the chunk sits at i * 512 + t * 4 + v  (t: thread in warpgroup, v < 4)
DQ_VEC = 4
DQ_THREADS = 128


def dq_chunk_layout(tile_m: int, head_dim: int, num_chunks=None):
    """(4, 128, steps, 2 warpgroups[, chunks]) layout of the fragment-ordered dQ accumulator tile."""
    per_wg = tile_m * head_dim // 2
    steps = per_wg // (DQ_VEC * DQ_THREADS)
    shape = (DQ_VEC, DQ_THREADS, steps, 2)
    stride = (1, DQ_VEC, DQ_VEC * DQ_THREADS, per_wg)
    if num_chunks is not None:
        shape = shape + (num_chunks,)
        stride = stride + (tile_m * head_dim,)
    return cute.make_layout(shape, stride=stride)


# ----------------------------------------------------------------------------
# warpgroup MMA
# ----------------------------------------------------------------------------


@cute.jit
def wgmma_gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tA: cute.Tensor,
    tB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
):
    """Issue one warpgroup GEMM (all K blocks) as one wgmma commit group; does not wait. ``tA``: the A fragment,
    or the tuple of its K-block slices (``k_slices``): sliced once before a loop, their smem descriptors are
    loop-invariant values instead of 64-bit adds in every iteration."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tB.shape[2])):
        a_k = tA[k] if isinstance(tA, tuple) else tA[None, None, k]
        cute.gemm(atom, acc, a_k, tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def k_slices(frag: cute.Tensor) -> tuple:
    """The K-block slices of an MMA operand fragment, for :func:`wgmma_gemm`."""
    return tuple(frag[None, None, k] for k in range(cute.size(frag.shape[2])))


@cute.jit
def store_acc_rows(
    acc: cute.Tensor,
    mdst: cute.Tensor,
    thr_mma,
    tile: cutlass.Constexpr,
    block: Int32,
    seqlen: Int32,
    accumulate: cutlass.Constexpr[bool],
):
    """Rows of this thread's accumulator fragment of tile `block` of mdst -> gmem, rows < seqlen only: cast to
    mdst's dtype, or (accumulate) added into mdst of the accumulator's type (fp32, or int64: fixed-point dQ)."""
    rows, cols = tile
    coords = mn_view(thr_mma.partition_C(cute.make_identity_tensor((rows, cols))))
    gdst = cute.local_tile(mdst, (rows, cols), (block, 0))
    tdst_mn = mn_view(thr_mma.partition_C(gdst))
    acc_mn = mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        if block * rows + coords[r, 0][0] < seqlen:
            if cutlass.const_expr(not accumulate):
                o = cute.make_rmem_tensor_like(acc_mn[r, None], mdst.element_type)
                o.store(acc_mn[r, None].load().to(mdst.element_type))
                cute.autovec_copy(o, tdst_mn[r, None])
            else:
                o = cute.make_rmem_tensor_like(acc_mn[r, None], acc.element_type)
                cute.autovec_copy(tdst_mn[r, None], o)
                o.store(o.load() + acc_mn[r, None].load())
                cute.autovec_copy(o, tdst_mn[r, None])


# ----------------------------------------------------------------------------
# TMA and pipelines
# ----------------------------------------------------------------------------


def tma_tile_partition(tma_atom: cute.CopyAtom, s_tile: cute.Tensor, g_tile: cute.Tensor):
    """(smem, gmem) TMA partitions of one tile (a CTA without cluster multicast): the first two modes of each
    tensor are the tile, further modes (stages, tile index) are kept."""
    return cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2), cute.group_modes(g_tile, 0, 2)
    )


@cute.jit
def store_tile_tma(tiled_mma: cute.TiledMma, frag: cute.Tensor, s_tile: cute.Tensor, tma_atom: cute.CopyAtom,
                   gmem: cute.Tensor, tile: cutlass.Constexpr, coord, tidx: Int32, barrier_id=None,
                   num_threads=None):
    """A 16-bit accumulator fragment (``tiled_mma``'s C layout) -> ``s_tile`` (stmatrix) -> one TMA store into
    tile ``coord`` of ``gmem`` (rows past its end are clipped). The barrier (``barrier_id``, ``num_threads``; None:
    the whole CTA) orders every thread's smem writes before the store; the first warp issues it and owns its bulk
    group, so it is the one to wait before ``s_tile`` is written again."""
    st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), frag.element_type)
    thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma).get_slice(tidx)
    cute.copy(st_atom, thr_st.retile(frag), thr_st.partition_D(s_tile))
    cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> TMA (async proxy)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if tidx < 32:
        s_part, g_part = tma_tile_partition(tma_atom, s_tile, cute.local_tile(gmem, tile, coord))
        cute.copy(tma_atom, s_part, g_part)
        cute.arch.cp_async_bulk_commit_group()


SMEM_BYTES = 227 * 1024  # shared memory one CTA may use on Hopper (sm_90)


def check_smem(storage, ctas_per_sm: int = 1) -> None:
    """At compile time: a kernel's shared-storage struct fits one CTA's shared memory (a struct past it would
    compile and then fail at every launch), or its share when ``ctas_per_sm`` CTAs are to be resident per SM (228
    KiB per SM, 1 KiB of it reserved per CTA)."""
    size = storage.size_in_bytes()
    limit = SMEM_BYTES if ctas_per_sm == 1 else (228 * 1024) // ctas_per_sm - 1024
    if size > limit:
        raise ValueError(f"shared memory {size} bytes exceeds the {limit} a Hopper CTA may use with {ctas_per_sm} "
                         f"CTA(s) per SM")


def tma_pipeline(barrier_storage, num_stages: int, consumer_warps: int, tx_count: int):
    """A TMA-fed ring: one producer thread arms each stage with ``tx_count`` bytes, ``consumer_warps`` warps (one
    arrival per warp) release it. The mbarriers are initialised without a CTA sync (``pipeline_init_arrive`` /
    ``pipeline_init_wait`` of the caller fence them once for all pipelines)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage,
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_count,
        defer_sync=True,
    )


@dsl_user_op
def _opaque_descriptor_word(desc, *, loc=None, ip=None) -> cutlass.Int64:
    """``desc`` OR'd with ``(%dynamic_smem_size >> 31) << 32``, which is 0 (shared memory is far below 2 GiB) but
    which neither LLVM nor ptxas can fold: the result is a value computed here, once, that the compilers can
    neither re-derive from the smem pointer at each use nor treat as a known constant in its high word."""
    asm = ("{ .reg .u32 t; .reg .b64 w; mov.u32 t, %dynamic_smem_size; shr.u32 t, t, 31; cvt.u64.u32 w, t; "
           "shl.b64 w, w, 32; or.b64 $0, $1, w; }")
    val = llvm.inline_asm(T.i64(), [cutlass.Int64(desc).ir_value(loc=loc, ip=ip)], asm, "=l,l",
                          has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return cutlass.Int64(val)


def loop_invariant_descriptors(frag: cute.Tensor) -> cute.Tensor:
    """An smem MMA operand fragment (``make_fragment_A/B`` of an smem partition) whose descriptor base is computed
    here, in the caller's setup (the forward's per tile, the backward's per CTA), instead of at every GEMM.

    The DSL lowers each use of a descriptor fragment by rebuilding the base from the smem pointer (add, shift, and,
    or); neither LLVM nor ptxas hoists that out of the key-block loop, and ptxas, seeing the constant high word,
    splits every 64-bit K-block add and rematerializes that word before each wgmma. With the base made opaque the
    step's K, Q and V descriptors are a stage offset and K-block adds on a loop-invariant value (forward, hdim 128:
    486 -> 466 instructions per step, flash-attn-4's 455; ``bench/sass_softmax.py --ops``). Same descriptors,
    same bits."""
    from cutlass.cute.nvgpu.tcgen05 import int_to_smem_descriptor, smem_descriptor_to_int

    base = _opaque_descriptor_word(smem_descriptor_to_int(frag.iterator))
    return cute.make_tensor(int_to_smem_descriptor(base), frag.layout)


def descriptor_hoister(enabled: bool):
    """:func:`loop_invariant_descriptors`, or the identity when ``enabled`` is False (the knob's off position,
    ``hoist_descriptors`` of the forward's and backward's configs)."""
    return loop_invariant_descriptors if enabled else (lambda frag: frag)
