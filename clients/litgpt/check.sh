#!/usr/bin/env bash
# litgpt 0.5.13's pre-training, full and LoRA fine-tuning scripts under the bare strategy string "zero2" (check.py),
# in a venv of its own (clients/litgpt/.venv, git-ignored):
# this package and litgpt installed side by side with one resolver each, then `pip check`, then check.py.
#   clients/litgpt/check.sh            # or: make litgpt-check
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${LITGPT_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -f "$VENV/.installed" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" "$ROOT"
    # litgpt pins jsonargparse<=4.41, which this package admits (its floor is 4.41).
    "$VENV/bin/pip" install -q litgpt==0.5.13
    # litdata's torchvision requirement would pull a CUDA build of torch: its pure-Python needs by hand.
    "$VENV/bin/pip" install -q --no-deps litdata==0.2.59
    "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" boto3 requests tifffile obstore  # botocore within aiobotocore's range
    touch "$VENV/.installed"
fi
# This checkout as it is now (a wheel, as a user installs it; its requirements are in place already).
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$ROOT"
# The package and litgpt's requirements agree (litdata is installed without its torchvision, on purpose).
broken="$("$VENV/bin/pip" check 2>&1 | grep -v -e '^litdata ' -e '^No broken requirements' || true)"
if [ -n "$broken" ]; then echo "FAIL: pip check: $broken"; exit 1; fi
echo "PASS: pip check (but for litdata's torchvision, left out on purpose)"
exec "$VENV/bin/python" "$HERE/check.py" "$@"
