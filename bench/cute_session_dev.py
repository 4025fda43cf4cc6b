"""One GPU session for the CuTe DSL kernels, prepared on the CPU: ahead-of-time objects, then tests and bench.

    python bench/cute_session_dev.py aot DIR [--jobs 2] [--set softcap]   # compile the variants tests and bench
                                                          # use (or one named set of them), export
    python bench/cute_session_dev.py aot DIR --set log:LOG1,LOG2  # the configs compile logs list (below)
    python bench/cute_session_dev.py gpu AOT_TAR -- STAGE... # GPU: unpack, warm FA4, run the stages, logs to $OUT
    python bench/cute_session_dev.py smoke                  # GPU: small forward / backward cases vs the oracle

AOT objects are keyed by each config, a digest of the kernel sources and the target (architecture, DSL and TVM-FFI
versions; host.config_key), so a stale object is never loaded, and named with a digest of their bytes, so a
corrupted one is refused; a variant missing from DIR is compiled on first use (3-5 s). With
FA4DIST_CUTE_COMPILE_LOG set, host.get_compiled appends every config it had to compile to that file: the list of
what to add next time.
Stages ("name:limit_s:command") run one after another, each under its own time limit, output to $OUT/name.log;
a failing stage whose name starts with "smoke" ends the session (a hang would eat the rest of it).
flash-attn-4 compiles its kernels on first call (5-7 s each): `gpu` first warms its disk cache for the bench's
(head dim, causal) pairs in parallel processes, in the background while the tests run.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)


# ----------------------------------------------------------------------------------------------------------------
# the variants the GPU tests and the bench use


def fwd_configs():
    import torch

    from fa4dist.kernels.cute import forward as F

    bf16, fp16 = torch.bfloat16, torch.float16
    out = []

    def add(dt, d, causal, varlen=False, acc=False, seg=False, out_fp32=False, **kw):
        out.append(F.make_config(dt, d, causal=causal, varlen=varlen, accumulate=acc, seg_offsets=seg,
                                 out_fp32=out_fp32, **kw))

    for dt in (bf16, fp16):
        for d in (64, 96, 128):
            for causal in (False, True):
                add(dt, d, causal)
        for d, causal, seg in ((128, False, False), (128, True, False), (128, True, True), (64, True, True),
                               (96, False, False), (64, True, False), (64, False, False)):
            add(dt, d, causal, varlen=True, seg=seg)
        for varlen, causal, d in ((False, False, 128), (False, True, 128), (False, True, 64), (True, True, 128),
                                  (True, False, 96), (True, False, 128)):
            add(dt, d, causal, varlen=varlen, acc=True)
    add(bf16, 128, True, seg=True, out_fp32=True)
    add(bf16, 128, True, varlen=True, seg=True, acc=True)
    for d in (64, 128):  # bench variants
        for causal in (False, True):
            add(bf16, d, causal, sanitize=False)  # the cost of the masked-key guarantee
    return out


def softcap_configs():
    """The variants of the soft-capping bench (bench/sessions/gpu_session_softcap.sh): forward with the fixed row max
    beside the running one, backward with the cap's derivative in registers beside the one recovered from P."""
    import torch

    from fa4dist.kernels.cute import forward as F

    out = []
    for d in (64, 128):
        for causal in (False, True):
            for cap in (30.0, 50.0):
                for fixed in (True, False):
                    out.append(F.make_config(torch.bfloat16, d, causal=causal, varlen=False, accumulate=False,
                                             softcap=cap, softcap_fixed_max=fixed))
    from fa4dist.kernels.cute import backward as B

    for d in (64, 128):
        for regs in (True, False):
            for max_k in (None, 1024):  # long and short (the persistent grid's) sequences
                out.extend(B.make_configs(torch.bfloat16, d, causal=True, varlen=False, seg_offsets=False,
                                          accumulate=False, deterministic=False, dq_dtype=torch.bfloat16,
                                          dkv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
                                          do_dtype=torch.bfloat16, softcap=30.0, softcap_grad_regs=regs,
                                          max_seqlen_k=max_k))
    return list(dict.fromkeys(out))


