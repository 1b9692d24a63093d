#!/usr/bin/env bash
# The fp8 block layer's launches at decode and prefill, A/B in one call against the defaults:
#  (0) the fp8 and Triton-experts tests on the GPU (the CUDA paths of quant_in_gemm2 among them);
#  (a) `decode_launches --fp8-block --variants noqinter,qinter,nopdl,again` (3 rotated rounds) at
#      1-4096 tokens: the intermediate quantised by GEMM2 as it loads it (`qinter`, and `current`
#      where "auto" takes it) against its own launch between the GEMMs (`noqinter`, which also
#      keeps the alignment kernels at one token), and programmatic dependent launch off; $OUT/ab/
#  (b) `vllm_kernel --profile` at 1 / 16 / 64 tokens: the per-launch CUDA times of both columns; $OUT/prof/
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_fp8_decode.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,2,4,8,16,32,64,256,1024,4096}"
S="${SHAPES:-dsv3-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-ep8}"
step "(0) gpu tests: fp8, triton experts"
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8.py tests/test_triton_experts.py \
  2>&1 | tail -n 5 | tee -a "$log"
step "(a) fp8 block: qinter, noqinter, nopdl / current"
OUT="$OUT/ab" timeout "${AB_S:-300}" python3 -m benchmarks decode_launches --fp8-block --variants noqinter,qinter,nopdl,again \
  --tokens "$T" --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 45 | tee -a "$log"
step "(b) per-launch CUDA times, fp8 block decode"
OUT="$OUT/prof" timeout 100 python3 -m benchmarks vllm_kernel --profile --shapes deepseek-v3-tp8,qwen3-30b-a3b \
  --precisions fp8 --tokens 1,16,64 2>&1 | tail -n 1 | tee -a "$log"
step done
