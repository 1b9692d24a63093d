#!/usr/bin/env bash
# How far can any file that vLLM reads go below vLLM's own shipped file? `moebench tune --kernel vllm
# --search grid` (every config of vLLM's tuner space that fits shared memory) at a few token counts,
# --against vLLM's and SGLang's shipped H200 files: the report's winner / file column is the best
# ratio any config of that space reaches in the vllm-triton experts, same run.
# $OUT gets log.txt and grid.tgz (the run folders: journal, report.md, the files).
#   PYTHONPATH=. [TOKENS=1,64,1024] [CW=14] bash benchmarks/device_vllm_grid.sh
source "$(dirname "$0")/device_env.sh"
T="${TOKENS:-1,64,1024}"
G="$OUT/grid"; mkdir -p "$G"
python3 -m benchmarks vllm_kernel --write-files "$G/engine" > /dev/null
# model:layout:file shape:precision
for item in "qwen3-30b-a3b::E=128,N=768:bf16" "deepseek-v3:--tp 8:E=256,N=256:fp8"; do
  IFS=: read -r model lay en prec <<< "$item"
  engine_against "$G"/engine "$en" "$prec"
  pq=(); [ "$prec" = fp8 ] && pq=(--dtype fp8_w8a8 --block-shape 128,128)
  step "grid: $model $lay $prec at $T"
  timeout "${EACH_S:-270}" python3 -m moebench.cli tune --model "$model" $lay --kernel vllm --search grid --tokens "$T" \
    "${pq[@]}" "${vs[@]}" --compile-workers "${CW:-14}" --out "$G/configs" --results-dir "$G/runs" 2>&1 | tail -n 14 | tee -a "$log"
done
(cd "$OUT" && tar czf grid.tgz --exclude=triton-cache grid && rm -rf grid)
step done
