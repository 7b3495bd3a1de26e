#!/bin/bash
# Every benchmark in benchmarks/, one after the other (run on an otherwise idle machine): the last line of each log
# is its JSON. Logs go to $OUT (made if missing; default: the repository root, where this script runs).
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT="${OUT:-.}"
mkdir -p "$OUT" || { echo "error: cannot make \$OUT=$OUT" >&2; exit 2; }
failed=0
for b in "collect" "probes_run --repeats 5" "train --threads 1" "fixed_point --threads 1" \
         "prefill --threads 1 --clock cpu" "interventions --n-pairs 20" "recirculation" "probes" "decode --threads 1 --clock cpu" \
         "collect_processes" "train_ddp" "patching" "attribution" "cold_step"; do
  set -- $b
  echo "=== $b"
  timeout 900 $PY benchmarks/$1.py ${@:2} > "$OUT/bench_$1.log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    failed=$((failed + 1))
    echo "FAILED (exit $rc): see $OUT/bench_$1.log"
  fi
  tail -n 1 "$OUT/bench_$1.log"
done
echo "BENCH DONE ($failed failed)"
[ "$failed" -eq 0 ]
