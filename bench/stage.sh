# Sourced by the bench/*.sh session scripts: `stage NAME LIMIT_S CMD...` runs one stage with a time limit, its log in
# $OUT/NAME.log, and prints its exit code, duration and the log's last $TAIL_LINES lines (so one stuck or failing
# stage neither eats a device call nor hides the others).
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n "${TAIL_LINES:-12}" "$OUT/$name.log"
}

# `gpu_tests NAME LIMIT_S PYTEST_ARGS...`: a GPU test stage in $GPU_TEST_WORKERS (default 8) parallel pytest workers
# (pytest-xdist, in the device image): most of a GPU suite's time is its variants' first compiles (3-6 s each), which
# one worker runs one after another (the fifty-seventh session's suites ran out of a whole call that way).
gpu_tests() {
  local name=$1 limit=$2
  shift 2
  TAIL_LINES=${TAIL_LINES:-4} stage "$name" "$limit" python3 -m pytest -m gpu -q -n "${GPU_TEST_WORKERS:-8}" \
    -p no:cacheprovider -rfE "$@"
}

# `ncu_sass_pair CASE OURS_REGEX FA4_REGEX`: Nsight Compute's SASS-level samples (SourceCounters, WarpStateStats) of
# one launch of our kernel and one of flash-attn-4's for a bench/ncu_kernels.py case, the source pages as
# $OUT/sass_cute.csv.gz and $OUT/sass_flash_attn_4.csv.gz, and their comparison (bench/ncu_summary.py compare) in
# $OUT/ncu_compare.txt, whose head it prints.
ncu_sass_pair() {
  local case=$1 ncu who b p
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for who in "cute:$2" "flash_attn_4:$3"; do
    b=${who%%:*} p=${who#*:}
    TAIL_LINES=2 stage "ncu_$b" 120 "$ncu" --profile-from-start off --clock-control none --section SourceCounters \
      --section WarpStateStats --import-source no -k "regex:$p" --launch-count 1 --export "/tmp/src_$b" -f \
      python3 bench/ncu_kernels.py --cases "$case" --backends "$b"
    "$ncu" --import "/tmp/src_$b.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/sass_$b.csv.gz"
  done
  python3 bench/ncu_summary.py compare "$OUT/sass_cute.csv.gz" "$OUT/sass_flash_attn_4.csv.gz" > "$OUT/ncu_compare.txt"
  head -60 "$OUT/ncu_compare.txt"
}

# `bundle_folders_on_exit`: a call brings back few files, so at the script's exit the stages' folders under $OUT
# (JSON, reports) are packed into $OUT/results.tgz and removed.
bundle_folders_on_exit() {
  trap '(cd "$OUT" && ls -d */ >/dev/null 2>&1 && tar czf results.tgz */ && rm -rf -- */)' EXIT
}

# `kernels_table`: #11's S >= 4k points (hdim 128 and 64, 4k and 16k, causal and not; forward, backward and the
# deterministic backward) beside cuDNN and flash-attn-4, five interleaved rounds in device time, into $OUT/table:
# the `table` part of the session scripts since the fifty-third.
kernels_table() {
  TAIL_LINES=24 stage table 420 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute cudnn flash_attn_4 --rounds 5 \
    --queue-ahead-ms 3 --out-dir "$OUT/table"
}
