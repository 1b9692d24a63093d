#!/usr/bin/env bash
# One device call (< 9 minutes on one H200) for the vllm-triton experts and engine config files:
#  (a) GPU check: tests/test_vllm_triton.py (its gpu tests: every code path against the reference)
#  (b) `moebench tune --kernel vllm --against <vLLM's and SGLang's shipped files>` for Mixtral-8x7B
#      TP8, Qwen3-30B-A3B, Qwen3-235B-A22B TP8 and DeepSeek-V3 TP8, bf16 and fp8 block [128,128], at
#      vLLM's 18 token counts (halving, --budget $TUNE_BUDGET configs per count), until the call's
#      time is spent: run folders in $VK_DIR (default .gpu-out/vllmk, ignored by git, carried
#      between calls), each resumed (--resume) by the next call; the files go to $VK_DIR/configs/vllm
#  (e) PROFILE=1, first: `vllm_kernel --profile` (per-launch CUDA times) at fp8 block points, $OUT/prof/
#  (c)+(d) once every tune is done (or TABLES=1): `python -m benchmarks vllm_kernel` (same run:
#      new file vs vLLM's and SGLang's shipped files in the vllm-triton experts at the 18 counts; the
#      triton layer vs the faster engine file, there and for Mixtral TP1 / the DeepSeek-V3 EP8 shard),
#      tables $OUT/files/ and $OUT/more/ vllm_kernel_files.md / vllm_kernel_triton.md (+ .csv)
# $OUT gets log.txt, gpu-tests.txt, the four tables and vllmk-state.tgz: the whole $VK_DIR (run
# folders with their journals, config files; names with '=' or ',' do not come back as plain
# files). A device machine is released soon after a call, so the next call resumes from that
# archive: unpack it into .gpu-out/vllmk here and send the folder along with the call
#   mkdir -p .gpu-out/vllmk && tar xzf FILES_AT/vllmk-state.tgz -C .gpu-out/vllmk
# (an ignored folder: name it among the paths the call carries). Call it again until the log
# says "all 8 tunes done": with TUNE_BUDGET=8 CW=14 a tune took 79-183 s on the H200 (2026-12-03), about
# four tunes per call; the tables (c)+(d) want a call of their own.
# ONLY=name,... tunes only those (names as the log prints them, e.g. deepseek-v3--tp8-bf16);
# TUNED_DIR: the folder of new files the tables read (default $VK/configs/vllm; the shipped ones:
# TABLES=1 ONLY=none TUNED_DIR=moebench/configs/vllm).
#   PYTHONPATH=. [BUDGET_S=480] [CW=12] [TUNE_BUDGET=16] [ONLY=...] [TABLE_TOKENS=...] bash benchmarks/device_vllm_kernel.sh
TAIL="${TAIL:-8}"
source "$(dirname "$0")/device_env.sh"
START=$(date +%s)
END=$((START + ${BUDGET_S:-480}))
VK="${VK_DIR:-.gpu-out/vllmk}"
mkdir -p "$VK/runs" "$VK/configs/vllm"
left() { echo $((END - $(date +%s))); }

if [ -z "${SKIP_TESTS:-}" ]; then
  step "(a) gpu tests of the vllm-triton experts"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_triton.py > "$OUT/gpu-tests.txt" 2>&1
  tail -n 3 "$OUT/gpu-tests.txt" | tee -a "$log"
fi

if [ -n "${PROFILE:-}" ]; then
  step "(e) per-launch CUDA times, fp8 block decode and prefill (triton layer vs the engine files)"
  OUT="$OUT/prof" timeout 150 python3 -m benchmarks vllm_kernel --profile --shapes deepseek-v3-tp8,qwen3-30b-a3b,deepseek-v3-ep8 \
    --precisions fp8 --tokens 1,16,64,1024,4096 2>&1 | tail -n 1 | tee -a "$log"
fi

