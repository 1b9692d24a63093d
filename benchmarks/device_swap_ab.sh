#!/usr/bin/env bash
# The fp8 GEMMs' operand order and weight loads, A/B in one call against the defaults:
# swap_ab=True (w^T x^T into a transposed accumulator, vLLM's order for fp8 on Hopper below 64-row
# tiles) and use_tma=True (fp8 weight tiles through TMA descriptors): the fp8 tests of both on the
# GPU, then `decode_launches --variants swapab,tma,again` (3 rotated rounds) for fp8 128 x 128 block
# at 1-4096 tokens and per-tensor fp8 at 1-256.
# $OUT/block/ and $OUT/tensor/ get decode_launches_fp8*.csv / .md.
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_swap_ab.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,2,4,8,16,32,64,128,256,1024,4096}"
S="${SHAPES:-dsv3-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-ep8}"
step gpu tests of both operand orders and the TMA weight tiles
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8.py tests/test_triton_experts.py \
  -k "swap_ab or tma_weight or matches_reference" 2>&1 | tail -n 3 | tee -a "$log"
step "fp8 block: swapped, TMA / current"
OUT="$OUT/block" timeout 260 python3 -m benchmarks decode_launches --fp8-block --variants swapab,tma,again --tokens "$T" \
  --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 50 | tee -a "$log"
step "fp8 per tensor: swapped, TMA / current"
OUT="$OUT/tensor" timeout 150 python3 -m benchmarks decode_launches --fp8 --variants swapab,tma,again \
  --tokens "${TENSOR_TOKENS:-1,4,16,64,256}" --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 30 | tee -a "$log"
step done
