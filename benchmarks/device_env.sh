# Sourced by the benchmarks/device_*.sh scripts: output folder, environment, log helpers.
#   step TEXT      a timestamped section line in $OUT/log.txt
#   mb ARGS...     run `moebench ARGS`, keep the last $TAIL lines of its output (all when TAIL is unset)
#   calibrate      `moebench env --calibrate` into $OUT/env.json, its matmul ceilings into the log
#   archive NAME   the run folders under $R into $OUT/NAME.tgz (names with '=' or ',' come back inside it), then removed
#   tune_in DIR LABEL COMMON... -- NEW...   one resumable tune per folder DIR: skipped when its run has a
#                  report, resumed (`tune --resume RUN COMMON...`) when it has a journal, else started
#                  (`tune NEW... COMMON... --results-dir DIR`)
#   engine_against DIR EN PREC   sets vs=(--against FILE ...): the engines' H200 files for shape EN
#                  (E=..,N=..) and precision PREC (bf16 | fp8) under DIR/<engine>/ (`vllm_kernel --write-files DIR`)
set -uo pipefail
OUT="${OUT:-./device-out}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 COLUMNS=220 MOEBENCH_CACHE_DIR="$OUT/cache"
R="$OUT/results"
log="$OUT/log.txt"
step() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$log"; }
mb() { python3 -m moebench.cli "$@" 2>&1 | tail -n "${TAIL:-+1}" | tee -a "$log"; }
calibrate() { step env --calibrate; python3 -m moebench.cli env --calibrate --json > "$OUT/env.json" 2>>"$log"
              grep -A8 matmul_tflops "$OUT/env.json" >> "$log"; }
archive() { tar czf "$OUT/$1.tgz" -C "$OUT" results 2>/dev/null && rm -rf "$R"; }
engine_against() { vs=()
  for f in "$1"/*/"$2",device_name=NVIDIA_H200*.json; do
    [ -f "$f" ] || continue
    case "$f" in *fp8_w8a8*) [ "$3" = fp8 ] && vs+=(--against "$f");; *) [ "$3" = bf16 ] && vs+=(--against "$f");; esac
  done; }
tune_in() { local dir=$1 label=$2 run common=(); shift 2
  while [ "$1" != -- ]; do common+=("$1"); shift; done; shift
  run=$(ls -d "$dir"/*/ 2>/dev/null | head -n 1)
  if [ -n "$run" ] && [ -f "$run/report.md" ]; then step "done before: $label ($run)"; return; fi
  if [ -n "$run" ] && [ -f "$run/tune.json" ]; then step "resume $label ($run)"; mb tune --resume "$run" "${common[@]}"; return; fi
  step "tune $label"; mkdir -p "$dir"; mb tune "$@" "${common[@]}" --results-dir "$dir"; }
