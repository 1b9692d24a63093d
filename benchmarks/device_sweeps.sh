#!/usr/bin/env bash
# One device call for the CLI-level GPU checks (issues 2, 4, 6): calibration, a real single-GPU
# sweep, simulated TP8 / EP8 sweeps and tp-vs-ep comparisons, GPU tests. Results under $OUT.
#   PYTHONPATH=. bash benchmarks/device_sweeps.sh
source "$(dirname "$0")/device_env.sh"

step env --calibrate
python3 -m moebench.cli env --calibrate --json > "$OUT/env.json" 2>>"$log"; tail -c 2000 "$OUT/env.json" >> "$log"
step "sweep qwen3-30b-a3b (real, one GPU)"
mb sweep --model qwen3-30b-a3b --tokens "${SWEEP_TOKENS:-1,16,64,256,1024,4096}" --out "$R" --reps 20
for m in deepseek-v3 mixtral-8x7b; do
  step "sweep $m --tp 8 (simulated)"
  mb sweep --model $m --tp 8 --dtype bf16 --shared-experts none --tokens 1,16,64,256,1024,4096 --experts triton,torch --prepare-finalize no-dpep --out "$R" --reps 20
  step "sweep $m --ep 8 --dp 8 (simulated)"
  mb sweep --model $m --ep 8 --dp 8 --dtype bf16 --shared-experts none --tokens 1,16,64,256,1024 --experts triton,torch,batched-triton --out "$R" --reps 20
  step "compare $m tp-vs-ep world 8"
  mb compare tp-vs-ep --model $m --dtype bf16 --shared-experts none --world-size 8 --tokens 1,8,32,128,512,2048,8192 --experts triton,batched-triton,torch --plot "$OUT/compare-$m.png" --out "$R" --reps 20
done
step "compare deepseek-v3 tp-vs-ep world 8, zipf routing"
mb compare tp-vs-ep --model deepseek-v3 --dtype bf16 --shared-experts none --world-size 8 --tokens 1,8,32,128,512,2048,8192 --experts triton,batched-triton --routing zipf:1.2 --plot "$OUT/compare-deepseek-v3-zipf.png" --out "$R" --reps 20
step "profile batched-local + batched-triton"
python3 -m benchmarks profile_case --shape qwen3-30b-a3b --tokens 1 --experts batched-triton --prepare-finalize batched-local 2>&1 | tail -22 | tee -a "$log"
if [ -n "${TUNE:-}" ]; then
  step "tune shards"
  mb tune --model deepseek-v3 --ep 8 --tokens 1,16,64,256,1024,4096 --budget 10 --out "$OUT/configs" --results-dir "$R/tune"
  mb tune --model mixtral-8x7b --tp 8 --tokens 1,16,64,256,1024,4096 --budget 10 --out "$OUT/configs" --results-dir "$R/tune"
fi
step "gpu tests"
python3 -m pytest -q -m gpu tests 2>&1 | tail -25 | tee -a "$log"
tar czf "$OUT/results.tgz" -C "$OUT" results cache $( [ -d "$OUT/configs" ] && echo configs ) 2>/dev/null
rm -rf "$OUT/configs"
rm -rf "$R"
step done
