#!/usr/bin/env bash
# Fifteenth session, last call: the suites the forward's new default (late_pv_wait) reaches that the earlier calls
# did not finish: the work-list suite (its JIT compiles ran past the stage limit) and the ring / cp_invariant
# suite with staged ranks on one GPU, on 8 pytest-xdist workers so that the compiles run side by side (.devwheels
# carries pytest-xdist and execnet).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_15c.sh
set -u
source "$(dirname "$0")/../stage.sh"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -n 8"
TAIL_LINES=6 stage worklist 330 $PYTEST tests/kernels/test_worklist_gpu.py
TAIL_LINES=6 stage cp 200 $PYTEST tests/cp/test_cp_gpu.py
