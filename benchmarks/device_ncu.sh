#!/usr/bin/env bash
# Nsight Compute on the layer's GEMMs at chosen points: DRAM throughput, occupancy, launch shape and
# warp stall reasons of one call's GEMM1 and GEMM2 (`profile_case --plain` under `ncu`).
#   PYTHONPATH=. [CASES="dsv3-tp8:64:bf16 dsv3-tp8:64:fp8 ..."] bash benchmarks/device_ncu.sh
# A case is shape:tokens:precision (bf16 | fp8 = fp8 block 128 x 128). Each case's ncu CSV (page
# "details") goes to $OUT/ncu/<case>.csv, all of them into $OUT/ncu.tgz.
source "$(dirname "$0")/device_env.sh"
CASES="${CASES:-dsv3-tp8:64:bf16 dsv3-tp8:64:fp8 qwen3-30b-a3b:64:bf16 qwen3-30b-a3b:64:fp8}"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)"
[ -n "$NCU" ] || { step "no ncu on this machine"; exit 1; }
mkdir -p "$OUT/ncu"
for c in $CASES; do
  IFS=: read -r shape tok prec <<< "$c"
  flag=(); [ "$prec" = fp8 ] && flag=(--fp8-block)
  step "ncu $c"
  # 3 warm-up calls of 2 GEMM launches each are skipped; then one call's GEMM1 and GEMM2.
  timeout "${CASE_S:-150}" "$NCU" --clock-control none -k regex:gemm --launch-skip 6 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --csv --page details --log-file "$OUT/ncu/$c.csv" \
    python3 -m benchmarks profile_case --shape "$shape" --tokens "$tok" "${flag[@]}" --plain --calls 1 2>&1 \
    | tail -n 3 | tee -a "$log"
  python3 - "$OUT/ncu/$c.csv" <<'PY' | tee -a "$log"
import csv, sys
keep = ("Duration", "DRAM Throughput", "Registers Per Thread", "Achieved Occupancy", "Grid Size",
        "Theoretical Occupancy", "Dynamic Shared Memory Per Block", "Eligible Warps Per Scheduler")
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
k, m, u, v = (head.index(x) for x in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value"))
for r in rows:
    if r[m] in keep:
        print(r[k][:28], r[m], r[v], r[u])
PY
done
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu
step done