def persistent_bwd_configs():
    """The persistent backward's session: the variants of its bits test (tests/kernels/test_cute_bwd_gpu.py,
    PERSISTENT_RUNS, one CTA per tile and PERSISTENT_TEST_CTAS), of the rotated deterministic order's test and
    bench rows, and every backward variant of the "all" set as it is and on a 132-CTA persistent grid (the
    backward suites run under FA4DIST_BWD_OVERRIDE=persistent_ctas=132; the bench times both)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_cute_bwd_gpu import PERSISTENT, PERSISTENT_RUNS, PERSISTENT_TEST_CTAS

    from fa4dist.kernels.cute import backward as B

    bf16, fp32 = torch.bfloat16, torch.float32
    out = []
    for name, form in PERSISTENT_RUNS:
        _, _, _, _, _, d, causal, options = PERSISTENT[name]
        acc = form == "accumulate"
        for det in (False, True):
            for ctas in (0, PERSISTENT_TEST_CTAS):
                out.extend(B.make_configs(
                    bf16, d, causal=causal, varlen=form == "packed", seg_offsets=False, accumulate=acc,
                    deterministic=det, dq_dtype=fp32 if acc else bf16, dkv_dtype=fp32 if acc else bf16,
                    o_dtype=bf16, do_dtype=bf16, window_left=options.get("window_left", -1),
                    softcap=options.get("softcap", 0.0), persistent_ctas=ctas))
    from test_cute_bwd_gpu import ROTATED

    for lens_q, lens_k, hq, hkv, d in ROTATED.values():  # test_rotated_deterministic_order: fp32 grads
        packed = not (len(set(lens_q)) == 1 and lens_q == lens_k)
        for rotate in (True, False):
            out.extend(B.make_configs(bf16, d, causal=False, varlen=packed, seg_offsets=False, accumulate=False,
                                      deterministic=True, dq_dtype=fp32, dkv_dtype=fp32, o_dtype=bf16,
                                      do_dtype=bf16, det_resident=rotate))
    for packed in (False, True):  # test_longest_first_causal_deterministic_order: fp32 grads
        for resident in (True, False):
            out.extend(B.make_configs(bf16, 128, causal=True, varlen=packed, seg_offsets=False, accumulate=False,
                                      deterministic=True, dq_dtype=fp32, dkv_dtype=fp32, o_dtype=bf16,
                                      do_dtype=bf16, det_resident=resident))
    for d in (64, 128):  # the bench's bwd-det:det_resident=true / false rows (16-bit grads)
        for causal in (False, True):
            for resident in (True, False):
                out.extend(B.make_configs(bf16, d, causal=causal, varlen=False, seg_offsets=False,
                                          accumulate=False, deterministic=True, dq_dtype=bf16, dkv_dtype=bf16,
                                          o_dtype=bf16, do_dtype=bf16, det_resident=resident))
    for cfg in bwd_configs():  # as they are (the contract's and the one-CTA rows) and on the grid
        out.append(cfg)
        if isinstance(cfg, B.BwdConfig):
            out.append(dataclasses.replace(cfg, persistent_ctas=132))
    return list(dict.fromkeys(out))


def tma_dkv_configs():
    """The dK / dV TMA-store session (thirteenth): the bench's dense backward rows at 1k (persistent grid) and 4k,
    with the store on (the default) and off, deterministic with it on; and the backward suite's variants."""
    import torch

    from fa4dist.kernels.cute import backward as B

    bf16 = torch.bfloat16
    out = []
    for d in (64, 128):
        for causal in (False, True):
            for seqlen in (1024, 4096):
                for det, tma in ((False, True), (False, False), (True, True)):
                    out.extend(B.make_configs(bf16, d, causal=causal, varlen=False, seg_offsets=False,
                                              accumulate=False, deterministic=det, dq_dtype=bf16, dkv_dtype=bf16,
                                              o_dtype=bf16, do_dtype=bf16, max_seqlen_k=seqlen, tma_store_dkv=tma))
    return list(dict.fromkeys(out + bwd_configs()))


