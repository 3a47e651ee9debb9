#!/usr/bin/env bash
# Two commits' checkpoint benchmarks in one run, alternating round by round, so both meet the same machine:
#
#   bench/side_by_side.sh BASE HEAD [ROUNDS]      (default ROUNDS=2)
#
# Each commit is checked out into a worktree of its own (git worktree, under a temporary directory) and its own
# bench scripts run there with the project's venv, PYTHONPATH pointing at that worktree's package:
# `bench/checkpoint.py --quick` and `bench/trainer_checkpoint.py`. The reports go to
# bench/out/side_by_side/<commit>-<round>-{checkpoint,trainer}.md; compare their tables (BENCHMARKS.md records
# the medians). Used to show that a change that moves code leaves the figures within noise.
set -euo pipefail
cd "$(dirname "$0")/.."
# Both refs resolved once: a commit made while this runs does not change what is compared.
BASE=$(git rev-parse --short "${1:?usage: bench/side_by_side.sh BASE HEAD [ROUNDS]}")
HEAD_REF=$(git rev-parse --short "${2:?usage: bench/side_by_side.sh BASE HEAD [ROUNDS]}")
ROUNDS=${3:-2}
PY="$PWD/.venv/bin/python"
OUT="$PWD/bench/out/side_by_side"
WORK=$(mktemp -d)
mkdir -p "$OUT"
trap 'for d in "$WORK"/*; do git worktree remove --force "$d" >/dev/null 2>&1 || true; done; rm -rf "$WORK"' EXIT
if [ "$(git rev-parse "$BASE")" = "$(git rev-parse "$HEAD_REF")" ]; then
  echo "BASE and HEAD are the same commit" >&2; exit 2
fi
for ref in "$BASE" "$HEAD_REF"; do
  git worktree add --detach -q "$WORK/$(git rev-parse --short "$ref")" "$ref"
done
for round in $(seq 1 "$ROUNDS"); do
  for ref in "$BASE" "$HEAD_REF"; do
    short=$(git rev-parse --short "$ref")
    mkdir -p "$WORK/ckpt-$short"
    (cd "$WORK/$short" && PYTHONPATH="$WORK/$short" "$PY" bench/checkpoint.py --quick --dir "$WORK/ckpt-$short" \
       --out "$OUT/$short-$round-checkpoint.md" > /dev/null)
    (cd "$WORK/$short" && PYTHONPATH="$WORK/$short" "$PY" bench/trainer_checkpoint.py > "$OUT/$short-$round-trainer.md")
    echo "round $round: $short done"
  done
done
