#!/usr/bin/env bash
# Kept for PERF.md section 4's command: the compare_flip device job (python -m benchmarks device --list).
exec python3 -m benchmarks device compare_flip "$@"
