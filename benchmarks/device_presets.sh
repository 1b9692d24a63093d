#!/usr/bin/env bash
# Tune bf16 configs for preset models and their usual shards (issue 5), a few per device call.
# Each tune uses the default halving search (auto budget) over tokens 1..4096; config files and
# reports come back in $OUT/presets.tgz (file names with '=' do not come back as plain files).
#   PYTHONPATH=. [SHARDS="mixtral-8x22b:--tp 8;qwen3-235b-a22b:--ep 8"] [GPUS=all] bash benchmarks/device_presets.sh
TAIL="${TAIL:-12}"
source "$(dirname "$0")/device_env.sh"
mkdir -p "$OUT/configs"
TOKS="${TOKS:-1,16,64,256,1024,4096}"
# Default: every preset layout without a shipped H200 file (`moebench configs coverage --shards`).
DEFAULT_SHARDS="$(python3 -m moebench.cli configs coverage --device NVIDIA_H200 --shards)"
IFS=';' read -ra LIST <<< "${SHARDS:-$DEFAULT_SHARDS}"
for item in "${LIST[@]}"; do
  model=${item%%:*}; lay=${item#*:}
  step "tune $model $lay"
  mb tune --model "$model" $lay --tokens "$TOKS" --gpus "${GPUS:-all}" --out "$OUT/configs" --results-dir "$R/presets"
  (cd "$OUT" && tar czf presets.tgz configs $(find results/presets -name 'report.*') 2>/dev/null)
done
step done
