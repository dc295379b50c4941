#!/usr/bin/env bash
# The first GPU run's checks, for a device machine lent for minutes: what reading the CUDA and
# NCCL path found, answered on a GPU in under 8 minutes on one GPU (the steps' timeouts add up
# to 470 s there). Every step runs under `timeout` and prints one line "PASS|FAIL|SKIP <n>
# <name> (<s> s): <detail>"; the lines, with the machine and the verdict, go to one summary
# file to commit (SUMMARY, default benchmarks/gpu_quick_summary.md; a copy and every step's
# log in $OUT when set, else /tmp/gpu_quick).
#
#   benchmarks/gpu_quick.sh                 # on the GPU machine, from anywhere
#   GPU_QUICK_DRY=1 benchmarks/gpu_quick.sh # the plan: each step's number, name, timeout, command
#   GPU_QUICK_ONLY="6 7" GPU_QUICK_DEVICE=cpu benchmarks/gpu_quick.sh   # some steps, the checks on the CPU
#
# One GPU: the build against the torch installed there (torch 2.11 on the lent machines); the
# one-GPU tests (pp=2 through the loopback group, each rank on its own stream), rerun once
# under CUDA_LAUNCH_BLOCKING=1 when some fail, saying which then passed; one step under
# torch.autocast("cuda", bfloat16) against one process; set_sync_debug_mode("warn") around a
# steady zbv step, expecting no warning; a NCCL world of one: abort, destroy_process_group,
# init again, one all-reduce; max_memory_allocated against the simulated peak (1f1b, zbv);
# zbpipe bench --device cuda at pp=1 (the realization gap). Two or more GPUs add the NCCL
# tests, the bench at pp=2 (and pp=4 with four GPUs), and a stopped peer kept alive 90 s, then
# the recovery recipe, once on WORLD and once on a new_group. The Python checks are
# benchmarks/gpu_checks.py (each runs on the CPU too: tests/tools/test_gpu_quick.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# This tree's zbpipe once it is built in place (step 1, or a development tree's build), else the
# installed one: an unbuilt tree first on the path would hide an installed wheel (CI's form).
tree_first() {
  if compgen -G "zbpipe/_C*.so" >/dev/null && [[ ":${PYTHONPATH:-}:" != *":$PWD:"* ]]; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
}
tree_first
out="${OUT:-/tmp/gpu_quick}"
summary="${SUMMARY:-benchmarks/gpu_quick_summary.md}"
dry="${GPU_QUICK_DRY:-0}"
only="${GPU_QUICK_ONLY:-}"                       # step numbers to run (default: all)
dev=(--device "${GPU_QUICK_DEVICE:-cuda}")       # gpu_checks.py's device (cpu: the tests of this script)
py="$(command -v python3 || command -v python)"
failed=0
mkdir -p "$out"

# step N NAME SECONDS CMD...: CMD under `timeout SECONDS` (its output in $out/stepN.log), then
# one line: PASS (exit 0), SKIP (exit 77) or FAIL (any other exit, or the timeout), with the
# last PASS/FAIL/SKIP line CMD printed, else its last line.
step() {
  local n=$1 name=$2 limit=$3
  shift 3
  if [ -n "$only" ] && [[ " $only " != *" $n "* ]]; then return 0; fi
  if [ "$dry" = 1 ]; then
    echo "PLAN $n $name (timeout $limit s): $(echo "$*" | tr -s ' \n' '  ')"
    return 0
  fi
  local t0=$SECONDS log="$out/step$n.log" rc word detail
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  detail="$(grep -E '^(PASS|FAIL|SKIP) ' "$log" | tail -1 | cut -d' ' -f2-)"
  case $rc in
    0) word=PASS ;;
    77) word=SKIP ;;
    124 | 137) word=FAIL detail="timed out after $limit s" ;;
    *) word=FAIL ;;
  esac
  [ -n "$detail" ] || detail="$(tail -n 1 "$log")"
  [ $word = FAIL ] && failed=1
  echo "$word $n $name ($((SECONDS - t0)) s): $detail" | tee -a "$summary"
}

# skip N NAME SECONDS WHY: the line of a step this machine cannot run (its timeout counted in the plan).
skip() {
  if [ -n "$only" ] && [[ " $only " != *" $1 "* ]]; then return 0; fi
  if [ "$dry" = 1 ]; then
    echo "PLAN $1 $2 (timeout $3 s): skipped when $4"
    return 0
  fi
  echo "SKIP $1 $2 (0 s): $4" | tee -a "$summary"
}

ngpu="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [ "$dry" != 1 ]; then
  {
    echo "# gpu_quick.sh summary"
    echo
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    echo "machine: $(nvidia-smi -L 2>/dev/null | tr '\n' ';' || echo 'no nvidia-smi'); $(nproc) CPUs"
    echo "torch: $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1); GPUs: $ngpu"
    echo
  } >"$summary"
