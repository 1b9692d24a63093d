#!/usr/bin/env bash
# One-step set-up and run.
#   bash setup.sh [moebench args...]   install into ./.venv (created when missing), then run moebench
#                                       (no args: `moebench demo`: the measured sweep on a GPU, the
#                                       modeled TP-vs-EP answer for an H200 box without one)
#   bash setup.sh test [pytest args]   install the same way, then run the whole test suite (2 workers;
#                                       TEST_WORKERS=N to change, 0 for one process)
# A torch that is already importable by python3 (a GPU machine's CUDA build) is kept: the venv then
# sees the system site-packages. Otherwise torch==2.13.0 is installed (a CPU build on CPU machines
# of this project's kind, from local disk).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY="${PYTHON:-python3}"
# What the set-up is doing goes to stderr, one line a step (the install is quiet and takes a minute or two).
say() { echo "setup: $*" >&2; }

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    say "creating .venv with $PY, seeing its torch (the system site-packages)"
    "$PY" -m venv --system-site-packages .venv
  else
    say "creating .venv with $PY"
    "$PY" -m venv .venv
  fi
fi
stamp=".venv/.moebench-installed"
want="$(cat pyproject.toml | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  started=$SECONDS
  if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    say "installing torch==2.13.0 into .venv (the CPU build where this machine has one on local disk)..."
    .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
  fi
  say "installing moebench and its dependencies into .venv (pip install -e '.[test]')..."
  # With setuptools already here (as on machines without a package index), build in place.
  iso=""
  if .venv/bin/python -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" >/dev/null 2>&1; then
    iso="--no-build-isolation"
  fi
  .venv/bin/python -m pip install -q --disable-pip-version-check $iso -e '.[test]'
  echo "$want" > "$stamp"
  say "installed in $((SECONDS - started)) s; .venv is ready (later runs skip this until pyproject.toml changes)"
fi

if [ "${1:-}" = "test" ]; then
  shift
  # two pytest workers (pytest-xdist): the suite is single-threaded and CI machines have two cores;
  # TEST_WORKERS=0 runs it in this process (GPU tests: one process per GPU is what they expect)
  exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" "$@"
fi
if [ $# -eq 0 ]; then
  set -- demo
fi
exec .venv/bin/moebench "$@"
