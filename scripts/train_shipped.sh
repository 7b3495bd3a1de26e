#!/bin/bash
# Reproduces the shipped checkpoints (2 CPU cores): stage 1 (tiny-base, 1-pass, ~20 min), then the three
# stage-2 continuations side by side at one thread each (tiny-fbt, 4000 steps with the fixed-point start and
# the state-consistency loss at every block, is the long pole: ~2 h sharing the cores), then their
# evaluations (~20 min each for the feedback models) and model cards.
# The shipped tiny-fbt was trained as this command in three resumed legs (stops at steps 1750 and 2750, the
# second and third at other thread counts); --resume continues bit-identically at a fixed thread count (tested).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m models.train --preset tiny-base --threads 2 --no-progress --overwrite
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m models.train --preset $p --threads 1 --no-progress --overwrite > "checkpoints/$p.train.log" 2>&1 &
done
wait
$PY -m models.evaluate --model checkpoints/tiny-base --modes std --n-pairs 25 --overwrite --no-progress
cp figures/tiny-base/eval.json checkpoints/tiny-base/eval.json
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m models.evaluate --model checkpoints/$p --n-pairs 25 --overwrite --no-progress
  cp figures/$p/eval.json checkpoints/$p/eval.json
done
# Model cards (the notes are docs/cards/<name>.md; wall times in the cards are whatever this run measured).
$PY -m models.card checkpoints/tiny-base --command "python -m models.train --preset tiny-base   # ~20 min on 2 cores" --notes docs/cards/tiny-base.md > /dev/null
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m models.card checkpoints/$p --command "python -m models.train --preset tiny-base && python -m models.train --preset $p" --notes docs/cards/$p.md > /dev/null
done
