#!/usr/bin/env bash
# The layer times of the Triton experts through `moebench sweep` (the user's path), for before/after
# comparisons of a kernel change: the GPU tests first (cut at TESTS_S seconds), then Mixtral-8x7B,
# Qwen3-30B-A3B, DeepSeek-V3 TP8 (bf16 and fp8 block) with `triton`, Qwen3-30B-A3B with
# `batched-triton`, 1-4096 tokens, 4 routings cycled; $OUT/layer_times.csv holds every row.
#   PYTHONPATH=. bash benchmarks/device_layer_times.sh          (SKIP_TESTS=1 leaves the tests out)
set -uo pipefail
OUT="${OUT:-./device-out}"; mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 COLUMNS=160 MOEBENCH_CACHE_DIR="$OUT/cache"
runs="$(mktemp -d)"
log="$OUT/log.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a "$log"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
git rev-parse --short HEAD 2>/dev/null | tee -a "$log"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TESTS_S:-240}" python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -n 12 | tee -a "$log"
fi
T="${TOKENS:-1,16,64,256,1024,4096}"
for spec in "mixtral-8x7b:" "qwen3-30b-a3b:" "deepseek-v3:--tp 8 --dtype bf16 --shared-experts none" "deepseek-v3:--tp 8 --dtype fp8_w8a8 --block-shape 128,128 --shared-experts none" \
            "qwen3-30b-a3b:--experts batched-triton --prepare-finalize batched-local"; do
  m=${spec%%:*}; a=${spec#*:}
  ex="--experts triton --prepare-finalize no-dpep"; case "$a" in *--experts*) ex="";; esac
  timeout 150 python -m moebench.cli sweep --model "$m" $a $ex --tokens "$T" --routings 4 --out "$runs" --format csv 2>&1 \
    | tail -n 14 | tee -a "$log"
done
python - "$runs" "$OUT/layer_times.csv" <<'PY' | tee -a "$log"
import glob, sys
import pandas as pd
df = pd.concat([pd.read_csv(f) for f in sorted(glob.glob(sys.argv[1] + "/*/results.csv"))])
df = df[df.status == "ok"]
df.to_csv(sys.argv[2], index=False)
print(df[["model", "tp", "experts", "dtype", "quant", "tokens", "latency_us", "p10_us", "p90_us", "max_rel_err"]].to_string(index=False))
PY
