#!/usr/bin/env bash
# The token-rows layout's rule (TritonOptions.token_rows, PERF.md section 6) on the GPU:
#  (0) the token-rows GPU tests;
#  (a) `decode_launches --variants notokenrows,tokenrows,again` (3 rotated rounds) at 2-64 tokens, bf16 and
#      fp8 block: the defaults against the alignment kernels everywhere and token rows everywhere; $OUT/ab/
#  (b) `vllm_kernel` at the token counts the rule covers, bf16: the table rows of PERF.md section 1; $OUT/vk/
#   PYTHONPATH=. [TOKENS=...] [SHAPES=...] bash benchmarks/device_token_rows.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-2,4,8,16,24,32,48,64}"
S="${SHAPES:-qwen3-30b-a3b,qwen3-235b-tp8,dsv3-tp8,dsv3-ep8,mixtral-tp8,mixtral,qwen3-next-80b-a3b}"
step "(0) gpu tests: token rows"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/test_triton_experts.py tests/test_triton_fp8.py \
  -k token_rows 2>&1 | tail -n 3 | tee -a "$log"
for p in "" --fp8-block; do
  step "(a) decode_launches $p"
  [ -n "$p" ] && T="${FP8_TOKENS:-4,8,16,32}"
  OUT="$OUT/ab" timeout "${AB_S:-200}" python3 -m benchmarks decode_launches $p --variants notokenrows,tokenrows,again \
    --tokens "$T" --rounds 3 --reps 20 --shapes "$S" 2>&1 | tail -n 60 | tee -a "$log"
done
step "(b) vllm_kernel bf16"
OUT="$OUT/vk" timeout "${VK_S:-150}" python3 -m benchmarks vllm_kernel --precisions bf16 --routings 2 \
  --shapes "${VK_SHAPES:-qwen3-30b-a3b,qwen3-235b-tp8,mixtral-tp8,mixtral}" --tokens "${VK_TOKENS:-8,16}" 2>&1 | tail -n 20 | tee -a "$log"
step done