def session14_configs():
    """The fourteenth session's benches: the backward's early lse2 / dPsum reads (hdim 128, 1k-16k, deterministic
    too) beside the default, and hdim-64 forward variants at 4k / 16k (one CTA per tile, three stages, the rescale
    threshold flipped, no scheduling barrier)."""
    import torch

    from fa4dist.kernels.cute import backward as B
    from fa4dist.kernels.cute import forward as F

    bf16 = torch.bfloat16
    out = []
    for causal in (False, True):
        for seqlen in (1024, 4096, 16384):
            for det in (False, True):
                for early in (False, True):
                    out.extend(B.make_configs(bf16, 128, causal=causal, varlen=False, seg_offsets=False,
                                              accumulate=False, deterministic=det, dq_dtype=bf16, dkv_dtype=bf16,
                                              o_dtype=bf16, do_dtype=bf16, max_seqlen_k=seqlen, early_vectors=early))
        for overrides in D64_FWD_VARIANTS[causal]:
            out.append(F.make_config(bf16, 64, causal=causal, varlen=False, accumulate=False, **overrides))
    return list(dict.fromkeys(out))


def fwd_bench_configs():
    """The forward rows of bench/kernels.py (hdim 64 and 128, causal or not, long and short sequences: the
    launch-size choices of forward.forward), bf16, and each with the O rescale unconditional (rescale_threshold 0)."""
    import torch

    from fa4dist.kernels.cute import forward as F

    out = [F.make_config(torch.bfloat16, d, causal=causal, varlen=False, accumulate=False,
                         short=F.short_queries(d, causal, True, s),
                         interleave=F.interleaved_launch(d, causal, True, s),
                         chained=F.chained_max_launch(d, causal, True, s),
                         **kw)
           for d in (64, 128) for causal in (False, True) for s in (1024, 2048, 4096, 16384)
           for kw in ({}, dict(rescale_threshold=0.0))]
    return list(dict.fromkeys(out))


def sum_from_old_configs():
    """The fourteenth session's third call: the forward suite's variants, the bench's forward rows, and those rows
    with FwdConfig.sum_from_old flipped (hdim 64 off, hdim 128 on)."""
    import torch

    from fa4dist.kernels.cute import forward as F

    flipped = [F.make_config(torch.bfloat16, d, causal=causal, varlen=False, accumulate=False, short=short,
                             sum_from_old=d != 64)
               for d in (64, 128) for causal in (False, True) for short in (False, True)]
    return list(dict.fromkeys(fwd_configs() + fwd_bench_configs() + flipped))


def early_vectors_configs():
    """The backward variants of the fourteenth session's GPU check of early_vectors (now a default): dense bf16 and
    fp16, hdim 64 and 128, causal or not, deterministic or not, short (the persistent grid) and long sequences, as
    test_cute_bwd_gpu's dense and deterministic tests make them; and test_step_forms_give_the_same_bits' pairs."""
    import torch

    from fa4dist.kernels.cute import backward as B

    out = []
    for dt in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for causal in (False, True):
                for det in (False, True):
                    for max_k in (1024, None):
                        for grads in ((dt, torch.float32) if det else (dt,)):
                            out.extend(B.make_configs(dt, d, causal=causal, varlen=False, seg_offsets=False,
                                                      accumulate=False, deterministic=det, dq_dtype=grads,
                                                      dkv_dtype=grads, o_dtype=dt, do_dtype=dt, max_seqlen_k=max_k))
    for causal in (False, True):
        for det in (False, True):
            for early in (False, True):
                out.extend(B.make_configs(torch.bfloat16, 128, causal=causal, varlen=False, seg_offsets=False,
                                          accumulate=False, deterministic=det, dq_dtype=torch.bfloat16,
                                          dkv_dtype=torch.bfloat16, o_dtype=torch.bfloat16, do_dtype=torch.bfloat16,
                                          max_seqlen_k=1000, early_vectors=early))
    return list(dict.fromkeys(out))


def try_wait_configs():
    """The forward bench rows with FwdConfig.late_pv_wait on, and at hdim 128 also with sum_from_old (prepared in
    the fourteenth session: bench/sessions/gpu_session_15.sh)."""
    out = []
    for cfg in fwd_bench_configs():
        out.append(dataclasses.replace(cfg, late_pv_wait=True))
        if cfg.head_dim == 128:
            out.append(dataclasses.replace(cfg, late_pv_wait=True, sum_from_old=True))
    return list(dict.fromkeys(out))


