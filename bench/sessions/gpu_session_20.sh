#!/usr/bin/env bash
# Prepared in the nineteenth session for the next one (after gpu_session_19.sh 5, whose early_dq_free and softcap
# A/B did not get device time): the #12 simulation and the #13 cost rerun on today's kernels, which moved a lot
# since they were last measured (2026-12-01: cp = 8 simulation 0.932 / 0.855, cp_invariant 1.29x plain at 32k).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_20.sh 1   # cp_invariant / deterministic cost
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_20.sh 2   # the ring simulation, 128k, cp 8 / 4
# 1: besides the fa4dist.attention rows, bench/invariant.py times the CuTe backward alone (accumulating, as the
#    cp_invariant engine calls it) with fp32 dQ, fp32 dQ + tickets, int64 dQ. On 2026-12-01 the tickets cost 1.19x
#    the fp32 dQ with 32/32 heads but 1.48x with 32/8 (GQA). Hypothesis (NOTES_BWD.md, nineteenth session): a GQA
#    CTA walks its group's four heads, so each CTA is four times longer, and the causal deterministic launch order
#    (shortest first, which the diagonal-first tickets need when the grid is not resident) ends the launch with
#    the last kv head's longest key tiles: a tail four times longer relative to the launch. If so, the GQA ticket rows' gap to
#    the fp32 ones should shrink with more kv heads per query head (32:16 between 32:8 and 32:32).
# 2: bench/cp_sim.py, 128k tokens, 16 heads of 128, LPT, the ring's real step calls on one GPU (forward, backward).
set -u
source "$(dirname "$0")/../stage.sh"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=30 stage invariant 400 python3 bench/invariant.py --tokens 32768 --heads 32:8 32:16 32:32 --reps 5 \
    --out-dir "$OUT"
  exit
fi
if [ "$1" = 2 ]; then
  TAIL_LINES=20 stage cp_sim 400 python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt --reps 2
  mv "$OUT"/*cp_sim*.json "$OUT/cp-sim-128k.json" 2>/dev/null
  exit
fi
