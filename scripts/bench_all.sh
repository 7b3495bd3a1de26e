#!/bin/bash
# All benchmarks one after the other (run on an otherwise idle machine); last line of each log is its JSON.
cd "$(dirname "$0")/.."
PY=.venv/bin/python
for b in "collect" "probes_run --repeats 5" "train --threads 1" "fixed_point --threads 1" "prefill --threads 1 --clock cpu" "interventions" "recirculation" "probes" "decode --threads 1 --clock cpu" "collect_processes" "train_ddp" "patching"; do
  set -- $b
  echo "=== $b"
  timeout 900 $PY benchmarks/$1.py ${@:2} > "${OUT:-.}/bench_$1.log" 2>&1
  tail -n 1 "${OUT:-.}/bench_$1.log"
done
echo BENCH DONE
