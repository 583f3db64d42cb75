#!/usr/bin/env bash
# Every test that needs no GPU, as CI runs it: the main suite, then the Numba-simulator tests in their own
# process (NUMBA_ENABLE_CUDASIM is read once, when numba is first imported). GPU tests skip themselves here;
# on a GPU machine they run too (tools/gpu_run.sh runs them with the sanitizer and the benchmark).
set -u
cd "$(dirname "$0")/.."
run() {
  "$@"; local rc=$?
  if [ $rc -eq 5 ]; then echo "error: pytest collected no tests for: $*" >&2; return 1; fi  # 5 = nothing ran
  return $rc
}
status=0
run python -m pytest -q "$@" || status=1
NUMBA_ENABLE_CUDASIM=1 run python -m pytest -q -m sim tests/test_numba_sim.py tests/test_decode.py || status=1
exit $status
