#!/bin/bash
# Reproduces the shipped checkpoints (2 CPU cores): stage 1 (tiny-base, 1-pass, 15 min at two threads), then the
# three stage-2 continuations side by side at one thread each (each alone at two threads, measured whole:
# tiny-fbt 44 min, tiny-fbt-no3 36 on a 1.24x slower machine, tiny-std 22; side by side, sharing the cores,
# well over an hour), then their evaluations (~11 min each for the feedback models at two threads alone) and model cards.
# The shipped tiny-fbt, tiny-std and tiny-fbt-no3 are single runs of these commands on the current stage-2 data
# (tiny-fbt: 750 steps at one thread, then resumed at two; tiny-std at one thread beside it; tiny-fbt-no3 at two
# threads alone); tiny-base is from commit 7a7322d's shipping.
# Another thread count gives other float rounding, hence not bit-identical weights.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m training.train --preset tiny-base --threads 2 --no-progress --overwrite
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m training.train --preset $p --threads 1 --no-progress --overwrite > "checkpoints/$p.train.log" 2>&1 &
done
wait
$PY -m analysis.evaluate --model checkpoints/tiny-base --modes std --n-pairs 25 --overwrite --no-progress
cp figures/tiny-base/eval.json checkpoints/tiny-base/eval.json
for p in tiny-fbt tiny-fbt-no3; do
  $PY -m analysis.evaluate --model checkpoints/$p --n-pairs 25 --overwrite --no-progress
  cp figures/$p/eval.json checkpoints/$p/eval.json
done
# tiny-std's fusion is untrained: its recurrent modes are not evaluated (the sweep would take ~40 min)
$PY -m analysis.evaluate --model checkpoints/tiny-std --modes std,soft,fused --n-pairs 25 --overwrite --no-progress
cp figures/tiny-std/eval.json checkpoints/tiny-std/eval.json
# Model cards (the notes are docs/cards/<name>.md; wall times in the cards are whatever this run measured).
$PY -m training.card checkpoints/tiny-base --command "python -m training.train --preset tiny-base   # ~20 min on 2 cores" --notes docs/cards/tiny-base.md > /dev/null
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  $PY -m training.card checkpoints/$p --command "python -m training.train --preset tiny-base && python -m training.train --preset $p" --notes docs/cards/$p.md > /dev/null
done
# The state-tracking pair (docs/recipe.md items 18, 19 and 21): from scratch, same data, steps and architecture
# (6 layers, 64-token sliding attention windows, dense targets at every column, all shell-game answers). Each alone
# at two threads, measured whole: see the model cards. On another machine this draws other weights (torch's CPU
# kernels differ bitwise): the committed checkpoints are the reference for every number.
for p in tiny-fbt-track tiny-std-track; do
  $PY -m training.train --preset $p --threads 2 --no-progress --overwrite
done
# Every mode for both models (20-40 min each): the twin's fed modes use its untrained fusion, so they show what
# feedback does to a network that never learned to read it.
for p in tiny-fbt-track tiny-std-track; do
  $PY -m analysis.evaluate --model checkpoints/$p --tasks parity,shell_game --n-pairs 100 --overwrite --no-progress
done
for p in tiny-fbt-track tiny-std-track; do cp figures/$p/eval.json checkpoints/$p/eval.json; done
for p in tiny-fbt-track tiny-std-track; do
  $PY -m training.card checkpoints/$p --command "python -m training.train --preset $p" --notes docs/cards/$p.md > /dev/null
done
$PY -m analysis.length_curves checkpoints/tiny-fbt-track/eval.json checkpoints/tiny-std-track/eval.json \
  --modes std,fused-30,recurrent-full --model-modes tiny-std-track:std --out docs/length_curves.html --png docs/length_curves.png \
  --overwrite
# The S5 / A5 pair (docs/recipe.md item 23): the tracking recipe on s5 and a5 with the hold / periodic draws and
# the held-out transition split. recurrent-full at N = 8 ... 1024 (16x the trained length; the window cache keeps
# it linear in the prompt), the standard pass to N = 256 (its full-width pass is quadratic).
for p in tiny-fbt-group tiny-std-group; do
  $PY -m training.train --preset $p --threads 2 --no-progress --overwrite
done
$PY -m analysis.evaluate --model checkpoints/tiny-fbt-group --tasks s5,a5 --modes recurrent-full \
  --distractors 8,16,32,64,128,256,512,1024 --n-pairs 100 --overwrite --no-progress
cp figures/tiny-fbt-group/eval.json checkpoints/tiny-fbt-group/eval.json
$PY -m analysis.evaluate --model checkpoints/tiny-std-group --tasks s5,a5 --modes std \
  --distractors 8,16,32,64,128,256 --n-pairs 100 --batch-size 16 --overwrite --no-progress
