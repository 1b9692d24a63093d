#!/usr/bin/env bash
# One device call (issues 3 and 5): moebench's triton GEMM part against the vLLM-style kernel with
# vLLM's H200 configs on the same routings (vllm_style.py), the gate/up read-pattern probe
# (read_pattern.py), then the GPU test suite (cut at TESTS_S seconds). Results under $OUT.
#   PYTHONPATH=. bash benchmarks/device_reference.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a "$log"
step "vllm_style.py"
python3 benchmarks/vllm_style.py ${VS_ARGS:-} 2>&1 | tee -a "$log" | tail -n 20
step "read_pattern.py"
python3 benchmarks/read_pattern.py 2>&1 | tee -a "$log"
if [ -z "${SKIP_TESTS:-}" ]; then
  step "pytest -m gpu tests/gpu"
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -n 15 | tee -a "$log"
fi
step done
