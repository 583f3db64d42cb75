#!/usr/bin/env bash
# The one command that checks rawflash on a GPU machine: precompile, GPU tests, compute-sanitizer, benchmark. A
# contributor runs it from the repository root of a GPU machine after a kernel change (tests, sanitize) and to
# measure one (bench ...). Example: SANITIZE_JOBS=9 tools/gpu_run.sh tests sanitize bench --dtype bfloat16
#   tools/gpu_run.sh [-h|--help] [STEP...] [bench ARGS...]
#   (no step: tests, sanitize; bench takes every argument after it, so it comes last)
# Steps:
#     tests      every GPU test (the default forward path: wgmma on an H200 where it applies)
#     numba      only tests/test_numba_gpu.py (the Numba twins on the GPU), in NUMBA_JOBS (default 8)
#                processes side by side, each a run of consecutive tests: compiling the twins (6 - 8 s each) is
#                the cost, on the CPU cores (use TESTS="tests --ignore=tests/test_numba_gpu.py" with tests to
#                avoid running them twice; NUMBA_K: a pytest -k expression that picks some of them)
#     tests-mma  the kernel tests again with RAWFLASH_WGMMA=0 (the mma.sync forward on the same GPU)
#     hopper     only tests/test_gpu_hopper.py and tests/test_gpu_fa3.py (the wgmma and FA3 forms)
#     hopper-cp-async  tests/test_gpu_hopper.py with RAWFLASH_FA3=0 (the backward's cp.async wgmma form too)
#     fp8        tests/test_gpu_fp8.py, then rawflash bench of the FP8 forward beside bf16 (d 128 / 256,
#                N 4k / 16k; FP8_REPEATS)
#     sanitize   compute-sanitizer memcheck, racecheck and synccheck over tools/sanitize.py's workload
#     bench-decode / bench-features   rawflash bench --decode / --features (DECODE_REPEATS, FEATURE_REPEATS;
#                FEATURE_DTYPES, e.g. "bfloat16 float8_e4m3fn" for the FP8 forward's cases too,
#                FEATURE_DIRECTIONS)
#     bench-decode-quick              rawflash bench --decode --quick (12 cases, about 2 minutes)
#     bench-mla  rawflash bench --mla (DeepSeek-V3's prefill: 128 heads, head_dim_qk 192, head_dim_v 128, bf16,
#                N 4k - 16k, forward and backward, beside SDPA's cuDNN backend; MLA_REPEATS, default 10), twice:
#                RAWFLASH_DV_FORM=0 (v zero-padded), then =1 (FA3's DV forms, forward and backward; --tag dv,
#                bench_mla_dv.log)
#     profile    Nsight Compute (--clock-control none) on tools/profile_kernels.py's cases: PROFILE_CASES
#                (default "softcap fp8 plain decode"), d = PROFILE_D (128; decode is always 128),
#                N = PROFILE_N (4096); one file ncu_<case>.txt per case (decode_fp8: decode on an FP8 cache;
#                latent: decode on MLA's latent cache, 128 heads;
#                paged: the paged prefill in pages of PROFILE_PAGE, default 16)
#     paged      the paged prefill: its GPU tests, the sanitizer over its workload (bfloat16, float16),
#                rawflash bench --paged and tools/tune_paged.py (pages of 64 and 16)
#     SCRIPT.py  python3 SCRIPT.py, its output appended to extra.log
#     bench ARGS rawflash bench ARGS (the FA2 paper's sweep against the peers present)
# Logs go to $OUT (or ./gpu_logs). PRECOMPILE_FILTER limits the precompile step; TESTS (default: tests) the test
# paths and TESTS_K (a pytest -k expression) the tests step; SANITIZE_TOOLS (memcheck racecheck synccheck) and
# SANITIZE_DTYPES (float16 bfloat16 float32) the sanitizer step (SANITIZE_JOBS=N > 1: every tool x dtype as its
# own process, side by side, each split further into SANITIZE_SHARDS processes (default 1; tools/sanitize.py's
# SANITIZE_SHARD: float32's racecheck alone takes more than 420 s on an H100); SANITIZE_ONLY=decode, splitk, fa3,
# fp8, paged, mla, wide (head_dim 512), latent (decode's latent cache) or feature:NAME, e.g. feature:alibi (that
# feature in every form): that part of its workload alone); TAR_TO=path packs every log into one archive at the
# end (for machines that return only a few files).
set -uo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then  # the comment above, as usage
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  exit 0
fi
OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
# compute-sanitizer TOOL over tools/sanitize.py's workload for DTYPES, into LOG; prints its summary line
sanitize_one() {  # TOOL LOG DTYPES...
  local tool=$1 log=$2; shift 2
  compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tools/sanitize.py "$@" > "$log" 2>&1
  local rc=$? clean
  clean=$(grep -c 'ERROR SUMMARY: 0 errors\|0 hazards displayed' "$log")
  echo "compute-sanitizer $tool $*${SANITIZE_SHARD:+ (shard $SANITIZE_SHARD)}: exit $rc; $clean clean summaries"
  tail -3 "$log"
  return $rc
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 tools/precompile.py --filter "${PRECOMPILE_FILTER:-}" 2>&1 | tee "$OUT/precompile.log" | tail -5 || status=1
i=0
while [ $i -lt ${#steps[@]} ]; do
  step=${steps[$i]}; i=$((i + 1))
  case $step in
    tests)
      python3 -m pytest -q -m "gpu" -p no:cacheprovider ${TESTS:-tests} ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40 || status=1 ;;
    numba)
      python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider tests/test_numba_gpu.py \
        ${NUMBA_K:+-k "$NUMBA_K"} 2>/dev/null \
        | grep '::' > "$OUT/.numba_ids"
      n=$(wc -l < "$OUT/.numba_ids"); jobs=${NUMBA_JOBS:-8}; per=$(( (n + jobs - 1) / jobs )); pids=()
      for j in $(seq 0 $((jobs - 1))); do  # consecutive runs of the ids: a twin's tests share its compiled kernels
        sed -n "$((j * per + 1)),$(((j + 1) * per))p" "$OUT/.numba_ids" > "$OUT/.numba_ids_$j"
        [ -s "$OUT/.numba_ids_$j" ] || continue
        mapfile -t ids < "$OUT/.numba_ids_$j"  # ids hold spaces: one array element per line
        python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > "$OUT/numba_gpu_$j.log" 2>&1 &
        pids+=("$!")
      done
      for x in "${pids[@]}"; do wait "$x" || status=1; done
      echo "numba GPU tests: $n collected in ${#pids[@]} processes"
      for j in $(seq 0 $((jobs - 1))); do [ -f "$OUT/numba_gpu_$j.log" ] && tail -1 "$OUT/numba_gpu_$j.log"; done
      cat "$OUT"/numba_gpu_*.log > "$OUT/numba_gpu.log"; rm -f "$OUT"/numba_gpu_*.log "$OUT"/.numba_ids* ;;
    tests-mma)
      RAWFLASH_WGMMA=0 python3 -m pytest -q -m "gpu" -p no:cacheprovider tests/test_gpu_kernels.py 2>&1 \
        | tee "$OUT/gpu_tests_mma.log" | tail -15 || status=1 ;;
    hopper)
      python3 -m pytest -q -m "gpu" -p no:cacheprovider tests/test_gpu_hopper.py tests/test_gpu_fa3.py 2>&1 \
        | tee "$OUT/gpu_hopper.log" | tail -25 || status=1 ;;
    hopper-cp-async)
      RAWFLASH_FA3=0 python3 -m pytest -q -m "gpu" -p no:cacheprovider tests/test_gpu_hopper.py 2>&1 \
        | tee "$OUT/gpu_hopper_cp_async.log" | tail -15 || status=1 ;;
    sanitize)
      pids=()
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        if [ "${SANITIZE_JOBS:-1}" -gt 1 ]; then  # one process per (tool, dtype, shard), side by side
          shards=${SANITIZE_SHARDS:-1}
          for dt in ${SANITIZE_DTYPES:-float16 bfloat16 float32}; do
            for sh in $(seq 0 $((shards - 1))); do
              name=${tool}_$dt; [ "$shards" -gt 1 ] && name=${name}_$sh
              SANITIZE_SHARD=$sh/$shards sanitize_one $tool "$OUT/sanitize_$name.log" $dt > "$OUT/.summary_$name" &
              pids+=("$!:$name")
            done
          done
        else
          sanitize_one $tool "$OUT/sanitize_$tool.log" ${SANITIZE_DTYPES:-float16 bfloat16 float32} || status=1
        fi
      done
      for x in ${pids[@]+"${pids[@]}"}; do
        wait "${x%%:*}" || status=1
        cat "$OUT/.summary_${x#*:}"; rm -f "$OUT/.summary_${x#*:}"
      done ;;
    fp8)
      python3 -m pytest -q -m "gpu" -p no:cacheprovider tests/test_gpu_fp8.py -s 2>&1 | tee "$OUT/gpu_fp8.log" \
        | tail -12 || status=1
      python3 -m rawflash.cli bench --impl rawflash-fa2 --direction fwd --dtype bfloat16 --dtype float8_e4m3fn \
        --head-dims 128,256 --seqlens 4096,16384 --repeats ${FP8_REPEATS:-10} --out "$OUT" --tag fp8 2>&1 \
        | tee "$OUT/bench_fp8.log" | tail -20 || status=1 ;;
    profile)
      for case in ${PROFILE_CASES:-softcap fp8 plain decode}; do
        case $case in
          fp8) regex='fa3_fwd_sm90_fp8'; skip=2; count=1 ;;
          decode|decode_fp8) regex='decode_'; skip=2; count=2 ;;  # b = 64: decode_split (append folded), combine
          latent) regex='decode_split'; skip=1; count=1 ;;  # the split pass alone (an append and a combine beside it)
          paged) regex='fa3_fwd_sm90'; skip=2; count=1 ;;  # a call: the REF_FIRST launch, then its way back
          *) regex='fa3_(fwd|bwd)_sm90'; skip=2; count=2 ;;
        esac
        ncu --clock-control none --kernel-name "regex:$regex" --launch-skip $skip --launch-count $count \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section SchedulerStats --section InstructionStats --section Occupancy --section LaunchStats \
          --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
          python3 tools/profile_kernels.py --case $case --seqlen ${PROFILE_N:-4096} --head-dim ${PROFILE_D:-128} \
          --page ${PROFILE_PAGE:-16} \
          > "$OUT/ncu_$case.txt" 2>&1 || status=1
        echo "ncu $case: $(grep -c 'Section: SpeedOfLight\|GPU Speed Of Light' "$OUT/ncu_$case.txt") kernels profiled"
      done ;;
    paged)
      python3 -m pytest -q -m "gpu" -p no:cacheprovider tests/test_paged_prefill.py 2>&1 | tee "$OUT/gpu_paged.log" \
        | tail -5 || status=1
      (export SANITIZE_ONLY=paged; rc=0
       for tool in memcheck racecheck synccheck; do
         sanitize_one $tool "$OUT/sanitize_paged_$tool.log" bfloat16 float16 || rc=1
       done; exit $rc) || status=1
      python3 -m rawflash.cli bench --paged --out "$OUT" 2>&1 | tee "$OUT/bench_paged.log" | tail -16 || status=1
      python3 tools/tune_paged.py --pages 64,16 2>&1 | tee "$OUT/tune_paged.log" || status=1 ;;
    bench-decode)
      python3 -m rawflash.cli bench --decode --repeats ${DECODE_REPEATS:-20} --out "$OUT" 2>&1 \
        | tee "$OUT/bench_decode.log" \
        | tail -60 || status=1 ;;
    bench-decode-quick)
      python3 -m rawflash.cli bench --decode --quick --repeats ${DECODE_REPEATS:-10} --out "$OUT" --tag quick 2>&1 \
        | tee "$OUT/bench_decode_quick.log" | tail -40 || status=1 ;;
    bench-mla)
      RAWFLASH_DV_FORM=0 python3 -m rawflash.cli bench --mla --repeats ${MLA_REPEATS:-10} --out "$OUT" 2>&1 \
        | tee "$OUT/bench_mla.log" | tail -20 || status=1
      RAWFLASH_DV_FORM=1 python3 -m rawflash.cli bench --mla --repeats ${MLA_REPEATS:-10} --out "$OUT" --tag dv 2>&1 \
        | tee "$OUT/bench_mla_dv.log" | tail -20 || status=1 ;;
    bench-features)
      fdt=(); for x in ${FEATURE_DTYPES:-bfloat16}; do fdt+=(--dtype "$x"); done
      fdir=(); for x in ${FEATURE_DIRECTIONS:-fwd bwd}; do fdir+=(--direction "$x"); done
      python3 -m rawflash.cli bench --features "${fdt[@]}" "${fdir[@]}" --repeats ${FEATURE_REPEATS:-10} \
        --out "$OUT" 2>&1 \
        | tee "$OUT/bench_features.log" | tail -60 || status=1 ;;
    bench)
      python3 -m rawflash.cli bench "${steps[@]:$i}" --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
      i=${#steps[@]} ;;
    *) python3 "$step" 2>&1 | tee -a "$OUT/extra.log" || status=1 ;;
  esac
done
[ -n "${TAR_TO:-}" ] && tar czf "$TAR_TO" -C "$OUT" .
exit $status
