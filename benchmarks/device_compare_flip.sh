#!/usr/bin/env bash
# compare tp-vs-ep for DeepSeek-V3, Qwen3-235B-A22B, gpt-oss-120b and Mixtral-8x22B at 8 ranks (one
# node) and 32 ranks (4 nodes of 8: TP8 replicas per node vs EP32 over NVLink + 400G RDMA) on one
# GPU, each preset in its shipped precision: one rank's experts measured, communication from the
# fitted model, every transport a deployment would use among the candidates (DeepEP low-latency and
# normal, the custom all-reduce: modeled where they cannot run). Ends with the flip factor per token
# count of every comparison ($OUT/flip.md): PERF.md section 4.
#   PYTHONPATH=. bash benchmarks/device_compare_flip.sh
#   MODELS="deepseek-v3" WORLDS="8" EXPERTS=triton,batched-triton TOKENS=1,64,4096 EXTRA=--no-check ...   (a subset)
# Mixtral-8x22B has 8 experts: EP32 is refused (one-line error, kept in the log) and only its
# world-8 comparison runs.
source "$(dirname "$0")/device_env.sh"

MODELS="${MODELS:-deepseek-v3 qwen3-235b-a22b gpt-oss-120b mixtral-8x22b}"
WORLDS="${WORLDS:-8 32}"
EXPERTS="${EXPERTS:-triton,batched-triton}"
TOKENS="${TOKENS:-1,4,16,64,256,1024,4096}"
for m in $MODELS; do
  for w in $WORLDS; do
    step "compare $m tp-vs-ep world $w"
    mb compare tp-vs-ep --model "$m" --world-size "$w" --tokens "$TOKENS" --experts "$EXPERTS" \
       --plot "$OUT/compare-$m-w$w.png" --out "$R/$m-w$w" --reps "${REPS:-20}" ${EXTRA:-}
  done
done
step "flip factors"
python3 -m benchmarks flip_table "$R"/*/*/ 2>&1 | tee "$OUT/flip.md" | tee -a "$log"
tar czf "$OUT/results.tgz" -C "$OUT" results 2>/dev/null
step done
