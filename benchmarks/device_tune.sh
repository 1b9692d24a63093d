#!/usr/bin/env bash
# One device call for `moebench tune` (issues 5 and 8): fp8 block-quantised configs for
# DeepSeek-V3's EP8 and TP8 shards (fp8-tune.tgz), then the default halving search (auto budget)
# against the whole pruned grid at GRID_POINTS (separate processes and Triton caches). Results under $OUT.
#   PYTHONPATH=. bash benchmarks/device_tune.sh
TAIL="${TAIL:-14}"
source "$(dirname "$0")/device_env.sh"
mkdir -p "$OUT/configs"

TOKS="${FP8_TOKENS:-1,16,64,256,1024,4096}"
if [ -z "${SKIP_FP8:-}" ]; then
  for lay in "--ep 8" "--tp 8"; do
    step "tune deepseek-v3 $lay fp8 block 128,128"
    mb tune --model deepseek-v3 $lay --tokens "$TOKS" --dtype fp8_w8a8 --block-shape 128,128 --out "$OUT/configs" --results-dir "$R/fp8"
  done
  for f in "$R"/fp8/*/report.md; do echo "--- $f"; cat "$f"; done >> "$log" 2>/dev/null
  # the config files (names with '=' do not come back as plain files) and the reports, not the journals
  (cd "$OUT" && tar czf fp8-tune.tgz configs $(find results/fp8 -name 'report.*') 2>/dev/null)
fi
# halving (default budget) vs the whole pruned grid: "model tokens" pairs
for pt in ${GRID_POINTS:-"qwen3-30b-a3b:1" "mixtral-8x7b:16"}; do
  m=${pt%%:*}; t=${pt##*:}
  for s in halving grid; do
    step "tune $m --tokens $t --search $s"
    TRITON_CACHE_DIR="$OUT/tcache-$m-$t-$s" mb tune --model $m --tokens $t --search $s --out "$OUT/cfg-$s" --results-dir "$R/$s"
    rm -rf "$OUT/tcache-$m-$t-$s"
    for f in "$R"/$s/*/report.md; do echo "--- $f"; cat "$f"; done >> "$log" 2>/dev/null
  done
done
rm -rf "$R" "$OUT/cfg-halving" "$OUT/cfg-grid"
step done