cp figures/tiny-std-group/eval.json checkpoints/tiny-std-group/eval.json
for p in tiny-fbt-group tiny-std-group; do
  $PY -m training.card checkpoints/$p --command "python -m training.train --preset $p" --notes docs/cards/$p.md > /dev/null
done
# The tracking pair on the adversarial draws (docs/recipe.md item 24): parity mended at the trained length, the
# shell game lost to the held-out split (results.md). Parity's variants go into the card's eval.json.
for p in tiny-fbt-track2 tiny-std-track2; do
  $PY -m training.train --preset $p --threads 2 --no-progress --overwrite
done
$PY -m analysis.evaluate --model checkpoints/tiny-fbt-track2 --tasks parity,parity@hold,parity@periodic,parity@heldout \
  --modes recurrent-full --distractors 16,64,256,1024 --n-pairs 100 --overwrite --no-progress
cp figures/tiny-fbt-track2/eval.json checkpoints/tiny-fbt-track2/eval.json
$PY -m analysis.evaluate --model checkpoints/tiny-std-track2 --tasks parity,shell_game,parity@hold --modes std \
  --distractors 16,64,256 --n-pairs 100 --batch-size 8 --overwrite --no-progress
cp figures/tiny-std-track2/eval.json checkpoints/tiny-std-track2/eval.json
for p in tiny-fbt-track2 tiny-std-track2; do
  $PY -m training.card checkpoints/$p --command "python -m training.train --preset $p" --notes docs/cards/$p.md > /dev/null
done
# Parity on any input to 16x (docs/recipe.md item 26): tiny-fbt-track2's recipe with a 4-token window (one update
# line), so the fed state alone carries the value across lines. Its parity variants go into the card's eval.json.
$PY -m training.train --preset tiny-fbt-track3 --threads 2 --no-progress --overwrite
$PY -m analysis.evaluate --model checkpoints/tiny-fbt-track3 --tasks parity,parity@hold,parity@periodic,parity@heldout \
  --modes recurrent-full --distractors 16,64,256,1024 --n-pairs 100 --overwrite --no-progress
cp figures/tiny-fbt-track3/eval.json checkpoints/tiny-fbt-track3/eval.json
$PY -m training.card checkpoints/tiny-fbt-track3 --command "python -m training.train --preset tiny-fbt-track3" \
  --notes docs/cards/tiny-fbt-track3.md > /dev/null
# Parity and the shell game on any input, held-out line pairs included (docs/recipe.md item 27): a 2-token window.
$PY -m training.train --preset tiny-fbt-track4 --threads 2 --no-progress --overwrite
$PY -m analysis.evaluate --model checkpoints/tiny-fbt-track4 --tasks shell_game,shell_game@hold,shell_game@periodic,\
shell_game@heldout,parity,parity@hold,parity@periodic,parity@heldout --modes recurrent-full \
  --distractors 16,64,256,1024 --n-pairs 100 --overwrite --no-progress
cp figures/tiny-fbt-track4/eval.json checkpoints/tiny-fbt-track4/eval.json
$PY -m training.card checkpoints/tiny-fbt-track4 --command "python -m training.train --preset tiny-fbt-track4" \
  --notes docs/cards/tiny-fbt-track4.md > /dev/null
# Looped depth beside the feedback models (docs/recipe.md item 25): the same 6 blocks as a prelude of 2, a core of
# 2 iterated r = 4 times (Huginn injection) and a coda of 2, on the tracking pair's and the group pair's data.
# Their evaluations run r = 1 ... 16 to N = 1024 (25 and 58 min at two threads: the standard pass chunked over the
# window cache).
for p in tiny-loop-track tiny-loop-group; do
  $PY -m training.train --preset $p --threads 2 --no-progress --overwrite
done
$PY -m analysis.evaluate --model checkpoints/tiny-loop-track --tasks parity,shell_game \
  --modes standard,loop-1,loop-2,loop-8,loop-16 --distractors 8,16,32,64,128,256,512,1024 --n-pairs 100 \
  --batch-size 16 --overwrite --no-progress
$PY -m analysis.evaluate --model checkpoints/tiny-loop-group --tasks s5,a5 \
  --modes standard,loop-1,loop-2,loop-8,loop-16 --distractors 8,16,32,64,128,256,512,1024 --n-pairs 100 \
  --batch-size 16 --overwrite --no-progress
for p in tiny-loop-track tiny-loop-group; do
  cp figures/$p/eval.json checkpoints/$p/eval.json
  $PY -m training.card checkpoints/$p --command "python -m training.train --preset $p" --notes docs/cards/$p.md > /dev/null
done
