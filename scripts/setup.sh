#!/usr/bin/env bash
# Install tpc and what it needs into the current Python (python3, or $PYTHON).
# Works where torch is already installed (it is kept) and where it is not (torch==2.13.0 is
# installed by name first: a bare `torch` requirement on a machine without it would pull the
# newest build with several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch 2.13.0"
  pipq torch==2.13.0
fi
# -e: the repository folders are the installed package (tpc.compiler = compiler/, ...).
pipq -e ".[test]"
"$PY" -c "import torch, lark, tpc.cli.main; print('setup: tpc ready (torch', torch.__version__ + ')')"
