#!/usr/bin/env bash
# Fifth call: the invariant parameter gradients on the GPU (bf16, cp = 1; no two-GPU machine): one training step of
# the tiny model with and without them, then how far apart the two gradients are.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant5.sh
set -u
source "$(dirname "$0")/../stage.sh"
export OUT
mkdir -p "$OUT/fixed" "$OUT/plain" "$OUT/onegemm"
OUT="$OUT/fixed" TAIL_LINES=3 stage grads_fixed 150 torchrun --standalone --nproc-per-node 1 \
  bench/cp_invariance_model.py run --invariant-grads 1 --tokens 4096
OUT="$OUT/plain" TAIL_LINES=3 stage grads_plain 150 torchrun --standalone --nproc-per-node 1 \
  bench/cp_invariance_model.py run --invariant-grads 0 --tokens 4096
# autograd with one product per Linear (no row blocks): its weight gradients are one fp32-accumulated GEMM each,
# where the row-blocked forward makes autograd add 64 bf16-rounded block gradients
OUT="$OUT/onegemm" TAIL_LINES=3 stage grads_onegemm 150 torchrun --standalone --nproc-per-node 1 \
  bench/cp_invariance_model.py run --invariant-grads 0 --row-invariant 0 --tokens 4096
TAIL_LINES=4 stage grads_compare 60 python3 -c "
import torch
runs = {k: torch.load(f'$OUT/{k}/model-cp1.pt') for k in ('fixed', 'plain', 'onegemm')}
def rel(x, y):  # the largest norm-relative difference over the parameters
    return max(float((x['grads'][n].float() - y['grads'][n].float()).norm() / y['grads'][n].float().norm())
               for n in x['grads'])
for a, b in (('fixed', 'onegemm'), ('plain', 'onegemm'), ('fixed', 'plain')):
    print(f'bf16 weight gradients, {a} vs {b}: worst norm-relative difference {rel(runs[a], runs[b]):.2e}')"
