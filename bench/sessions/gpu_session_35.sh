#!/usr/bin/env bash
# Prepared in the thirty-fourth session (2026-12-04), results in bench/results/2026-12-04-thirty-fourth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_35.sh 1    (flash-attn-4 carried: --with-fa4)
# Stage 1 ran on commit b951661 (the deterministic split and split_tail.py --deterministic), stage 2 on 99b5d05 (the
# split with one dQ chain per part index); both were reverted after their measurements (bench/RESULTS.md,
# thirty-fourth session), so stages 1-2 need those commits checked out.
# 1: the deterministic causal backward of few waves splits its longest key tiles too (split_keys_variant, no
#    longer non-deterministic only). Its shortest-first claims stay (a dQ ticket waits only on higher key tiles,
#    claimed before it: no deadlock), so the longest key tiles' parts are claimed last (tile_scheduler.parts_last),
#    and every (key tile, query tile) pair is one part's: the dQ tickets add in the unsplit order (the same dQ
#    bits). (a) the split tests, deterministic now too (oracle, run-to-run bytes of all three gradients, dQ the
#    unsplit launch's bytes, dK / dV outside the split tiles the unsplit bytes, NaN patterns), and the
#    deterministic suites; (b) bench/split_tail.py --deterministic in device time beside flash-attn-4's
#    deterministic backward. Prediction: below the non-deterministic split's gains (+28 / +72 / +53 / +49 / +14%
#    at hdim 128 4 x 4k / 1 x 16k / 2 x 8k / 3 x 4k / 8 x 2k), since the longest tiles' parts start last and a
#    part of late query tiles waits on the unsplit key tiles' tickets: +10-40%; nothing at 8 x 4k (no split).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s35 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
# stages 1 and 2: the deterministic split's tests and its split / unsplit rows (the same commands on two commits)
det_split_stages() {
  TAIL_LINES=8 stage tests_det_split 240 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py \
    -k "split or determin or persistent"
  TAIL_LINES=12 stage det_split_128 150 python3 bench/split_tail.py --direction bwd --causal --deterministic \
    --headdim 128 --shapes 1x4096x4 1x16384x1 1x8192x2 1x4096x3 1x2048x8 1x4096x8 --rounds 3 \
    --out-dir "$OUT/det_split_128"
  TAIL_LINES=8 stage det_split_64 90 python3 bench/split_tail.py --direction bwd --causal --deterministic \
    --headdim 64 --shapes 1x4096x4 1x8192x2 1x4096x8 --rounds 3 --out-dir "$OUT/det_split_64"
}
if [ "${1:-1}" = 1 ]; then
  det_split_stages
  exit
fi
# 2: call 1 measured the deterministic split 9-29% slower: in one diagonal-down ticket chain per query tile a part
#    of key tile n waits for key tile n + 1 to reach its first query tile at that tile's own pace. Now each part
#    index has its own dQ scratch and tickets (bwd_sm90's dq_chains: part p of every split key tile in chain p, the
#    whole key tiles in chain 0, each chain diagonal-down by the host's turn table split_plans.dq_chain_ranks), and
#    the host sums the chains in order before the convert: within a chain every add's predecessor reaches the query
#    tile earlier, as in the unsplit launch. (a) the split tests (deterministic: the oracle, all three gradients'
#    bytes run to run, dK / dV outside the split tiles the unsplit bytes, NaN patterns) and the deterministic and
#    persistent suites; (b) split_tail.py --deterministic. Prediction: +15-50% on the one-wave shapes (the
#    non-deterministic split's +28-72%, less the later start of the longest tiles' parts under shortest-first
#    claims and the chain sums' passes).
if [ "$1" = 2 ]; then
  det_split_stages
  exit
fi
# 3: the session's helper changes on the GPU paths: HF packed documents by transformers' rule in one process and
#    under CP (the HF GPU test), and the staged-rank CP suite.
if [ "$1" = 3 ]; then
  TAIL_LINES=6 stage tests_hf_cp 200 $PYTEST -n 8 tests/integrations/test_hf_integration.py tests/cp/test_cp_gpu.py
  exit
