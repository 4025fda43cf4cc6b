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
