#!/usr/bin/env bash
# Prefill GEMM2 in Gluon against the `triton` layer's, in one call: the persistent form, then the
# warp-specialised ping-pong form (separate processes under their own limits, so a form that hangs
# loses nothing of the other), then where the layer's time goes at 4096 tokens of the two small-I
# TP8 shards (`profile_case`). $OUT/persistent/ and $OUT/pingpong/ get gluon_gemm2.csv / .md.
#   PYTHONPATH=. [SHAPES=...] [TOKENS=...] bash benchmarks/device_gluon.sh
source "$(dirname "$0")/device_env.sh"
S="${SHAPES:-qwen3-235b-tp8,dsv3-tp8,qwen3-30b-a3b}"
T="${TOKENS:-1024,4096}"
for form in persistent pingpong; do
  step "gluon GEMM2: $form"
  OUT="$OUT/$form" timeout 200 python3 -m benchmarks gluon_gemm2 --forms "$form" --shapes "$S" --tokens "$T" 2>&1 \
    | tail -n 30 | tee -a "$log"
done
for shape in qwen3-235b-tp8 dsv3-tp8; do
  step "layer profile: $shape at 4096 tokens"
  timeout 90 python3 -m benchmarks profile_case --shape "$shape" --tokens 4096 2>&1 | grep -E "Name|---|kernel|Self CUDA" \
    | cut -c1-160 | head -n 20 | tee -a "$log"
done
step done
