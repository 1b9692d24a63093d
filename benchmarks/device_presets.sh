#!/usr/bin/env bash
# Tune bf16 configs for preset models and their usual shards (issue 5), a few per device call.
# Each tune uses the default halving search (auto budget) over tokens 1..4096; config files and
# reports come back in $OUT/presets.tgz (file names with '=' do not come back as plain files).
#   PYTHONPATH=. SHARDS="mixtral-8x22b:--tp 8;qwen3-235b-a22b:--ep 8" bash benchmarks/device_presets.sh
TAIL="${TAIL:-12}"
source "$(dirname "$0")/device_env.sh"
mkdir -p "$OUT/configs"
TOKS="${TOKS:-1,16,64,256,1024,4096}"
# Shipped already (PERF.md section 6): mixtral-8x7b TP1/TP8, mixtral-8x22b TP8, qwen3-30b-a3b TP1,
# qwen3-235b-a22b TP8/EP8, deepseek-v3 TP8/EP8, olmoe-1b-7b, deepseek-v2-lite. Still to tune:
DEFAULT_SHARDS="qwen3-next-80b-a3b:;qwen2-moe-a2.7b:;deepseek-v2:--tp 8;gpt-oss-20b:;gpt-oss-120b:--tp 4;dbrx:--tp 8;llama4-scout:--tp 8;mixtral-8x22b:"
IFS=';' read -ra LIST <<< "${SHARDS:-$DEFAULT_SHARDS}"
for item in "${LIST[@]}"; do
  model=${item%%:*}; lay=${item#*:}
  step "tune $model $lay"
  mb tune --model "$model" $lay --tokens "$TOKS" --out "$OUT/configs" --results-dir "$R/presets"
  (cd "$OUT" && tar czf presets.tgz configs $(find results/presets -name 'report.*') 2>/dev/null)
done
step done
