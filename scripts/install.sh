#!/usr/bin/env bash
# Install embedpipe and its test/runtime dependencies into the current Python.
# torch is pinned here only when none is installed: a GPU user's own CUDA build is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Debian's own python3 is "externally managed" (PEP 668); use a venv there, or allow pip:
export PIP_BREAK_SYSTEM_PACKAGES=${PIP_BREAK_SYSTEM_PACKAGES:-1}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