def _bwd_bench_pairs(field: Optional[str]):
    """The backward bench rows (bf16 dense, hdim 64 and 128, causal or not, deterministic or not, 1k / 4k / 16k)
    and test_step_forms_give_the_same_bits' 1000-token hdim-128 rows, each with ``field`` off and on (None: the
    defaults only)."""
    import torch

    from fa4dist.kernels.cute import backward as B

    bf16 = torch.bfloat16
    dense = dict(varlen=False, seg_offsets=False, accumulate=False, dq_dtype=bf16, dkv_dtype=bf16, o_dtype=bf16,
                 do_dtype=bf16)
    out = []
    for d in (64, 128):
        for causal in (False, True):
            for det in (False, True):
                for seqlen in (1000, 1024, 4096, 16384) if d == 128 else (1024, 4096, 16384):
                    for kw in ({field: False}, {field: True}) if field else ({},):
                        out.extend(B.make_configs(bf16, d, causal=causal, deterministic=det, max_seqlen_k=seqlen,
                                                  **kw, **dense))
    return out


def _fwd_bits_pairs(fields):
    """test_schedule_fields_give_the_same_bits' forward variants (fresh and merged, hdim 64 and 128, causal or not,
    softcap + window at hdim 128 causal), each of ``fields`` off and on."""
    import torch

    from fa4dist.kernels.cute import forward as F

    out = []
    for d in (64, 128):
        for causal in (False, True):
            for acc in (False, True):
                extras = [{}] + ([dict(softcap=30.0, window_left=300)] if d == 128 and causal else [])
                for kw in extras:
                    for field in fields:
                        for on in (False, True):
                            out.append(F.make_config(torch.bfloat16, d, causal=causal, varlen=False, accumulate=acc,
                                                     **{field: on}, **kw))
    return out


def session15_configs():
    """The fifteenth session's second call: the backward bench rows with BwdConfig.try_waits off and on, and the
    forward's late_pv_wait both ways (the bits tests' pairs)."""
    return list(dict.fromkeys(_bwd_bench_pairs("try_waits") + _fwd_bits_pairs(("late_pv_wait",))))


def session16_configs():
    """The sixteenth session's first call: the bench rows, forward (fwd_bench_configs) and backward, each with the
    descriptor bases hoisted (the default) and not (hoist_descriptors=False), and the bits tests' pairs of every
    forward schedule field."""
    from fa4dist.kernels.cute import forward as F

    out = []
    for cfg in fwd_bench_configs():
        out.extend([cfg, dataclasses.replace(cfg, hoist_descriptors=False)])
    out += _bwd_bench_pairs("hoist_descriptors") + _fwd_bits_pairs(F._SCHEDULE_FIELDS)
    return list(dict.fromkeys(out))


def tile_n_176_configs():
    """The hdim-128 forward bench rows (long sequences, causal or not) with 176-key tiles (FA3's non-causal tile;
    the O staging buffer then no longer fits beside two K / V stages: tma_store_o off), and with tma_store_o off
    alone (sixteenth session, bench/sessions/gpu_session_16.sh 5)."""
    import torch

    from fa4dist.kernels.cute import forward as F

    out = []
    for causal in (False, True):
        for kw in (dict(tile_n=176, tma_store_o=False), dict(tma_store_o=False), {}):
            out.append(F.make_config(torch.bfloat16, 128, causal=causal, varlen=False, accumulate=False, **kw))
    return list(dict.fromkeys(out))


