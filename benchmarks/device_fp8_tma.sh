#!/usr/bin/env bash
# fp8 weight tiles through TMA, A/B in one call against the defaults: the fp8 TMA tests on the GPU,
# then `decode_launches --variants tma,again` (use_tma=True at every tile against "auto", which
# takes TMA for fp8 at 64-row tiles; 3 rotated rounds) for fp8 128 x 128 block at 1-4096 tokens
# and per-tensor fp8 at 1-256.
# $OUT/block/ and $OUT/tensor/ get decode_launches_fp8*.csv / .md.
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_fp8_tma.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,2,4,8,16,32,64,128,256,1024,4096}"
S="${SHAPES:-dsv3-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-ep8}"
step gpu tests of the fp8 TMA weight tiles
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_fp8.py tests/test_triton_experts.py \
  -k "tma or matches_reference" 2>&1 | tail -n 3 | tee -a "$log"
step "fp8 block: TMA at every tile / current"
OUT="$OUT/block" timeout 260 python3 -m benchmarks decode_launches --fp8-block --variants tma,again --tokens "$T" \
  --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 50 | tee -a "$log"
step "fp8 per tensor: TMA at every tile / current"
OUT="$OUT/tensor" timeout 150 python3 -m benchmarks decode_launches --fp8 --variants tma,again \
  --tokens "${TENSOR_TOKENS:-1,4,16,64,256}" --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 30 | tee -a "$log"
step done