TOKS=1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096
# model:layout:file shape (E=..,N=.. of the engines' file names):precision; the points where an
# engine ships a file first
ITEMS=("qwen3-30b-a3b::E=128,N=768:bf16" "qwen3-30b-a3b::E=128,N=768:fp8" "mixtral-8x7b:--tp 8:E=8,N=1792:bf16"
       "qwen3-235b-a22b:--tp 8:E=128,N=192:bf16" "deepseek-v3:--tp 8:E=256,N=256:fp8"
       "mixtral-8x7b:--tp 8:E=8,N=1792:fp8" "qwen3-235b-a22b:--tp 8:E=128,N=192:fp8" "deepseek-v3:--tp 8:E=256,N=256:bf16")
# the engines' shipped files (benchmarks/*_h200_configs.json) as files: each tune runs --against them
python3 -m benchmarks vllm_kernel --write-files "$VK/engine" > /dev/null
done_count=0
for item in "${ITEMS[@]}"; do
  IFS=: read -r model lay en prec <<< "$item"
  engine_against "$VK"/engine "$en" "$prec"
  name="$model${lay// /}-$prec"; run="$VK/runs/$name"
case ",${ONLY:-$name}," in *",$name,"*) ;; *) continue;; esac
  if [ -f "$run/DONE" ]; then done_count=$((done_count + 1)); continue; fi
  budget=$(( $(left) - ${TABLE_RESERVE:-30} ))
  if [ "$budget" -lt 60 ]; then step "no time left for $name (next call resumes)"; continue; fi
  pq=(); [ "$prec" = fp8 ] && pq=(--dtype fp8_w8a8 --block-shape 128,128)
  if [ -f "$run/tune.json" ]; then
    args=(tune --resume "$run" --compile-workers "${CW:-12}")
  else
    args=(tune --model "$model" $lay --kernel vllm --tokens "$TOKS" "${pq[@]}" "${vs[@]}" --budget "${TUNE_BUDGET:-16}"
          --compile-workers "${CW:-12}" --out "$VK/configs/vllm" --results-dir "$VK/runs/.new")
  fi
  rm -rf "$VK/runs/.new"
  step "(b) tune $name (${budget}s left for it)"
  t0=$(date +%s)
  timeout "$budget" python3 -m moebench.cli "${args[@]}" 2>&1 | tail -n "$TAIL" | tee -a "$log"
  rc=${PIPESTATUS[0]}
  # a new run's folder is created under .new/: give it its stable name for the next call's --resume
  if [ ! -d "$run" ]; then new=$(ls -d "$VK/runs/.new"/*-tune-* 2>/dev/null | head -n 1); [ -n "$new" ] && mv "$new" "$run"; fi
  echo "tune $name: exit $rc after $(( $(date +%s) - t0 ))s" | tee -a "$log"
  if [ "$rc" = 0 ]; then touch "$run/DONE"; done_count=$((done_count + 1)); fi
done
step "$done_count of 8 tunes done"
[ "$done_count" = 8 ] && echo "all 8 tunes done" | tee -a "$log"

if [ "$done_count" = 8 ] || [ -n "${TABLES:-}" ]; then
  step "(c) engine files in the vllm-triton experts at the files' token counts (and the triton layer), the four shapes"
  OUT="$OUT/files" timeout $(( $(left) > 30 ? $(left) : 30 )) python3 -m benchmarks vllm_kernel --tuned "${TUNED_DIR:-$VK/configs/vllm}" \
    --tokens "${TABLE_TOKENS:-$TOKS}" --routings "${ROUTINGS:-2}" 2>&1 | tail -n 4 | tee -a "$log"
  step "(d) triton layer vs the faster engine file: Mixtral TP1 and the DeepSeek-V3 EP8 shard"
  OUT="$OUT/more" timeout $(( $(left) > 30 ? $(left) : 30 )) python3 -m benchmarks vllm_kernel --shapes mixtral,deepseek-v3-ep8 \
    --tokens "${MORE_TOKENS:-1,16,64,256,1024,4096}" --routings "${ROUTINGS:-2}" 2>&1 | tail -n 4 | tee -a "$log"
fi
OUT_ABS=$(cd "$OUT" && pwd)
# without the runs' Triton caches (hundreds of MB: they would not come back)
(cd "$VK" && tar czf "$OUT_ABS/vllmk-state.tgz" --exclude=runs/.new --exclude=triton-cache .)
step done
