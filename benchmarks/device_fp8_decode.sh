#!/usr/bin/env bash
# Where the fp8 block layer loses to vLLM's structure at decode (PERF.md section 1: 1.00-1.22x at
# 1-512 tokens): same-run A/B of the launch-level choices, then per-launch CUDA times.
#  (a) `decode_launches --fp8-block --variants nopdl,direct,again` (3 rotated rounds) at 1-64 tokens:
#      programmatic dependent launch off (its "auto" was timed on bf16 only) and one block per pair
#      (vLLM's per-pair path) against the defaults; $OUT/ab/
#  (b) `vllm_kernel --profile` at 1 / 16 / 64 tokens: the per-launch CUDA times of both columns; $OUT/prof/
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_fp8_decode.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,2,4,8,16,32,64}"
S="${SHAPES:-dsv3-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-ep8}"
step "(a) fp8 block: nopdl, direct / current"
OUT="$OUT/ab" timeout 240 python3 -m benchmarks decode_launches --fp8-block --variants nopdl,direct,again --tokens "$T" \
  --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 32 | tee -a "$log"
step "(b) per-launch CUDA times, fp8 block decode"
OUT="$OUT/prof" timeout 150 python3 -m benchmarks vllm_kernel --profile --shapes deepseek-v3-tp8,qwen3-30b-a3b \
  --precisions fp8 --tokens 1,16,64 2>&1 | tail -n 1 | tee -a "$log"
step done
