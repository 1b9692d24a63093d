#!/usr/bin/env bash
# GEMM2's sum over top-k, A/B in one call: each pair's row stored and summed by `topk_sum`
# (TritonOptions.pair_store=True) against the fp32 atomics (False), and the defaults ("auto"):
# the GPU tests of both paths, then `decode_launches` at 256-4096 tokens (3 rotated rounds) for
# bf16 and fp8 128 x 128 block. $OUT/bf16/ and $OUT/fp8block/ get decode_launches*.csv / .md.
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] [FP8_SHAPES=...] bash benchmarks/device_pair_store.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-256,1024,2048,4096}"
step gpu tests of both GEMM2 stores
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_experts.py tests/test_triton_fp8.py \
  -k "pair_store or topk_sum or matches_reference" 2>&1 | tail -n 3 | tee -a "$log"
step "bf16 pair store / atomics / defaults"
OUT="$OUT/bf16" timeout 240 python3 -m benchmarks decode_launches --variants pairstore,atomic --tokens "$T" --rounds 3 --reps 20 \
  --shapes "${SHAPES:-qwen3-235b-tp8,dsv3-tp8,qwen3-30b-a3b,qwen3-next-80b-a3b,mixtral}" 2>&1 | tail -n 24 | tee -a "$log"
step "fp8 block pair store / atomics / defaults"
OUT="$OUT/fp8block" timeout 200 python3 -m benchmarks decode_launches --fp8-block --variants pairstore,atomic --tokens "$T" \
  --rounds 3 --reps 20 --shapes "${FP8_SHAPES:-qwen3-235b-tp8,dsv3-tp8,qwen3-30b-a3b}" 2>&1 | tail -n 16 | tee -a "$log"
step done
