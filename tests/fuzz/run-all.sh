#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 120) each, one after another,
# niced and single-job, on the committed seeds plus a local working corpus.
# Logs: tests/fuzz/target/logs/<target>.log; crashes: tests/fuzz/artifacts/.
# Usage: tests/fuzz/run-all.sh [SECONDS] [TARGET...]
set -u
here="$(cd "$(dirname "$0")" && pwd)"
secs="${1:-120}"; shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(admission_review admission_http record profile kubeconfig)
logs="$here/target/logs"; mkdir -p "$logs"
cd "$logs"
for t in "${targets[@]}"; do
  dict=""
  case "$t" in
    admission_*) dict="-dict=$here/dicts/admission.dict" ;;
    kubeconfig) dict="-dict=$here/dicts/kubeconfig.dict" ;;
    profile) dict="-dict=$here/dicts/profile.dict" ;;
  esac
  mkdir -p "$here/work-corpus/$t"
  rm -f fuzz-0.log
  RUSTC_BOOTSTRAP=1 CARGO_BUILD_JOBS=1 nice -n 19 cargo fuzz run --fuzz-dir "$here" "$t" \
    "$here/work-corpus/$t" "$here/corpus/$t" -- \
    -max_total_time="$secs" -jobs=1 -workers=1 -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
    -print_final_stats=1 $dict > "$logs/$t.driver.log" 2>&1
  echo "$t: exit $?"
  [ -f fuzz-0.log ] && mv fuzz-0.log "$logs/$t.log"
done
