#!/usr/bin/env bash
# Every test that needs no GPU, as CI runs it: a contributor runs it before every commit. The main suite and,
# beside it in a second process, the Numba-simulator tests (NUMBA_ENABLE_CUDASIM is read once, when numba is first
# imported, so they cannot share a process). The two run at the same time because the main suite's longest part,
# the offline compile of every instantiation, waits on its worker processes while the simulator is one busy core:
# on CI's two cores that keeps both cores working. The simulator's output is printed after the main suite's, not
# interleaved. GPU tests skip themselves here; on a GPU machine they run too (tools/gpu_run.sh runs them with the
# sanitizer and the benchmark). RAWFLASH_TEST_SERIAL=1 runs the two one after the other (for timing either alone).
#   tools/test.sh [-h|--help] [PYTEST ARGS...]    (the arguments go to the main suite's pytest)
#   e.g. tools/test.sh -x -k 'forms or decode'
set -u
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then  # the comment above, as usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
run() {
  "$@"; local rc=$?
  if [ $rc -eq 5 ]; then echo "error: pytest collected no tests for: $*" >&2; return 1; fi  # 5 = nothing ran
  return $rc
}
sim() {
  NUMBA_ENABLE_CUDASIM=1 run python -m pytest -q -m sim tests/test_numba_sim.py tests/test_decode.py \
    tests/test_decode_latent.py
}
status=0
if [ "${RAWFLASH_TEST_SERIAL:-0}" = 1 ]; then
  run python -m pytest -q "$@" || status=1
  sim || status=1
  exit $status
fi
sim_log=$(mktemp "${TMPDIR:-/tmp}/rawflash-sim.XXXXXX")
sim >"$sim_log" 2>&1 &
sim_pid=$!
trap 'kill "$sim_pid" 2>/dev/null; rm -f "$sim_log"' EXIT  # an interrupted run leaves no simulator behind
run python -m pytest -q "$@" || status=1
wait "$sim_pid" || status=1
echo "---- Numba simulator tests (run beside the main suite) ----"
cat "$sim_log"
exit $status
