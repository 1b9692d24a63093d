#!/usr/bin/env bash
# One device call for issue 8 (fp8): calibrate (bf16 + fp8 matmul ceilings), fp8 GPU tests, and
# bf16 vs fp8 sweeps of design.md's three shapes at tokens 1..4096 in the same run. Results under
# $OUT (fp8_table.md, log.txt, results.tgz).   PYTHONPATH=. bash benchmarks/device_fp8.sh
TAIL="${TAIL:-6}"
source "$(dirname "$0")/device_env.sh"
TOK="${TOK:-1,16,64,256,1024,4096}"

calibrate
SHAPES=("--model mixtral-8x7b" "--model qwen3-30b-a3b" "--num-experts 32 --topk 8 --hidden 7168 --intermediate 2048")
for s in "${SHAPES[@]}"; do
  step "bf16 / fp8 sweeps: $s"
  mb sweep $s --tokens "$TOK" --experts triton,torch --prepare-finalize no-dpep --reps 20 --routings 4 --out "$R/bf16"
  mb sweep $s --tokens "$TOK" --dtype fp8_w8a8 --block-shape 128,128 --experts triton --prepare-finalize no-dpep --reps 20 --routings 4 --out "$R/fp8-block"
  mb sweep $s --tokens "$TOK" --dtype fp8_w8a8 --scales token --experts triton,torch --prepare-finalize no-dpep --reps 20 --routings 4 --out "$R/fp8-token"
  python3 -m benchmarks fp8_table "$R" > "$OUT/fp8_table.md" 2>>"$log"  # after every shape: a cut-off run keeps it
done
cat "$OUT/fp8_table.md" >> "$log"
archive fp8-sweeps
if [ -z "${SKIP_TESTS:-}" ]; then
  step "fp8 gpu tests"
  python3 -m pytest -q -m gpu tests/gpu -k "fp8" 2>&1 | tail -15 | tee -a "$log"
fi
step done
