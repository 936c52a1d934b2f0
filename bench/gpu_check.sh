#!/usr/bin/env bash
# The checks only a CUDA machine can make, in one time-boxed run (a few minutes on one H200):
#
#   tests     the engine's test suite on the GPU (engines default to device cuda and the compiled
#             Triton kernels there; the tests force Triton's interpreter only where no GPU is present)
#   kernels   python -m bench.gpu_kernels --quick: every kernel against its float32 reference, the
#             determinism promises on the hardware, timings beside the torch path
#   overhead  python -m bench.server_overhead on the GPU: what HTTP adds at concurrency 1 and 32,
#             one process and 4 API server processes
#   trace     python -m bench.burst_trace on the GPU: where a wave of 32 streams spends its time, in
#             process and behind 4 and 8 API servers; with .dev/base (bench/gpu_carry.sh's BASE=),
#             that commit's 4 API servers too, interleaved (not in the default steps)
#
# Usage (repo root):  bash bench/gpu_check.sh OUT_DIR [tests] [kernels] [overhead] [trace]
# (default: tests kernels overhead)
# Needs the project's Python packages (pytest-xdist for the tests) and redis-server on PATH (the KV
# tier tests start their own). Each step has its own time limit (seconds, from the environment:
# TESTS_S, KERNELS_S, OVERHEAD_S, TRACE_S); a step that fails or runs out of time never stops the next one,
# and a stopped pytest still writes its summary and JUnit XML. TESTS narrows the test step (pytest
# paths or node ids, default tests/engine); OVERHEAD_ARGS adds flags to the overhead bench, later
# ones win (e.g. "--burst-wait-ms 25 0 --api-server-count 1 4 8"; with .dev/base, "--base .dev/base"
# serves each HTTP mode from the base commit too); TRACE_ARGS, the trace's. Everything lands in OUT_DIR.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [tests] [kernels] [overhead] [trace]}
shift
steps=${*:-tests kernels overhead}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
start=$(date +%s)
stamp() { echo "=== $1 at +$(($(date +%s) - start))s"; }

stamp setup
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  echo "cores: $(nproc)"
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
} 2>&1 | tee "$out/setup.log"

for step in $steps; do
  case $step in
  tests)
    stamp tests
    workers=$(($(nproc) > 16 ? 15 : $(nproc) - 1))
    timeout -s INT "${TESTS_S:-300}" "$py" -m pytest ${TESTS:-tests/engine} -q -n "$workers" -p no:cacheprovider \
      --timeout 150 -rfE --junitxml="$out/engine_tests.xml" 2>&1 | tee "$out/engine_tests.log" | tail -80
    ;;
  kernels)
    stamp kernels
    timeout -s INT "${KERNELS_S:-150}" "$py" -m bench.gpu_kernels --quick --json "$out/gpu_kernels.json" 2>&1 \
      | tee "$out/gpu_kernels.log" | tail -40
    # the attention variants again in float32, where a compiled kernel's error stands out
    timeout -s INT 60 "$py" -m bench.gpu_kernels --quick --only attention --dtype float32 \
      --json "$out/gpu_kernels_fp32.json" 2>&1 | tee "$out/gpu_kernels_fp32.log" | tail -8
    ;;
  overhead)
    stamp overhead
    timeout -s INT "${OVERHEAD_S:-200}" "$py" -m bench.server_overhead --device cuda --dtype bfloat16 \
      --api-server-count 1 4 --concurrency 1 32 --num-requests 32 --max-tokens 16 --repeats 3 --num-threads 4 \
      ${OVERHEAD_ARGS:-} --out "$out/server_overhead.json" 2>&1 | tee "$out/overhead.log" | tail -30
    ;;
  trace)
    stamp trace
    base=()
    if [ -d .dev/base ]; then base=(base/4 --base .dev/base); fi
    timeout -s INT "${TRACE_S:-240}" "$py" -m bench.burst_trace --device cuda --dtype bfloat16 --num-threads 4 \
      --modes in-process 4 8 "${base[@]}" ${TRACE_ARGS:-} --out "$out/burst_trace.json" 2>&1 \
      | tee "$out/trace.log" | tail -30
    ;;
  *)
    echo "unknown step '$step' (tests, kernels, overhead, trace)" >&2
    ;;
  esac
done
stamp done