def session17_configs():
    """The seventeenth session's first call: the causal forward bench rows (fwd_bench_configs), the hdim-128
    dense causal merges (bench/kernels.py --accumulate, one CTA per tile and persistent), packed causal documents
    and the backward bench rows, each with long and short tiles interleaved and not, and the bits tests' pairs of
    every forward schedule field."""
    import torch

    from fa4dist.kernels.cute import forward as F

    out = []
    for cfg in fwd_bench_configs():
        out.extend([cfg, dataclasses.replace(cfg, interleave_lengths=cfg.causal)])
    for on in (False, True):
        for persistent in (0, 132):
            out.append(F.make_config(torch.bfloat16, 128, causal=True, varlen=False, accumulate=True,
                                     interleave_lengths=on, persistent_ctas=persistent))
        for d in (64, 128):  # packed causal documents (bench/packed_tiles.py)
            out.append(F.make_config(torch.bfloat16, d, causal=True, varlen=True, accumulate=False,
                                     interleave_lengths=on))
    out += _fwd_bits_pairs(F._SCHEDULE_FIELDS) + _bwd_bench_pairs("interleave_lengths")
    return list(dict.fromkeys(out))


def session17b_configs():
    """The seventeenth session's last call: the forward bench rows with Q's K-block slices hoisted (the default) and
    not (hoist_q_slices=False), the bits tests' pairs of that field, and the backward bench rows under the defaults
    (the table)."""
    out = []
    for cfg in fwd_bench_configs():
        out.extend([cfg, dataclasses.replace(cfg, hoist_q_slices=False)])
    out += _fwd_bits_pairs(("hoist_q_slices",)) + _bwd_bench_pairs(None)
    return list(dict.fromkeys(out))


def session17c_configs():
    """The seventeenth session's last call: the non-deterministic backward bench rows at 4k-16k (hdim 64 and 128,
    causal or not) under the defaults and on the persistent grid (persistent_ctas=132)."""
    import torch

    from fa4dist.kernels.cute import backward as B

    bf16 = torch.bfloat16
    out = []
    for d in (64, 128):
        for causal in (False, True):
            for seqlen in (4096, 8192, 16384):
                for kw in ({}, dict(persistent_ctas=132)):
                    out.extend(B.make_configs(bf16, d, causal=causal, varlen=False, seg_offsets=False,
                                              accumulate=False, deterministic=False, dq_dtype=bf16, dkv_dtype=bf16,
                                              o_dtype=bf16, do_dtype=bf16, max_seqlen_k=seqlen, **kw))
    return list(dict.fromkeys(out))


def session18_configs():
    """The eighteenth session's: the forward bench rows with the row max in flash-attn-4's chained form
    (chained_max) and without, and the bits tests' pairs of that field. (Its backward rows with the lse2 / dPsum
    vectors permuted went with the knob: measured no faster, removed.)"""
    out = []
    for cfg in fwd_bench_configs():
        out.extend([cfg, dataclasses.replace(cfg, chained_max=True)])
    out += _fwd_bits_pairs(("chained_max",))
    return list(dict.fromkeys(out))


def table_configs():
    """The kernel table's rows under the current defaults (bench/kernels.py, forward and backward, hdim 64 and 128,
    causal or not, deterministic or not, 1k / 4k / 16k): what a fresh table call needs compiled."""
    return list(dict.fromkeys(fwd_bench_configs() + _bwd_bench_pairs(None)))


def _dense_bf16_bwd(**kw):
    """make_configs of a dense bf16 backward writing fresh bf16 gradients (the bench's and bits tests' calls)."""
    import torch

    from fa4dist.kernels.cute import backward as B

    bf16 = torch.bfloat16
    return B.make_configs(bf16, kw.pop("head_dim"), varlen=False, seg_offsets=False, accumulate=False, dq_dtype=bf16,
                          dkv_dtype=bf16, o_dtype=bf16, do_dtype=bf16, **kw)


def _ticket_form_configs(forms_list):
    """The table's rows and the deterministic backward's rows (bench and ticket bits test lengths) in each form."""
    out = table_configs()
    for d in (64, 128):
        for causal in (False, True):
            for seqlen in (1000, 1024, 4096, 16384):
                for forms in forms_list:
                    out.extend(_dense_bf16_bwd(head_dim=d, causal=causal, deterministic=True, max_seqlen_k=seqlen,
                                               **forms))
    return out


def session19_configs():
    """Prepared in the eighteenth session: the table's rows (table_configs), and the deterministic backward bench
    rows (and the ticket bits test's) with the dQ tickets in flash-attn-4's form, the release fence alone and both
    (BwdConfig.ticket_sleep_ns, release_fence)."""
    forms = (dict(release_fence=False), dict(ticket_sleep_ns=0, release_fence=False))
    return list(dict.fromkeys(_ticket_form_configs(forms)))


