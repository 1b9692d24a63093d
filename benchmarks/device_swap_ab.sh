#!/usr/bin/env bash
# The fp8 GEMMs' operand order, A/B in one call: w^T x^T into a transposed accumulator
# (TritonOptions.swap_ab=True, vLLM's order for fp8 on Hopper below 64-row tiles) against the
# defaults: the fp8 tests of both orders on the GPU, then `decode_launches --variants swapab,again`
# at 1-256 tokens (3 rotated rounds) for fp8 128 x 128 block and per-tensor fp8.
# $OUT/block/ and $OUT/tensor/ get decode_launches_fp8*.csv / .md.
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_swap_ab.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,2,4,8,16,32,64,128,256}"
S="${SHAPES:-dsv3-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-ep8}"
step gpu tests of both operand orders
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8.py tests/test_triton_experts.py \
  -k "swap_ab or matches_reference" 2>&1 | tail -n 3 | tee -a "$log"
step "fp8 block: swapped / current"
OUT="$OUT/block" timeout 240 python3 -m benchmarks decode_launches --fp8-block --variants swapab,again --tokens "$T" \
  --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 40 | tee -a "$log"
step "fp8 per tensor: swapped / current"
OUT="$OUT/tensor" timeout 200 python3 -m benchmarks decode_launches --fp8 --variants swapab,again --tokens "$T" \
  --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 40 | tee -a "$log"
step done
