#!/usr/bin/env bash
# Tune bf16 configs for preset models and their usual shards (issue 5), over one or more device calls.
# Each tune uses the default halving search (auto budget) over tokens 1..4096. Run folders live in
# $PRESETS_DIR (default .gpu-out/presets: ignored by git, so kept on a warm device machine between
# calls): a layout whose report exists is skipped, an unfinished run is resumed, so the same command
# run again continues where a call was cut off. Config files and reports come back in
# $OUT/presets.tgz (file names with '=' do not come back as plain files).
# CW=N passes --compile-workers N (compile each batch of candidates in N processes first).
# FILL=1: instead, add vLLM's missing token counts to every preset file that lacks some
# (`moebench configs coverage --fill`): each shipped file is copied into $PRESETS_DIR/configs first
# and the tune merges its new counts into it (PERF.md section 6: between keys the nearest entry
# measured up to 1.18x slower than the heuristic).
#   PYTHONPATH=. [SHARDS="mixtral-8x22b:--tp 8;qwen3-235b-a22b:--ep 8"] [GPUS=all] [CW=12] bash benchmarks/device_presets.sh
#   PYTHONPATH=. FILL=1 CW=12 [MODELS=qwen3-30b-a3b,olmoe-1b-7b] bash benchmarks/device_presets.sh
# MODELS (FILL only): fill these presets' files only, in this order (default: every sparse file).
TAIL="${TAIL:-12}"
source "$(dirname "$0")/device_env.sh"
P="${PRESETS_DIR:-.gpu-out/presets}"
mkdir -p "$P/configs"
TOKS="${TOKS:-1,16,64,256,1024,4096}"
if [ -n "${FILL:-}" ]; then
  # items model:flags:tokens, one per file; the shipped file is the base the tune merges into
  LIST=()
  while IFS='|' read -r model lay toks src; do
    [ -f "$P/configs/$(basename "$src")" ] || cp "$src" "$P/configs/"
    LIST+=("$model:$lay:$toks")
  done < <(python3 -m moebench.cli configs coverage --device NVIDIA_H200 --json | python3 -c '
import json, os, sys
seen = set()
models = [m for m in os.environ.get("MODELS", "").split(",") if m]
rows = json.load(sys.stdin)
if models:
    rows = sorted((r for r in rows if r["model"] in models), key=lambda r: models.index(r["model"]))
for r in rows:
    if r["found"] and r["missing_counts"] and r["file"] not in seen:
        seen.add(r["file"])
        print("|".join([r["model"], r["tune_flags"], ",".join(map(str, r["missing_counts"])), r["found"] + "/" + r["file"]]))')
else
  # Default: every preset layout without a shipped H200 file (`moebench configs coverage --shards`).
  DEFAULT_SHARDS="$(python3 -m moebench.cli configs coverage --device NVIDIA_H200 --shards)"
  IFS=';' read -ra LIST <<< "${SHARDS:-$DEFAULT_SHARDS}"
fi
for item in "${LIST[@]}"; do
  model=${item%%:*}; lay=${item#*:}
  toks=$TOKS
  if [ -n "${FILL:-}" ]; then toks=${lay##*:}; lay=${lay%:*}; fi
  dir="$P/runs/${model}$(echo "$lay" | tr -d ' -')${FILL:+-fill}"
  tune_in "$dir" "$model $lay" --gpus "${GPUS:-all}" --compile-workers "${CW:-0}" --out "$P/configs" -- \
    --model "$model" $lay --tokens "$toks"
  (cd "$P" && tar czf "$OUT/presets.tgz" configs $(find runs -name 'report.*') 2>/dev/null)
done
step done
