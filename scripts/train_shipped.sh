#!/bin/bash
# Reproduces the shipped checkpoints (2 CPU cores): stage 1 (tiny-base, 1-pass, ~23 min), then the three
# stage-2 continuations side by side (tiny-fbt, 8000 steps with 16 warm passes, is the long pole: ~2-2.5 h
# sharing the cores), then their evaluations (~25 min each) and model cards.
# tiny-fbt's checkpoint was made as five resumed legs (--steps 1500, then --resume --steps 3000, 5000, 6500,
# 8000); its preset's lr_legs give the same learning rates in one run (tests/test_train.py checks the equivalence).
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
  cp figures/$p/eval.json checkpoints/$p/eval.json
done
