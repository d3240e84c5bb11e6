#!/usr/bin/env bash
# Install torch into $VENV, preferring a CPU build that pip can find without an index
# (a wheel in the machine's pip find-links); elsewhere pip resolves torch as usual.
# Override with AREAL_STREAM_TORCH="torch==X.Y.Z" (any pip requirement).
set -euo pipefail
VENV=${VENV:-.venv}
pip=("$VENV/bin/python" -m pip install -q)
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then exit 0; fi
if [ -n "${AREAL_STREAM_TORCH:-}" ]; then
    "${pip[@]}" "$AREAL_STREAM_TORCH"
elif "${pip[@]}" --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    # a local CPU wheel was found; now fetch what it depends on from the index
    "${pip[@]}" "torch==2.13.0"
else
    "${pip[@]}" torch
fi