def session21_configs():
    """The twentieth session's softcap rows: the soft-capped hdim-128 backward (4k / 16k, causal or not,
    deterministic or not) with the cap's derivative in registers (the default since then) and recovered from P."""
    out = []
    for seqlen in (4096, 16384):
        for causal in (False, True):
            for det in (False, True):
                for forms in (dict(), dict(softcap_grad_regs=False)):
                    out.extend(_dense_bf16_bwd(head_dim=128, causal=causal, deterministic=det, max_seqlen_k=seqlen,
                                               softcap=30.0, **forms))
    return list(dict.fromkeys(out))


def det_gqa_configs():
    """The deterministic GQA backward's three forms at 4k / 16k / 32k (bench/kernels.py --kv-group 4 --cute-variants
    bwd-det:det_dq=tickets|fixed|expanded, gpu_session_21.sh 2): the ticketed kernel writing fresh bf16 gradients
    (GQA, as the tickets form), with fp32 dK / dV (expanded heads), the int64 dQ converted to bf16 (fixed), and
    the non-deterministic rows."""
    import torch

    from fa4dist.kernels.cute import backward as B

    bf16, fp32 = torch.bfloat16, torch.float32
    out = table_configs()  # (the forwards)
    for d in (64, 128):
        for causal in (False, True):
            for seqlen in (4096, 16384, 32768):
                for det in (False, True):
                    out.extend(_dense_bf16_bwd(head_dim=d, causal=causal, deterministic=det, max_seqlen_k=seqlen))
                out.extend(B.make_configs(bf16, d, causal=causal, varlen=False, seg_offsets=False, accumulate=False,
                                          deterministic=True, dq_dtype=bf16, dkv_dtype=fp32, o_dtype=bf16,
                                          do_dtype=bf16, max_seqlen_k=seqlen))
                out.extend(_dense_bf16_bwd(head_dim=d, causal=causal, deterministic=True, max_seqlen_k=seqlen,
                                           dq_fixed=True, fixed_to_float=True))
    return list(dict.fromkeys(out))


# the hdim-64 forward rows of the fourteenth session (bench/sessions/gpu_session_14.sh: keep the two in step)
D64_FWD_VARIANTS = {
    causal: [{}, dict(persistent_ctas=0), dict(num_stages=3), dict(rescale_threshold=0.0 if causal else 8.0),
             dict(sched_barrier=False)]
    for causal in (False, True)
}

CONFIG_SETS = {"all": lambda: fwd_configs() + bwd_configs(), "softcap": softcap_configs,
               "persistent_bwd": persistent_bwd_configs, "tma_dkv": tma_dkv_configs, "session14": session14_configs,
               "fwd_bench": fwd_bench_configs, "sum_from_old": sum_from_old_configs,
               "early_vectors": early_vectors_configs, "try_wait": try_wait_configs,
               "session15": session15_configs, "session16": session16_configs,
               "tile_n_176": tile_n_176_configs, "session17": session17_configs,
               "session17b": session17b_configs, "session17c": session17c_configs,
               "session18": session18_configs, "table": table_configs,
               "session19": session19_configs, "session21": session21_configs,
               "det_gqa": det_gqa_configs}