fi
# 4: two-wave causal backwards (8 heads x 4k, batch 1: 256 key tiles on 132 SMs) are our weakest non-split shapes,
#    0.94x flash-attn-4's backward (thirty-third session). Their persistent grid claims one head's key tiles after
#    another's, longest first within a head, so the last heads' longest key tiles start after the first wave's
#    short ones: BwdConfig.lpt_over_heads (a knob, the same bits) claims every head's longest key tile first.
#    Prediction: +3-8% at 8 x 4k / 16 x 2k / 4 x 8k, ~0 at 12 x 4k; one CTA per tile (persistent_ctas=0) beside it.
#    Tests: the step-form bits test with the knob; the backends and windowed suites (this session's sdpa changes:
#    huge window sides, negative scales refused).
if [ "$1" = 4 ]; then
  TAIL_LINES=6 stage tests_bits_sdpa 200 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py -k "step_forms" \
    tests/kernels/test_backends_gpu.py tests/kernels/test_window_gpu.py
  for v in default lpt_over_heads=1 persistent_ctas=0; do
    o=$v; [ "$v" = default ] && o=
    TAIL_LINES=8 FA4DIST_BWD_OVERRIDE=$o stage "two_waves_${v%%=*}" 120 python3 bench/split_tail.py --direction bwd \
      --causal --headdim 128 --shapes 1x4096x8 1x2048x16 1x8192x4 1x4096x12 --rounds 3 --out-dir "$OUT/tw_${v%%=*}"
  done
  TAIL_LINES=6 FA4DIST_BWD_OVERRIDE=lpt_over_heads=1 stage two_waves_64_lpt 60 python3 bench/split_tail.py \
    --direction bwd --causal --headdim 64 --shapes 1x4096x8 --rounds 3 --out-dir "$OUT/tw64_lpt"
  TAIL_LINES=6 stage two_waves_64 60 python3 bench/split_tail.py --direction bwd --causal --headdim 64 \
    --shapes 1x4096x8 --rounds 3 --out-dir "$OUT/tw64"
  exit
fi
# 5: call 4: lpt_over_heads gained +40 / +35 / +39 / +19% at hdim 128 8 x 4k / 16 x 2k / 4 x 8k / 12 x 4k and +40% at
#    hdim 64 8 x 4k (1.14-1.33x flash-attn-4's backward), far above the +3-8% predicted: under head-major claims
#    the last heads' longest key tiles start only after ~90 earlier claims have finished. Where does it stop
#    paying? Many-wave launches (the #11 bench shapes among them), where all heads' Q / dO / dQ scratch streamed at
#    once no longer fit the 50 MB L2 (a head-major order keeps one head's hot). Knob on and off, same rounds.
if [ "$1" = 5 ]; then
  for v in off on; do
    o=; [ "$v" = on ] && o=lpt_over_heads=1
    TAIL_LINES=12 FA4DIST_BWD_OVERRIDE=$o stage "waves_128_$v" 150 python3 bench/split_tail.py --direction bwd \
      --causal --headdim 128 --shapes 1x4096x16 1x4096x32 1x8192x16 1x16384x8 2x8192x16 1x16384x16 4x4096x16 \
      --rounds 3 --out-dir "$OUT/waves_128_$v"
    TAIL_LINES=6 FA4DIST_BWD_OVERRIDE=$o stage "waves_64_$v" 90 python3 bench/split_tail.py --direction bwd \
      --causal --headdim 64 --shapes 1x4096x16 1x8192x16 4x4096x32 --rounds 3 --out-dir "$OUT/waves_64_$v"
  done
  exit
fi
# 6: call 5: lpt_over_heads +18.5% / +5% / +6.5% at 16 x 4k / 32 x 4k / 16 x 8k (hdim 128), +17 / +8.5% at hdim 64,
#    neutral at 8 x 16k, -12% / -32% at the #11 bench's 4 x 4k x 16 / 4 x 4k x 32 (16-32 waves, 256 MB of query
#    streams: L2). Now the default where it paid (backward.use_lpt_over_heads: at most 8 waves and 128 MB). The
#    backward GPU suite under it; the default against the head-major order on three shapes (predicted: +35-40% at
#    8 x 4k, +18% at 16 x 4k, unchanged at 4 x 4k x 16); forward+backward through the contract on 8 heads of 128.
if [ "$1" = 6 ]; then
  TAIL_LINES=6 stage tests_bwd 230 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py
  TAIL_LINES=8 stage lpt_default 60 python3 bench/split_tail.py --direction bwd --causal --headdim 128 \
    --shapes 1x4096x8 1x4096x16 4x4096x16 --rounds 2 --out-dir "$OUT/lpt_default"
  TAIL_LINES=8 FA4DIST_BWD_OVERRIDE=lpt_over_heads=0 stage lpt_off 60 python3 bench/split_tail.py --direction bwd \
    --causal --headdim 128 --shapes 1x4096x8 1x4096x16 4x4096x16 --rounds 2 --out-dir "$OUT/lpt_off"
  TAIL_LINES=12 stage few_heads 80 python3 bench/kernels.py --headdims 128 --seqlens 4096 8192 --total-tokens 8192 \
    --model-dim 1024 --causal true --directions bwd --backends cute flash_attn_4 --rounds 3 --out-dir "$OUT/few_heads"
  exit
fi
