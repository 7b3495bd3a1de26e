"""(g) Targeted vs uniform recirculation on a task with key tokens (Racing Thoughts' targeted patching).

For each alpha, three conditions on the same prompts, all read at the last position:
    base      no recirculation (the model's ordinary forward)
    uniform   recirculation at every real column (the s:d:alpha:mode spec as everywhere else)
    targeted  recirculation at the key token's column only (RecirculatedLM mix_mask): only the key token's deep
              state is mixed into its recirculation branch; every later token attends to that token's
              recirculated keys/values (and to the other tokens' recirculation branches, which are unmixed but
              read it in turn)
The key column per prompt is tasks.key_token_positions (the key token's 0-based index in its unpadded prompt,
shifted by the left padding). All recirculated runs use the exact sequential engine.

Metrics per condition, over all samples: accuracy (argmax over the task's K label words at the last position; an
m-way tie counts 1/m, as interventions.metrics does) and LD = logit(true label word) - logit(the paired sample's
label word), and their changes against base, each with a 95% percentile CI from one cluster bootstrap over
sample.group_id (stats.bootstrap; the same resamples for every condition and alpha, so changes are paired).
Failure point per condition: the first alpha at which accuracy falls by more than FAIL_DROP (absolute) against
base; None if it never does.
"""
from __future__ import annotations

import re
import sys

import numpy as np
import torch

from analysis.recirculation.mediation import pair_partner_labels
from analysis.recirculation.text import ByteTokenizer
from common.cli import derived_seed
from common.errors import UserError
from engine.prefill import pad_left, prefill
from engine.recirculation import MODES, RecircSpec, RecirculatedLM
from interventions.metrics import decisions
from stats.bootstrap import ClusterBootstrap, percentile_ci

FAIL_DROP = 0.05  # failure point: accuracy more than this far below base (absolute)
N_BOOT = 1000
DEFAULT_ALPHAS = "0.05,0.1,0.2,0.4,0.6,0.8,1.0"
CONDITIONS = ("uniform", "targeted")
_SD_RE = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*(?::\s*(\w+)\s*)?$")


def parse_sd(value: str, n_layers: int | None = None) -> tuple[int, int, str]:
    """'S:D[:MODE]' -> (source, target, mode) (mode default residual), validated against n_layers when given."""
    m = _SD_RE.match(str(value))
    if not m:
        raise UserError(f"bad --targeted-spec {value!r}: use S:D[:convex|residual], e.g. 20:2:residual")
    s, d, mode = int(m.group(1)), int(m.group(2)), (m.group(3) or "residual").lower()
    if mode not in MODES:
        raise UserError(f"bad --targeted-spec {value!r}: mode must be convex or residual, got {mode!r}")
    spec = RecircSpec(s, d, 0.1, mode)  # s > d >= 0
    if n_layers is not None:
        spec.validate(n_layers)
    return s, d, mode


def default_sd(n_layers: int) -> str:
    """20:2:residual on a model of >= 20 layers; else source ~2L/3 and target ~L/15 (at least 1, below the
    source), residual: the same proportions on a 30-layer model (SmolLM2-135M) give 20:2."""
    if n_layers >= 20:
        return "20:2:residual"
    s = min(n_layers, max(2, round(2 * n_layers / 3)))
    d = max(0, min(s - 1, max(1, round(n_layers / 15))))
    return f"{s}:{d}:residual"


def key_columns(samples, tok, ids) -> list[int]:
    """tasks.key_token_positions, checked: one index per sample inside its prompt."""
    from tasks import key_token_positions as fn

    keys = [int(k) for k in fn(samples, tok)]
    if len(keys) != len(ids):
        raise UserError(f"tasks.key_token_positions gave {len(keys)} positions for {len(ids)} samples")
    for k, row, smp in zip(keys, ids, samples):
        if not 0 <= k < len(row):
            raise UserError(f"key token position {k} of {smp.task} pair {smp.pair_id} is outside its "
                            f"{len(row)}-token prompt")
    return keys


def _ci(boot: ClusterBootstrap, values: np.ndarray, n_reps: np.ndarray) -> tuple[float, list[float] | None]:
    """(mean, 95% percentile CI of the mean over the group resamples)."""
    total, reps = boot.sums(values)
    ci = percentile_ci(reps / n_reps) if boot.n_groups >= 2 else None  # one group: no interval (stats.bootstrap)
    return float(total / len(values)), (None if ci is None else [ci[0], ci[1]])


def targeted_inputs(tok, task: str, n_pairs: int, n_distractors: int, seed: int):
    """(samples, token ids, label token ids, key columns) of (g)'s dataset; every refusal the task and tokenizer make
    (no key token, label words that share a first token) comes from here, so the CLI runs it before any experiment."""
    from tasks import label_token_ids, make_dataset, tokenize_samples

    samples = make_dataset(task, n_pairs=n_pairs, n_distractors=n_distractors, seed=seed)
    ids, samples = tokenize_samples(samples, tok)
    lab = label_token_ids(tok, task)
    return samples, ids, lab, key_columns(samples, tok, ids)


