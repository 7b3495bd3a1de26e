#!/bin/bash
# Reproduces the shipped checkpoints (2 CPU cores): stage 1 (tiny-base, 1-pass), then the three stage-2
# continuations side by side, then their evaluations and model cards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m models.train --preset tiny-base --threads 2 --no-progress --overwrite
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m models.train --preset $p --threads 1 --no-progress --overwrite > "checkpoints/$p.train.log" 2>&1 &
done
wait
for p in tiny-base tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m models.evaluate --model checkpoints/$p --n-pairs 25 --overwrite --no-progress
done
