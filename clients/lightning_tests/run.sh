#!/usr/bin/env bash
# Lightning's own tests (tests/tests_pytorch at the tag nearest the installed Lightning), run twice through
# lz_substitute.py: once as a pass-through control and once with ZeroLowLevelStrategy in place of DDP;
# compare.py then lists, test by test, what passed under control and not when substituted.
#
#   clients/lightning_tests/run.sh                      # the default selection, control and zero2
#   MODES="control zero1" clients/lightning_tests/run.sh callbacks/test_ema.py
#
# Environment: LIGHTNING_GIT (a git dir of Lightning's repository, e.g. from `fetch`), VENV (built here with
# torch, this checkout and the packages Lightning's tests import, if missing), MODES, TEST_TIMEOUT (seconds
# per test), LZ_ONLY_DDP (1: only tests that mention DDP, the default), LZ_SWAP_AUTO, PARALLEL (1: run the
# modes at the same time). Outputs go to results/<mode>.xml, results/<mode>.log and results/compare.md.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
LIGHTNING_GIT="${LIGHTNING_GIT:-/work/.mirror/Lightning-AI+pytorch-lightning/repo}"
VENV="${VENV:-$HERE/.venv}"
MODES="${MODES:-control zero2}"
TEST_TIMEOUT="${TEST_TIMEOUT:-180}"
export LZ_ONLY_DDP="${LZ_ONLY_DDP:-1}"
export LZ_SWAP_AUTO="${LZ_SWAP_AUTO:-0}"
PARALLEL="${PARALLEL:-1}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -c "$REPO_ROOT/constraints.txt" -e "$REPO_ROOT"
    "$VENV/bin/pip" install -q -c "$REPO_ROOT/constraints.txt" cloudpickle scikit-learn tensorboard tensorboardX \
        pandas matplotlib pytest pytest-timeout pytest-rerunfailures psutil
fi
PY="$VENV/bin/python"

# The newest release tag not above the installed version (2.6.5 for 2.6.6 when the mirror lacks 2.6.6).
TAG="$("$PY" - "$LIGHTNING_GIT" <<'PYEOF'
import re, subprocess, sys
import lightning
from packaging.version import Version
installed = Version(lightning.__version__)
tags = subprocess.run(["git", "--git-dir", sys.argv[1], "tag"], capture_output=True, text=True, check=True).stdout.split()
releases = [t for t in tags if re.fullmatch(r"v?\d+\.\d+\.\d+", t) and Version(t.lstrip("v")) <= installed]
print(max(releases, key=lambda t: Version(t.lstrip("v"))))
PYEOF
)"
WORK="$HERE/work/$TAG"
if [ ! -d "$WORK/tests/tests_pytorch" ]; then
    mkdir -p "$WORK"
    git --git-dir "$LIGHTNING_GIT" archive "$TAG" tests/tests_pytorch | tar -x -C "$WORK"
fi
# Lightning's [tool.pytest.ini_options], less --doctest-modules, outside the tests folder: its conftest fails
# a test that leaves any new file under tests/.
cat > "$WORK/pytest.ini" <<'INI'
[pytest]
norecursedirs = .git dist build docs
addopts = --strict-markers --color=no --disable-pytest-warnings
markers =
    cloud: Run the cloud tests for example
filterwarnings =
    error::FutureWarning
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
xfail_strict = true
junit_duration_report = call
junit_family = xunit1
INI

# test_legacy_checkpoints needs tests/legacy, which is not extracted.
IGNORES=(--ignore tests_pytorch/checkpointing/test_legacy_checkpoints.py)
if [ "$#" -gt 0 ]; then
    TARGETS=("$@")
else
    TARGETS=(callbacks checkpointing trainer/connectors loops core/test_lightning_optimizer.py)
    for f in "$WORK"/tests/tests_pytorch/strategies/test_ddp*.py; do TARGETS+=("strategies/$(basename "$f")"); done
fi
TARGETS=("${TARGETS[@]/#/tests_pytorch/}")

RESULTS="$HERE/results"
mkdir -p "$RESULTS"
run_mode() {
    local mode="$1"
    (cd "$WORK/tests" && LZ_MODE="$mode" PYTHONPATH="$HERE:$WORK/tests" nice -n 15 "$PY" -m pytest \
        -c "$WORK/pytest.ini" --rootdir "$WORK/tests" -p lz_substitute -p no:cacheprovider --continue-on-collection-errors \
        --timeout "$TEST_TIMEOUT" -q -rfE --junitxml "$RESULTS/$mode.xml" "${IGNORES[@]}" "${TARGETS[@]}" \
        > "$RESULTS/$mode.log" 2>&1) || true
    echo "$mode: $(tail -1 "$RESULTS/$mode.log")"
}
echo "Lightning tests at $TAG: ${TARGETS[*]}"
if [ "$PARALLEL" = 1 ]; then
    for mode in $MODES; do run_mode "$mode" & done
    wait
else
    for mode in $MODES; do run_mode "$mode"; done
fi
set -- $MODES
if [ "$#" -ge 2 ]; then
    "$PY" "$HERE/compare.py" "$RESULTS/$1.xml" "$RESULTS/$2.xml" > "$RESULTS/compare.md"
    head -8 "$RESULTS/compare.md"
fi