def bwd_configs():
    import torch

    from fa4dist.kernels.cute import backward as B

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    out = []

    def add(dt, d, causal, varlen=False, acc=False, det=False, seg=False, o=None, do=None, grads=None, **kw):
        grads = fp32 if acc else (grads or dt)
        for max_k in (None, 1024):  # long sequences and short ones (the persistent grid's, where it applies)
            out.extend(B.make_configs(dt, d, causal=causal, varlen=varlen, seg_offsets=seg, accumulate=acc,
                                      deterministic=det, dq_dtype=grads, dkv_dtype=grads, o_dtype=o or dt,
                                      do_dtype=do or dt, max_seqlen_k=max_k, **kw))

    for dt in (bf16, fp16):
        for d in (64, 128):
            for causal in (False, True):
                add(dt, d, causal)
                add(dt, d, causal, varlen=True)
    add(bf16, 128, True, o=fp32, do=fp32, grads=fp32)
    for causal in (False, True):
        add(bf16, 128, causal, acc=True)
        add(bf16, 128, causal, varlen=True, acc=True)
        for d in (64, 128):
            add(bf16, d, causal, det=True)
            add(bf16, d, causal, det=True, grads=fp32)
            add(bf16, d, causal, det=True, det_chunk=8)
            add(bf16, d, causal, det=True, grads=fp32, det_chunk=8)
            add(bf16, d, causal, varlen=True, det=True)  # the session's smoke stage
            add(bf16, d, causal, sanitize=False)  # bench: the cost of the masked-key guarantee
            add(bf16, d, causal, det=True, sanitize=False)
    add(bf16, 128, True, varlen=True, seg=True)
    add(bf16, 128, True, varlen=True, seg=True, acc=True)
    add(bf16, 128, True, seg=True)
    seen, flat = set(), []
    for cfg in out:
        if cfg not in seen:
            seen.add(cfg)
            flat.append(cfg)
    return flat


def logged_configs(paths: str):
    """The configs of FA4DIST_CUTE_COMPILE_LOG files (comma-separated paths; one repr per line: what a GPU run had
    to compile), parsed as literals, not evaluated. ``--set log:PATH,...`` exports them, so that the next run of
    the same suites finds them ahead of time (bench/results/*-compiled-*.txt keep such lists)."""
    import ast

    from fa4dist.kernels.cute import backward as B
    from fa4dist.kernels.cute import forward as F

    classes = {c.__name__: c for c in (F.FwdConfig, B.BwdConfig, B.PreConfig, B.PostConfig)}
    out = []
    for path in paths.split(","):
        for line in open(path):
            if not line.strip():
                continue
            call = ast.parse(line.strip(), mode="eval").body
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in classes
                    and not call.args):
                raise SystemExit(f"{path}: not a config repr: {line.strip()[:80]}")
            out.append(classes[call.func.id](**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}))
    return list(dict.fromkeys(out))


def refreshed_configs(paths: str):
    """``--set fresh:PATH,...``: the logged configs with the forward fields today's defaults derive from the head
    dim and causality alone (sum_from_old, late_pv_wait) derived again, so that a list logged before a default
    changed still compiles what the same suites compile now."""
    from fa4dist.kernels.cute import forward as F

    out = []
    for cfg in logged_configs(paths):
        if isinstance(cfg, F.FwdConfig):
            cfg = dataclasses.replace(cfg, sum_from_old=F.default_sum_from_old(cfg.head_dim),
                                      late_pv_wait=F.default_late_pv_wait(cfg.head_dim, cfg.causal))
        out.append(cfg)
    return list(dict.fromkeys(out))


def _config_set(which: str):
    if which.startswith("log:"):
        return logged_configs(which[4:])
    if which.startswith("fresh:"):
        return refreshed_configs(which[6:])
    return CONFIG_SETS[which]()


def _export_shard(args):
    folder, shard, jobs, which = args
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from fa4dist.kernels.cute import host

    cfgs = _config_set(which)[shard::jobs]
    for cfg in cfgs:
        if host.stored_object(folder, cfg) is None:  # else kept from an earlier export
            host.export_aot(cfg, folder)
    return len(cfgs)


def cmd_aot(folder, jobs, which="all"):
    import multiprocessing as mp

    t0 = time.time()
    os.makedirs(folder, exist_ok=True)
    with mp.get_context("spawn").Pool(jobs) as pool:
        n = sum(pool.map(_export_shard, [(folder, i, jobs, which) for i in range(jobs)]))
    print(f"{n} AOT objects in {folder} ({time.time() - t0:.0f} s)")


# ----------------------------------------------------------------------------------------------------------------
# GPU side


