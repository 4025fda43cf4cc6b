"""Non-finite rows of a shared-memory operand tile: detection and clearing, so that masked pairs contribute
exactly nothing (both kernels).

Inside a tile that the mask cuts, a masked probability (or dS) is exactly 0 but the tensor cores still multiply
it with the operand row of the masked key (or query): 0 x NaN = NaN would leak garbage from a masked position
into visible results. Such tiles (partial tiles only: diagonal, document boundary, sequence end) are checked in
shared memory before the MMA reads them:

  * ``tile_maybe_nonfinite``: every thread folds a strided share of the tile's 16-byte words with one packed
    FMA per 32-bit word (x * 0 + acc: stays 0 for finite x, becomes NaN for NaN / inf), then one barrier
    reduction (``block_any``) tells the whole group whether the tile holds any non-finite value. This is the
    only cost on clean data.
  * ``clear_nonfinite_rows`` (rare path): exact per-row check; rows holding a non-finite value are zeroed in
    smem and reported to the caller, which decides what the row's non-finiteness means (the forward marks the
    query rows that see the first bad key, or with a window any marked key: ``clear_nonfinite_rows_marking``; the
    backward marks a bad query row's lse NaN).

Writes are generic-proxy stores: the caller fences them (``fence.proxy.async``) before wgmma reads the tile.

This module imports cutlass at import time: import it lazily.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int16, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

NONE = 1 << 30  # "no bad row": larger than any tile index, small enough to add a block offset in int32


@dsl_user_op
def _fma_zero_x2(word, acc, *, fp16: bool, loc=None, ip=None) -> Int32:
    """acc + word * 0 on two packed 16-bit floats: 0 stays 0 for finite values, NaN for NaN / inf."""
    op = "fma.rn.f16x2" if fp16 else "fma.rn.bf16x2"
    res = llvm.inline_asm(
        T.i32(),
        [Int32(word).ir_value(loc=loc, ip=ip), Int32(acc).ir_value(loc=loc, ip=ip)],
        f"{{\n\t.reg .b32 z;\n\tmov.b32 z, 0;\n\t{op} $0, $1, z, $2;\n\t}}",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(res)


@dsl_user_op
def block_any(flag, barrier_id: int, num_threads: int, *, loc=None, ip=None) -> Boolean:
    """bar.red.or over ``num_threads`` threads (whole warps) on named barrier ``barrier_id``: True in every
    participating thread iff ``flag`` is True in one of them. Also a barrier (memory ordering among them)."""
    res = llvm.inline_asm(
        T.i32(),
        [Int32(flag).ir_value(loc=loc, ip=ip), Int32(barrier_id).ir_value(loc=loc, ip=ip),
         Int32(num_threads).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p, q;\n\tsetp.ne.b32 p, $1, 0;\n\tbar.red.or.pred q, $2, $3, p;\n\tselp.b32 $0, 1, 0, q;\n\t}",
        "=r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(res) != 0


def _exp_mask(fp16: bool) -> int:
    return 0x7C00 if fp16 else 0x7F80  # exponent bits of one 16-bit float: all set for inf and NaN


@cute.jit
def tile_maybe_nonfinite(base: cute.Pointer, tile_elems: cutlass.Constexpr[int], stage: Int32, tid: Int32,
                         num_threads: cutlass.Constexpr[int], fp16: cutlass.Constexpr[bool]) -> Boolean:
    """This thread's share of the check of one tile (``tile_elems`` 16-bit values, contiguous, stage ``stage``
    of a ring starting at smem pointer ``base``; a swizzle on it is dropped: the check reads every word of the
    tile, in any order): True if one of its words holds a NaN or inf (combine with block_any)."""
    n_vec = tile_elems // 8
    words = cute.make_tensor(cute.recast_ptr(base, dtype=Int32), cute.make_layout((4, n_vec), stride=(1, 4)))
    words = cute.domain_offset((0, stage * n_vec), words)
    acc = Int32(0)
    for v in cutlass.range(tid, n_vec, num_threads, unroll=1):
        w = cute.make_rmem_tensor((4,), Int32)
        cute.autovec_copy(words[None, v], w)
        for i in cutlass.range_constexpr(4):
            acc = _fma_zero_x2(w[i], acc, fp16=fp16)
    m = _exp_mask(fp16)
    lsb = m & -m  # lowest exponent bit
    # (x & exponent) + lowest exponent bit carries into the sign bit iff the exponent is all ones (NaN / inf);
    # the two halves cannot carry into each other
    both = (acc & ((m << 16) | m)) + ((lsb << 16) | lsb)
    return (both & Int32(-2147450880)) != 0  # 0x80008000: the two sign bits


@cute.jit
def row_is_nonfinite(sX: cute.Tensor, row: Int32, fp16: cutlass.Constexpr[bool]) -> Boolean:
    """Exact check of one row of a (rows, cols) smem tile view of 16-bit floats (any layout, swizzled too)."""
    bits = cute.recast_tensor(sX, Int16)
    m = _exp_mask(fp16)
    bad = Boolean(False)
    for c in cutlass.range(cute.size(sX, mode=[1]), unroll=8):
        bad = bad | ((Int32(bits[row, c]) & m) == m)
    return bad


@cute.jit
def zero_row(sX: cute.Tensor, row: Int32):
    for c in cutlass.range(cute.size(sX, mode=[1]), unroll=8):
        sX[row, c] = sX.element_type(0.0)


@cute.jit
def clear_nonfinite_rows(sX: cute.Tensor, tid: Int32, num_threads: cutlass.Constexpr[int],
                         fp16: cutlass.Constexpr[bool]) -> Int32:
    """Zero every row of the (rows, cols) smem view ``sX`` that holds a NaN or inf (rows split over
    ``num_threads`` threads). Returns the first bad row this thread cleared (NONE if none)."""
    first = Int32(NONE)
    for r in cutlass.range(tid, cute.size(sX, mode=[0]), num_threads, unroll=1):
        if row_is_nonfinite(sX, r, fp16):
            zero_row(sX, r)
            first = cutlass.min(first, r)
    return first


@cute.jit
def clear_nonfinite_rows_marking(sX: cute.Tensor, tid: Int32, num_threads: cutlass.Constexpr[int],
                                 fp16: cutlass.Constexpr[bool], bits: cute.Pointer):
    """As clear_nonfinite_rows, but every bad row r is reported by setting bit r % 32 of the shared word
    ``bits + r // 32`` (zeroed by the caller): for masks whose visible keys in a tile are an interval, where the
    first bad row does not decide."""
    for r in cutlass.range(tid, cute.size(sX, mode=[0]), num_threads, unroll=1):
        if row_is_nonfinite(sX, r, fp16):
            zero_row(sX, r)
            cute.arch.atomic_or(bits + r // 32, Int32(1) << (r % 32))

