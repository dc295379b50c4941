#!/usr/bin/env bash
# The GPU check, in one script: builds zbpipe against the installed (CUDA) torch, runs the CUDA
# tests and the benchmarks that need a GPU, and prints everything to stdout.
#
#   benchmarks/gpu_check.sh            # from the repository root or anywhere
#
# With one GPU: every multi-stage schedule on one rank on CUDA (zbv, interleaved, v_half, v_min,
# dualpipev with and without OVERLAP_F_B overlap), exact against a CPU reference with per-action
# device timing (tests/runtime/test_device_cuda.py), then the host-overhead benchmark on CUDA
# (bench_dispatch.py --pp 1: multi-stage schedules on one rank, zbpipe vs torch.distributed.
# pipelining) and DualPipeV overlapped vs in sequence on one rank. With two or more GPUs also the
# NCCL P2P tests (same file: exactness over NCCL with device_id bound, a stopped peer failing
# the other rank in bounded time) and bench_dispatch.py --device cuda (pp=2, one GPU per rank).
# A single GPU cannot hold two NCCL ranks (NCCL refuses a duplicate GPU), so those need two.
# Needs: a CUDA build of torch 2.13, cmake, ninja, pytest (nothing is installed).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo; echo "## $*"; }
run() {  # run CMD...: prints its exit code, remembers a failure, goes on
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "-- exit $rc after $((SECONDS - t0)) s: $*"
  [ $rc -eq 0 ] || status=1
  return 0
}

step "machine"
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
PY
ngpu=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$ngpu" -lt 1 ]; then
  echo "no CUDA GPU here: nothing to check (the CPU suite is: python -m pytest tests)"
  exit 2
fi

step "build"
run bash -c "cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build/gpu -j"

step "CUDA tests ($ngpu GPU(s); NCCL P2P tests run only with two or more)"
run timeout 1200 python -m pytest tests/runtime/test_device_cuda.py -q -rs

step "the NCCL model and the overlap tests (CPU, in-process)"
run timeout 900 python -m pytest tests/runtime/test_nccl_model.py tests/runtime/test_stream_ordered_waits.py tests/runtime/test_overlap_f_b.py -q

step "host overhead on CUDA: multi-stage schedules on one rank"
run timeout 1200 python benchmarks/bench_dispatch.py --pp 1 --device cuda --sizes tiny,medium \
  --schedules zbv,interleaved_1f1b,dualpipev

step "DualPipeV on one GPU: OVERLAP_F_B overlapped vs in sequence"
run timeout 1200 python benchmarks/bench_dispatch.py --pp 1 --device cuda --overlap

if [ "$ngpu" -ge 2 ]; then
  step "bench_dispatch on NCCL: pp=2, one GPU per rank"
  run timeout 1800 python benchmarks/bench_dispatch.py --device cuda
  run timeout 1200 python benchmarks/bench_dispatch.py --device cuda --overlap
else
  step "skipped: NCCL P2P tests and bench_dispatch --device cuda need two GPUs (NCCL refuses two ranks on one GPU)"
fi

step "done: $([ $status -eq 0 ] && echo 'all steps passed' || echo 'some steps FAILED (see exit codes above)')"
exit $status
