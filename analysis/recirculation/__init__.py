"""Recirculation study on a real pretrained model: `python -m analysis.recirculation` (docs/design.md).

Default: SmolLM2-135M-Instruct (preset `smollm2-135m`) on English text that ships with every CPython
(`pydoc_data/topics.py`: the language reference topics), cut into fixed-length chunks. Topics are split into a
*tuning* half and a *held-out* half (disjoint documents); every choice (layer pair, mode, alpha, temperatures) is
made on the tuning split and every reported number is measured on the held-out split.

Experiments (figures + one results.json under --out, default figures/<model>/recirculation/):
  a. heatmap.html   source x target perplexity change at fixed --alpha, convex and residual (tuning split,
                    plus held-out values of the chosen cell)
  b. dose.html      alpha from 0 to the failure point for the chosen pair: perplexity change and the mean KL
                    divergence KL(base || recirculated) of the next-token distributions (held-out)
  c. temperature.html  temperature-only vs recirculation-only vs both (temperatures tuned on the tuning split)
  d. basis.html     z_s injected as is vs after a small rotation vs after a Haar-random orthogonal rotation
  e. cost.html      sequential vs blockwise prefill: wall time, peak RSS increase, tokens/s, perplexity gap
  f. mediation.html (opt-in, --mediation) on a synthetic task (tasks/): a linear probe (stats.linear.LinearProbe)
                    fitted on the base model's depth-s state at the last position of the TRAINING groups gives the
                    task-state subspace (binary, and the language tasks' pair-role probe: its direction; K > 2
                    label words: the span of its class-centred class weights, rank K - 1); recirculation is then applied fully, only within that subspace,
                    only in its orthogonal complement, or only within a random subspace of equal rank; reported:
                    label logit difference LD = logit(true) - logit(the paired sample's label) (mean change
                    +- a group-clustered s.e.) and accuracy on the HELD-OUT groups. --mediation-only runs (f) alone, e.g. on the 1-pass-trained tiny-base,
                    which (unlike SmolLM2-135M) solves the tasks; results under figures/<model>/mediation-<task>/.
  g. targeted.html  (opt-in, --targeted) on a task with key tokens (induction, ioi, lookup, binding): at each
                    alpha, base vs uniform recirculation (every column) vs targeted recirculation (the key
                    token's column only; later tokens attend to its recirculated keys/values); accuracy and LD
                    and their change vs base with 95% group-bootstrap CIs, and each condition's failure point
                    (accuracy down > 0.05). --targeted-only runs (g) alone; results under
                    figures/<model>/targeted-<task>/.

Perplexity change = 100 * (ppl_recirculated / ppl_base - 1) in percent (negative = better); the base is the same
model's ordinary forward on the same chunks. All recirculated runs use the exact sequential engine except the
blockwise rows of (e).

Budget: the defaults (4 + 4 chunks of 64 tokens, a 3 x 3 source/target grid less its cells with s <= d: 8 at
L = 30, 5 alphas) make ~40 sequential runs of 256 tokens; on SmolLM2-135M one such run took ~9 s on an otherwise
idle 2-core machine, so the default run is ~6-8 minutes. Enlarge with --seq-len, --n-tune/--n-test, --pairs, --alphas, --passes.
"""