def cmd_smoke():
    """A few small forward / backward calls against the fp64 oracle (dense, packed, causal, deterministic): exit
    1 if one is wrong, and a hang (a barrier that never completes) is cut after 90 s."""
    import faulthandler

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from oracle import naive_attention, rel_error

    from fa4dist.kernels.cute import backward as B
    from fa4dist.kernels.cute import forward as F

    faulthandler.dump_traceback_later(90, exit=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    ok = True
    for d in (128, 64):
        for causal, lens in ((True, None), (False, None), (True, [100, 300, 77]), (False, [129, 1, 200])):
            t0 = time.time()
            if lens is None:
                shape = (2, 333, 4, d)
                kw = dict(causal=causal)
                okw = dict(causal=causal)
            else:
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                shape = (sum(lens), 4, d)
                kw = dict(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                          max_seqlen_k=max(lens))
                okw = dict(causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
            q, k, v, dout = (torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
            qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
            ro, rl = naive_attention(qd, kd, vd, **okw)
            rg = torch.autograd.grad(ro, (qd, kd, vd), dout.double())
            out = torch.full_like(q, float("nan"))
            lse = torch.full(rl.shape, float("nan"), device="cuda")
            F.forward(q, k, v, out, lse, **kw)
            errs = [rel_error(out.cpu(), ro.detach().cpu())]
            for det in (False, True):
                grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                B.backward(dout, q, k, v, out, lse, *grads, deterministic=det, **kw)
                errs += [rel_error(a.cpu(), b.cpu()) for a, b in zip(grads, rg)]
            torch.cuda.synchronize()
            good = all(e < 3e-2 for e in errs)
            ok &= good
            print(f"smoke d={d} causal={causal} packed={lens is not None}: errs {[f'{e:.1e}' for e in errs]} "
                  f"{'ok' if good else 'FAIL'} ({time.time() - t0:.1f}s)", flush=True)
    sys.exit(0 if ok else 1)

FA4_WARM = r"""
import sys, torch
from flash_attn.cute import flash_attn_func as fa4
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
for s in map(int, sys.argv[3:]):
    q, k, v = (torch.randn(1, s, 2048 // d, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for det in (False, True):
        r = fa4(q, k, v, causal=causal, deterministic=det)
        o = r[0] if isinstance(r, tuple) else r
        o.backward(torch.ones_like(o))
torch.cuda.synchronize()
print("warm", d, causal, flush=True)
"""


def cmd_gpu(aot_tar, stages):
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1",
               FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="/tmp/fa4cache",
               FA4DIST_CUTE_COMPILE_LOG=os.path.join(out, "compiled.txt"))
    if aot_tar and os.path.exists(aot_tar):
        subprocess.run(["tar", "-xJf", aot_tar, "-C", "/tmp"], check=True)
        env["FA4DIST_CUTE_AOT_DIR"] = "/tmp/" + os.path.basename(aot_tar).split(".")[0]
    warm = []
    for d in (64, 128):
        for causal in ("0", "1"):
            warm.append(subprocess.Popen([sys.executable, "-c", FA4_WARM, str(d), causal, "1024", "4096", "16384"],
                                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for spec in stages:
        name, limit, command = spec.split(":", 2)
        if name.startswith("bench"):
            for p in warm:  # the bench times flash-attn-4: its kernels must be in the cache by now
                p.wait()
        t0 = time.time()
        with open(os.path.join(out, name + ".log"), "w") as log:
            rc = subprocess.run(["timeout", limit, "bash", "-c", command], env=env, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        print(f"=== {name} rc={rc} in {time.time() - t0:.0f}s", flush=True)
        with open(os.path.join(out, name + ".log")) as log:
            tail = log.read().splitlines()[-int(os.environ.get("TAIL_LINES", "25")):]
        print("\n".join(tail), flush=True)
        if rc != 0 and name.startswith("smoke"):
            print("=== smoke failed: later stages skipped", flush=True)
            break
    for p in warm:
        p.kill()


if __name__ == "__main__":
    if sys.argv[1] == "aot":
        jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else 2
        cmd_aot(sys.argv[2], jobs, sys.argv[sys.argv.index("--set") + 1] if "--set" in sys.argv else "all")
    elif sys.argv[1] == "gpu":
        cmd_gpu(sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
    elif sys.argv[1] == "smoke":
        cmd_smoke()
    elif sys.argv[1] == "list":
        for c in fwd_configs() + bwd_configs():
            print(c)