fi

ONE_GPU_TESTS=(tests/runtime/test_device_cuda.py
  "tests/runtime/test_checkpointing.py::test_one_recomputation_in_i_and_exact"
  "tests/runtime/test_checkpointing.py::test_an_error_inside_i_leaves_the_keep_flag_lowered")

# ---- one GPU ---------------------------------------------------------------------------------
step 1 "build against the installed torch" 160 bash -c '
  inc="$('"$py"' -c "import sysconfig; print(sysconfig.get_paths()[\"include\"])")"
  [ -f "$inc/Python.h" ] || { echo "FAIL no Python.h in $inc: install the headers (apt-get install python3-dev)"; exit 1; }
  t0=$SECONDS
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE='"$py"' >/dev/null &&
    cmake --build build/gpu -j"$(nproc)" || exit 1
  echo "PASS built in $((SECONDS - t0)) s"'
tree_first

step 2 "one-GPU tests" 100 "$py" -m pytest -p no:cacheprovider -q -rfE "${ONE_GPU_TESTS[@]}" -k "not nccl"
fails="$(grep -E '^(FAILED|ERROR) ' "$out/step2.log" 2>/dev/null | awk '{print $2}' | sort -u | tr '\n' ' ')"
if [ "$dry" = 1 ] || [ -n "$fails" ]; then
  # shellcheck disable=SC2086 - the failed test ids, one word each
  step 3 "the failed one-GPU tests again, under CUDA_LAUNCH_BLOCKING=1" 45 \
    env CUDA_LAUNCH_BLOCKING=1 "$py" -m pytest -p no:cacheprovider -q -rA ${fails:-"<the failed ids of step 2>"}
  if [ "$dry" != 1 ]; then
    passed="$(grep -E '^PASSED ' "$out/step3.log" | awk '{print $2}' | tr '\n' ' ')"
    echo "  step 3: passed on the rerun: ${passed:-none}; failed in step 2: $fails" | tee -a "$summary"
  fi
else
  skip 3 "the failed one-GPU tests again, under CUDA_LAUNCH_BLOCKING=1" 45 "no test failed in step 2"
fi
step 4 "one step under autocast(cuda, bfloat16) against one process" 25 "$py" benchmarks/gpu_checks.py autocast "${dev[@]}"
step 5 "set_sync_debug_mode(warn) around a steady zbv step" 25 "$py" benchmarks/gpu_checks.py sync "${dev[@]}"
step 6 "NCCL world of one: abort, destroy, init again, all-reduce" 30 "$py" benchmarks/gpu_checks.py nccl "${dev[@]}"
step 7 "max_memory_allocated against the simulated peak" 25 "$py" benchmarks/gpu_checks.py memory "${dev[@]}"
step 8 "zbpipe bench --device cuda at pp=1" 60 "$py" benchmarks/gpu_checks.py bench "${dev[@]}" --pp 1 --json "$out/bench_pp1.json"

# ---- two or more GPUs ------------------------------------------------------------------------
if [ "$dry" = 1 ] || [ "$ngpu" -ge 2 ]; then
  step 9 "NCCL tests (two GPUs)" 240 "$py" -m pytest -p no:cacheprovider -q -rfE tests/runtime/test_device_cuda.py -k nccl
  step 10 "zbpipe bench --device cuda at pp=2" 120 "$py" benchmarks/gpu_checks.py bench "${dev[@]}" --pp 2 --json "$out/bench_pp2.json"
  step 11 "zbpipe bench --device cuda at pp=4" 120 "$py" benchmarks/gpu_checks.py bench "${dev[@]}" --pp 4 --json "$out/bench_pp4.json"
  step 12 "a stopped peer kept alive 90 s, then the recovery recipe (WORLD, new_group)" 330 \
    "$py" benchmarks/gpu_checks.py recovery "${dev[@]}" --stopped-s 90
else
  for s in "9:NCCL tests (two GPUs):240" "10:zbpipe bench --device cuda at pp=2:120" \
           "11:zbpipe bench --device cuda at pp=4:120" \
           "12:a stopped peer kept alive 90 s, then the recovery recipe (WORLD, new_group):330"; do
    IFS=: read -r n name limit <<<"$s"
    skip "$n" "$name" "$limit" "fewer than two GPUs ($ngpu)"
  done
fi

if [ "$dry" != 1 ]; then
  { echo; echo "verdict: $([ $failed = 0 ] && echo 'every step passed or was skipped' || echo 'some steps FAILED')"; } \
    | tee -a "$summary"
  cp "$summary" "$out/" 2>/dev/null || true
fi
exit $failed
