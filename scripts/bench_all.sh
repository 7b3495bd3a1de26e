#!/bin/bash
# Every benchmark in benchmarks/, one after the other (run on an otherwise idle machine), each as the command
# docs/benchmarks.md quotes with its figure: the last line of each log is its JSON. Logs go to a fresh folder
# $OUT/<date>_<time> ($OUT default bench_logs/ in the repository root, git-ignored; $STAMP names the folder instead
# of the date); an existing folder is refused, so no earlier run's logs are overwritten.
# `bash scripts/bench_all.sh --list` prints the commands and runs nothing.
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# Each benchmark's wall-clock limit: prefill takes 10-13 minutes on a slow 2-core machine, so a 15-minute limit
# sat too close to it. The limit's SIGTERM runs a CLI's cleanup (common.errors.cli_entry), which a process blocked
# in C (a gloo collective or rendezvous: a hang) only reaches once the call returns: SIGKILL follows after KILL_S.
LIMIT_S=1800
KILL_S=60
# One entry a benchmark: leading VAR=VALUE words are its environment, then the script's name and its flags.
BENCHES=(
  "collect"
  "probes_run --repeats 7"
  "train --threads 2"
  "fixed_point --threads 2"
  "prefill --threads 1 --clock cpu"
  "OMP_NUM_THREADS=1 interventions --n-pairs 20"
  "recirculation --repeats 5"
  "probes"
  "decode --threads 1 --clock cpu"
  "collect_processes"
  "train_ddp"
  "patching --positions 6 --repeats 1"
  "attribution --distractors 16 --n-pairs 50 --repeats 2"
  "cold_step"
)
if [ "$1" = "--list" ]; then
  for b in "${BENCHES[@]}"; do
    set -- $b
    envs=(); while [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
    echo "${envs[*]}${envs:+ }python benchmarks/$1.py${2:+ }${*:2}"
  done
  exit 0
elif [ $# -gt 0 ]; then
  echo "error: the only option is --list (got: $*)" >&2
  exit 2
fi
OUT="${OUT:-bench_logs}"
RUN="$OUT/${STAMP:-$(date +%Y-%m-%d_%H%M%S)}"
if [ -e "$RUN" ]; then
  echo "error: $RUN exists: its logs are kept; give another \$OUT or \$STAMP" >&2
  exit 2
fi
mkdir -p "$OUT" && mkdir "$RUN" || { echo "error: cannot make $RUN" >&2; exit 2; }
echo "logs: $RUN"
failed=0
for b in "${BENCHES[@]}"; do
  set -- $b
  envs=(); while [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
  name=$1
  echo "=== ${envs[*]}${envs:+ }python benchmarks/$name.py ${*:2}"
  timeout -k $KILL_S $LIMIT_S env "${envs[@]}" $PY benchmarks/$name.py "${@:2}" > "$RUN/bench_$name.log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    failed=$((failed + 1))
    why="exit $rc"; [ "$rc" -eq 124 ] && why="stopped after $LIMIT_S s"
    [ "$rc" -eq 137 ] && why="killed: SIGKILL, $KILL_S s after the $LIMIT_S s limit, or out of memory"
    echo "FAILED ($why): see $RUN/bench_$name.log"
  fi
  tail -n 1 "$RUN/bench_$name.log"
done
echo "BENCH DONE ($failed failed)"
[ "$failed" -eq 0 ]
