#!/bin/bash
# Stage 2 of the shipped recipe: three continuations of tiny-base, run side by side on 2 cores.
cd /work/main
for p in tiny-fbt tiny-fbt-no3 tiny-std; do
  .venv/bin/python -m models.train --preset $p --threads 1 --no-progress --overwrite > runs/$p.log 2>&1 &
done
wait
