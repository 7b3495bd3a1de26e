#!/usr/bin/env bash
# Redraw every committed figure in docs/ from committed inputs (docs/usage.md, "Redrawing the committed figures").
#
#   scripts/redraw_figures.sh                     # all of them (~20 min on 2 shared CPU cores; SmolLM2 needs `make smollm2`)
#   scripts/redraw_figures.sh length_curves depth_curves_memory      # only these
#
# length_curves.{html,png} come from the shipped eval.json files (checkpoints/tiny-fbt-track, tiny-std-track),
# length_curves_group.{html,png} from tiny-fbt-group's, tiny-std-group's and tiny-loop-group's; length_curves_loop.{html,png} from
# tiny-std-track's, tiny-fbt-track's and tiny-loop-track's;
# where_state.{html,png} from probes.run and interventions.run on tiny-loop-track and tiny-fbt-track (parity, N = 8);
# each depth_curves_*.png from the probes.json of a `python -m probes.run` run, made here first (into
# $FIGURES/<model>/<task>/, default figures/ of the repository: probes.run's own default folder, so a folder
# holding a different run is refused, not replaced). The PNGs need headless Chromium (`make chromium`).
# tests/test_figures.py checks, without a browser, that every committed figure is named here and that the
# committed accuracy-vs-N page holds what its eval.json files give.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
FIGURES=${FIGURES:-figures}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

ALL=(length_curves length_curves_group length_curves_loop where_state depth_curves_completion depth_curves_memory depth_curves_multi_register
     depth_curves_smollm2_completion depth_curves_smollm2_ioi causal_smollm2_ioi)

"$PY" -c "import sys; from probes.depth_curves import find_chromium; sys.exit(find_chromium() is None)" || {
  echo "error: headless Chromium not found: the PNGs need it (make chromium)" >&2; exit 2; }

# depth NAME MODEL TASK [probes.run flags...]: probes.run, then the depth-curve PNG of its probes.json.
depth() {
  local name=$1 model=$2 task=$3; shift 3
  local out="$FIGURES/$model/$task"
  "$PY" -m probes.run --task "$task" --model "$model" "$@" --out "$out" --no-progress
  "$PY" -m probes.depth_curves "$out/probes.json" --png "docs/$name.png"
}

draw() {
  case $1 in
    length_curves)
      "$PY" -m analysis.length_curves checkpoints/tiny-fbt-track/eval.json checkpoints/tiny-std-track/eval.json \
        --modes std,fused-30,recurrent-full --model-modes tiny-std-track:std \
        --out docs/length_curves.html --png docs/length_curves.png --overwrite ;;
    length_curves_group)  # the S5 / A5 pair (checkpoints/tiny-fbt-group, tiny-std-group)
      "$PY" -m analysis.length_curves checkpoints/tiny-fbt-group/eval.json checkpoints/tiny-std-group/eval.json \
        checkpoints/tiny-loop-group/eval.json --modes std,recurrent-full,standard,loop-1,loop-8,loop-16 \
        --model-modes tiny-std-group:std --model-modes tiny-loop-group:loop-1,standard,loop-8,loop-16 \
        --title "S5 and A5: feedback across positions vs in depth (tiny-loop-group standard = its trained 4 iterations)" \
        --out docs/length_curves_group.html --png docs/length_curves_group.png --overwrite ;;
    length_curves_loop)  # the three-way comparison (issue 41): twin, feedback across positions, looped depth
      "$PY" -m analysis.length_curves checkpoints/tiny-std-track/eval.json checkpoints/tiny-fbt-track/eval.json \
        checkpoints/tiny-loop-track/eval.json --modes std,recurrent-full,standard,loop-1,loop-2,loop-8,loop-16 \
        --model-modes tiny-std-track:std --model-modes tiny-fbt-track:recurrent-full \
        --model-modes tiny-loop-track:loop-1,loop-2,standard,loop-8,loop-16 \
        --title "Feedback across positions vs in depth: accuracy vs N (tiny-loop-track standard = its trained 4 iterations)" \
        --out docs/length_curves_loop.html --png docs/length_curves_loop.png --overwrite ;;
    where_state)  # the looped model per iteration beside the fed state (parity, N = 8)
      "$PY" -m probes.run --task parity --model tiny-loop-track --distractors 8 \
        --out "$FIGURES/tiny-loop-track/parity-standard" --no-progress
      "$PY" -m interventions.run --task parity --model tiny-loop-track --distractors 8 \
        --out "$FIGURES/tiny-loop-track/parity-causal" --overwrite --no-progress
      "$PY" -m interventions.run --task parity --model tiny-fbt-track --mode recurrent-full --distractors 8 \
        --out "$FIGURES/tiny-fbt-track/parity-causal" --overwrite --no-progress
      "$PY" -m analysis.where_state --probes "$FIGURES/tiny-loop-track/parity-standard/probes.json" \
        --causal "$FIGURES/tiny-loop-track/parity-causal/causal_report.json" \
        --feedback "$FIGURES/tiny-fbt-track/parity-causal/causal_report.json" \
        --out docs/where_state.html --png docs/where_state.png --overwrite ;;
    depth_curves_completion) depth depth_curves_completion tiny-fbt completion ;;
    depth_curves_memory) depth depth_curves_memory tiny-fbt memory ;;
    depth_curves_multi_register) depth depth_curves_multi_register tiny-fbt multi_register ;;
    depth_curves_smollm2_completion)
      depth depth_curves_smollm2_completion smollm2-135m completion --recirculate 20:2:0.1 --distractors 0 \
        --n-pairs 48 ;;
    depth_curves_smollm2_ioi)
      depth depth_curves_smollm2_ioi smollm2-135m ioi --recirculate 20:2:0.1:residual --distractors 0 --n-pairs 64 ;;
    causal_smollm2_ioi)  # the causal page of SmolLM2 on ioi under recirculation (its plotly.min.js is docs/'s)
      local out="$FIGURES/smollm2-135m/ioi-recirc-20:2:0.1:residual"
      "$PY" -m interventions.run --task ioi --model smollm2-135m --mode recirc-20:2:0.1:residual --n-pairs 48 \
        --control-model none --out "$out" --overwrite --no-progress
      cp "$out/causal_report.html" docs/causal_smollm2_ioi.html ;;
  esac
}

[ $# -gt 0 ] || set -- "${ALL[@]}"
for f in "$@"; do  # every name checked before anything runs
  [[ " ${ALL[*]} " == *" $f "* ]] || { echo "error: unknown figure '$f' (known: ${ALL[*]})" >&2; exit 2; }
done
for f in "$@"; do
  echo "== $f"
  draw "$f"
done
