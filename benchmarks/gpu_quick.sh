#!/usr/bin/env bash
# The short GPU check for a lent device machine (one GPU, minutes of time; under 10 minutes):
# checks for Python.h, builds zbpipe against the CUDA torch there, runs the CUDA tests (one GPU:
# the NCCL pair tests skip; pp=2 runs through the loopback group with CUDA tensors, each rank on
# a stream of its own, so stream waits, send lifetimes and a failing peer's abort run on real
# streams) and a short host-overhead benchmark on CUDA. Everything goes to stdout and, when OUT
# is set, to $OUT.
#   benchmarks/gpu_quick.sh          (the full check is benchmarks/gpu_check.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
py="$(command -v python3)"
status=0
nvidia-smi -L
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
inc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if [ ! -f "$inc/Python.h" ]; then
  echo "no Python.h in $inc: install this Python's headers (e.g. apt-get install python3-dev) first"; exit 1
fi
t0=$SECONDS
if ! { cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
       && cmake --build build/gpu -j"$(nproc)"; } >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40; echo "BUILD FAILED"; exit 1
fi
echo "-- built in $((SECONDS - t0)) s"
timeout 300 "$py" -m pytest -p no:cacheprovider -q -rs tests/runtime/test_device_cuda.py \
  "tests/runtime/test_checkpointing.py::test_one_recomputation_in_i_and_exact" -k "cuda or one_gpu or nccl" \
  2>&1 | tee "$out/tests.log" | tail -25 || status=1
timeout 150 "$py" benchmarks/bench_dispatch.py --pp 1 --device cuda --sizes tiny,medium \
  --schedules zbv,dualpipev --libs torch,zbpipe --reps 3 --warmup 2 2>&1 | tee "$out/bench.log" | tail -20 || status=1
# zbpipe bench on the CUDA path (sleep kernels on the compute stream, NCCL), one rank per GPU;
# one GPU: pp=1 (no hop: the executor's own overhead against the simulation).
ngpu="$("$py" -c "import torch; print(torch.cuda.device_count())")"
bench_pp=$(( ngpu >= 4 ? 4 : (ngpu >= 2 ? 2 : 1) ))
timeout 240 "$py" -m zbpipe bench --device cuda --pp "$bench_pp" --microbatches 8 --f 2 --i 2 --w 2 \
  --reps 5 --json "$out/bench_cuda.json" 2>&1 | tee "$out/bench_cuda.log" | tail -30 || status=1
echo "-- gpu_quick done after $((SECONDS - t0)) s, status $status"
exit $status
