#!/usr/bin/env bash
# One device call (issues 3 and 5): the GPU test suite first (cut at TESTS_S seconds), then
# moebench's triton GEMM part against the vLLM-style kernel with
# vLLM's H200 configs on the same routings (vllm_style), the gate/up read-pattern probe
# (read_pattern), the decode launch-trimming A/B (decode_launches), the layer / alignment /
# routing / floor table of PERF section 3 (bench_triton), the same tune with and without
# compile workers (issue 5: where a tune's time goes). SKIP_TESTS / SKIP_VS / SKIP_READ /
# SKIP_DECODE / SKIP_BENCH / SKIP_TUNE=1 leave a step out.
# Results under $OUT.
#   PYTHONPATH=. bash benchmarks/device_reference.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a "$log"
if [ -z "${SKIP_TESTS:-}" ]; then
  step "pytest -m gpu tests/gpu"
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -n 15 | tee -a "$log"
fi
if [ -z "${SKIP_VS:-}" ]; then
  step "vllm_style"
  python3 -m benchmarks vllm_style ${VS_ARGS:-} 2>&1 | tee -a "$log" | tail -n 20
fi
if [ -z "${SKIP_READ:-}" ]; then
  step "read_pattern"
  python3 -m benchmarks read_pattern 2>&1 | tee -a "$log"
fi
if [ -z "${SKIP_DECODE:-}" ]; then
  step "decode_launches"
  python3 -m benchmarks decode_launches 2>&1 | tee -a "$log" | tail -n 20
  python3 -m benchmarks decode_launches --fp8 --tokens 1,16 2>&1 | tee -a "$log" | tail -n 12
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  step "bench_triton"
  python3 -m benchmarks bench_triton ${BENCH_ARGS:-} 2>&1 | tee -a "$log" | tail -n 30
fi
if [ -z "${SKIP_TUNE:-}" ]; then
  for cw in 0 ${COMPILE_WORKERS:-12}; do
    step "tune qwen3-30b-a3b --compile-workers $cw"
    TAIL=14 mb tune --model qwen3-30b-a3b --tokens 1,256,4096 --compile-workers "$cw" --out "$OUT/tune-cw$cw" \
      --results-dir "$R/tune-cw$cw"
  done
fi
step done