def targeted(model, tok, spec_sd, task: str, n_pairs: int, n_distractors: int, alphas, batch: int, seed: int,
             ramp: int = 0, n_boot: int = N_BOOT, inputs=None) -> dict:
    """(g): base vs uniform vs targeted recirculation at every alpha (module doc). `spec_sd`: 'S:D[:MODE]' or a
    (source, target, mode) tuple."""
    if isinstance(tok, ByteTokenizer):
        raise UserError("--targeted needs a real tokenizer (not the byte stand-in of the tiny random models)")
    s, d, mode = parse_sd(spec_sd, model.n_layers) if isinstance(spec_sd, str) else tuple(spec_sd)
    RecircSpec(s, d, 0.1, mode, ramp=ramp).validate(model.n_layers)
    alphas = sorted({float(a) for a in alphas})
    if not alphas:
        raise UserError("--targeted-alphas is empty")
    samples, ids, lab, keys = inputs or targeted_inputs(tok, task, n_pairs, n_distractors, seed)  # (CLI: made once)
    K = len(lab)
    y = np.array([smp.label for smp in samples])
    other = pair_partner_labels(samples)
    groups = np.array([smp.group_id for smp in samples])
    n = len(samples)

    batches = []  # (padded ids, mask, key-column mask, last column)
    for i in range(0, n, batch):
        rows = list(range(i, min(n, i + batch)))
        x, m = pad_left([ids[j] for j in rows])
        T = x.shape[1]
        km = torch.zeros(x.shape, dtype=torch.bool)
        for r, j in enumerate(rows):
            km[r, T - len(ids[j]) + keys[j]] = True
        batches.append((x, m, km, torch.tensor([T - 1])))

    def label_logits(spec: RecircSpec | None, targeted_: bool) -> torch.Tensor:
        out = []
        for x, m, km, last in batches:
            if spec is None:
                lg = prefill(model, x, m, "standard", collect=False).logits[:, -1]
            else:
                lg = RecirculatedLM(model, spec).prefill(x, m, cols=last, mix_mask=km if targeted_ else None
                                                         ).logits[:, 0]
            out.append(lg.float()[:, lab])
        return torch.cat(out).double()  # [n, K]

    yt, ot = torch.as_tensor(y, dtype=torch.long), torch.as_tensor(other, dtype=torch.long)

    def per_row(z: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        ld = (z.gather(1, yt[:, None])[:, 0] - z.gather(1, ot[:, None])[:, 0]).numpy()
        return decisions(z, y, y, range(K))[0], ld  # (correct [n], LD [n])

    boot = ClusterBootstrap(groups, n_boot, derived_seed(seed, 7))
    if boot.n_groups < 2:
        raise UserError(f"--targeted-pairs too small: the {task} samples fall in {boot.n_groups} group, and the "
                        "bootstrap CIs resample groups (need at least 2)")
    _, n_reps = boot.sums(np.ones(n))
    base_acc, base_ld = per_row(label_logits(None, False))

    def summary(acc: np.ndarray, ld: np.ndarray) -> dict:
        out = {}
        for key, v in (("accuracy", acc), ("mean_ld", ld), ("accuracy_change", acc - base_acc),
                       ("ld_change", ld - base_ld)):
            out[key], out[key + "_ci"] = _ci(boot, v, n_reps)
        return out

    base = {k: v for k, v in summary(base_acc, base_ld).items() if "change" not in k}
    res = {"task": task, "n_pairs": n_pairs, "n_distractors": n_distractors, "n": n,
           "n_groups": boot.n_groups, "n_classes": K, "source": s, "target": d, "mode": mode, "ramp": ramp,
           "spec": f"{s}:{d}:{mode}", "alphas": alphas, "n_boot": n_boot, "fail_drop": FAIL_DROP,
           "key_tokens_from_end_mean": float(np.mean([len(r) - 1 - k for r, k in zip(ids, keys)])),
           "base": base, "points": []}
    print(f"[g] {task}: {n} prompts, {boot.n_groups} groups, spec {s}:{d}:{mode}; base accuracy "
          f"{base['accuracy']:.3f}, LD {base['mean_ld']:+.3f}", file=sys.stderr, flush=True)
    for a in alphas:
        spec = RecircSpec(s, d, a, mode, ramp=ramp)
        point = {"alpha": a}
        for cond in CONDITIONS:
            point[cond] = summary(*per_row(label_logits(spec, cond == "targeted")))
        res["points"].append(point)
        print(f"[g] alpha {a:g}: " + "; ".join(
            f"{c} acc {point[c]['accuracy']:.3f} ({point[c]['accuracy_change']:+.3f}) LD {point[c]['mean_ld']:+.3f} "
            f"({point[c]['ld_change']:+.3f})" for c in CONDITIONS), file=sys.stderr, flush=True)
    res["failure_alpha"] = failure_alphas(res["points"])
    return res


def failure_alphas(points: list[dict]) -> dict:
    """Per condition, the first point's alpha (points in increasing alpha) whose accuracy falls more than
    FAIL_DROP below base; None where none does."""
    # (a drop of exactly FAIL_DROP, e.g. 1 of 20 rows, is no failure: float rounding of the means is allowed for)
    return {c: next((p["alpha"] for p in points if -p[c]["accuracy_change"] > FAIL_DROP + 1e-9), None)
            for c in CONDITIONS}
