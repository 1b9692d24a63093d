#!/usr/bin/env bash
# Where the fp8 block layer loses to vLLM's structure at decode (PERF.md section 1): same-run A/B
# of the launch-level choices, then per-launch CUDA times.
#  (0) the fp8 and Triton-experts tests on the GPU, with the fp8 block PDL chain in a CUDA graph;
#  (a) `decode_launches --fp8-block --variants nopdl,direct,again` (3 rotated rounds) at 1-256
#      tokens: PDL off and one block per pair (vLLM's per-pair path) against the defaults; $OUT/ab/
#  (b) `vllm_kernel --profile` at 1 / 16 / 64 tokens: the per-launch CUDA times of both columns; $OUT/prof/
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_fp8_decode.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,2,4,8,16,32,64,256}"
S="${SHAPES:-dsv3-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-ep8}"
step "(0) gpu tests: fp8, triton experts, the PDL chains"
timeout "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8.py tests/test_triton_experts.py \
  tests/gpu/test_triton_gpu.py -k "not real_shapes" 2>&1 | tail -n 5 | tee -a "$log"
step "(a) fp8 block: nopdl, direct / current"
OUT="$OUT/ab" timeout "${AB_S:-240}" python3 -m benchmarks decode_launches --fp8-block --variants nopdl,direct,again \
  --tokens "$T" --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 36 | tee -a "$log"
step "(b) per-launch CUDA times, fp8 block decode"
OUT="$OUT/prof" timeout 100 python3 -m benchmarks vllm_kernel --profile --shapes deepseek-v3-tp8,qwen3-30b-a3b \
  --precisions fp8 --tokens 1,16,64 2>&1 | tail -n 1 | tee -a "$log"
step done
