#!/usr/bin/env bash
# The test command: install everything, start the services the tests need, run ruff, mypy, then pytest.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  command -v chromium >/dev/null || need+=(chromium)
  command -v slurmctld >/dev/null || need+=(slurm-wlm munge)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi
bash scripts/install.sh
if [ -x scripts/slurm/start-cluster.sh ] || [ -f scripts/slurm/start-cluster.sh ]; then
  bash scripts/slurm/start-cluster.sh || echo "warning: SLURM did not start; SLURM tests will be skipped" >&2
fi

# lint and types first (configured in pyproject.toml): a finding fails the run before pytest
"$PYTHON" -m ruff check .
"$PYTHON" -m mypy

# pytest-xdist: one worker per CPU of this process's affinity, at most 4 (each loads torch);
# tests that share the SLURM node or benchmarks/out/ run on one worker (tests/conftest.py)
workers=$("$PYTHON" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadgroup)
fi

set +e
"$PYTHON" -m pytest "${parallel[@]}" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
