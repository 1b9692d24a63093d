#!/usr/bin/env bash
# Re-tune shipped moebench files under the current kernels at vLLM's 18 token counts (or $TOKENS), each
# against the file it replaces and the engines' shipped H200 files for its shape (`tune --against`:
# each file's nearest entry seeds the search and runs in the final stage, so the new file is not
# slower than any of them at any count in the same run). The winners merge into the file's other
# token counts. The default items are the moebench files that PERF.md section 1's tables read for
# Mixtral TP8 and Qwen3-235B TP8 bf16, DeepSeek-V3 TP8 and Qwen3-30B fp8 block.
# Run folders live in $REFRESH_DIR (default .gpu-out/refresh, ignored by git): a finished item is
# skipped and an unfinished one resumed, so the same command continues where a call was cut off.
# The new files ($REFRESH_DIR/configs) and the reports come back in $OUT/refresh.tgz; time them with
#   MOEBENCH_CONFIG_DIR=<the unpacked configs> TABLES=1 ONLY=none TUNED_DIR=moebench/configs/vllm SKIP_TESTS=1 \
#     bash benchmarks/device_vllm_kernel.sh
# and copy the ones that win into moebench/configs.
#   PYTHONPATH=. [ITEMS="model|flags|file;..."] [TOKENS=1,2,...] [TUNE_BUDGET=8] [CW=14] bash benchmarks/device_refresh_files.sh
TAIL="${TAIL:-12}"
source "$(dirname "$0")/device_env.sh"
P="${REFRESH_DIR:-.gpu-out/refresh}"
mkdir -p "$P/configs" "$P/runs"
TOKS="${TOKENS:-1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096}"
[ -d "$P/engines" ] || python3 -m benchmarks vllm_kernel --write-files "$P/engines" >/dev/null
FP8="--dtype fp8_w8a8 --block-shape 128,128"
SHIPPED_ITEMS="mixtral-8x7b|--tp 8|E=8,N=1792,device_name=NVIDIA_H200.json;\
qwen3-235b-a22b|--tp 8|E=128,N=192,device_name=NVIDIA_H200.json;\
deepseek-v3|--tp 8 $FP8|E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json;\
qwen3-30b-a3b|$FP8|E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
IFS=';' read -ra LIST <<< "${ITEMS:-$SHIPPED_ITEMS}"
for item in "${LIST[@]}"; do
  IFS='|' read -r model flags file <<< "$item"
  dir="$P/runs/${model}$(echo "$flags" | tr -d ' -,')"
  [ -f "$P/configs/$file" ] || cp "moebench/configs/$file" "$P/configs/$file"
  case "$file" in *fp8_w8a8*) prec=fp8;; *) prec=bf16;; esac
  engine_against "$P/engines" "${file%%,device_name*}" "$prec"
  tune_in "$dir" "$model $flags" --compile-workers "${CW:-14}" --out "$P/configs" -- \
    --model "$model" $flags --tokens "$TOKS" --against "moebench/configs/$file" "${vs[@]}" --budget "${TUNE_BUDGET:-8}"
done
OUT_ABS=$(cd "$OUT" && pwd)
(cd "$P" && tar czf "$OUT_ABS/refresh.tgz" configs $(find runs -name report.md -o -name report.csv | sort))
step done
