"""Intervention metrics with cluster-bootstrap 95% CIs (docs/design.md, Interventions).

For row i with true label y_i, reference (donor) label r_i and label-word logits z (K >= 2 label words):
    o_i         = the "other" label: r_i where r_i != y_i, else the paired sample's label (always != y_i);
                  binary tasks: o_i = 1 - y_i always
    LD_i        = z[y_i] - z[o_i]                        label logit difference at T
    correct_i   binary: 1 if LD_i > 0, 1/2 if LD_i == 0, 0 otherwise (an exact tie is a coin flip);
                K > 2: 1/m if y_i is among the m tied argmax label words, else 0 (the same rule for K = 2)
    follows_i   "follows donor", over rows whose reference label differs from their own (r_i != y_i): the
                prediction (argmax over the K label words) is the donor's label, 1/m on an m-way tie; binary:
                1 - correct_i. Rows with a same-label donor (possible under resampling) are left out;
                `n_donor_rows` counts the rows used, `follows_donor` the (tie-weighted) count among them.
                On a model that is often wrong this is not "the answer moved": a row the clean run already
                answers with the donor's label "follows" with no intervention at all.
    changed_i   "changed", over every row: the prediction differs from the clean run's prediction (argmax over
                the K label words; ties: 1 - P(two uniform picks from the tied sets agree), 0 for the same tied set). An identity patch
                gives 0: exactly where the patched run reuses the clean run's logits (engine.patching), else its
                logits match the clean ones to float rounding (~1e-7; a prediction moves only on a tie within
                rounding). This is what most readers mean by a "flip".
    normalized effect = (mean LD_patched - mean LD_clean) / (mean LD_ref - mean LD_clean)
                  a ratio of means (stable where single rows have LD_ref ~ LD_clean); LD_ref is the reference
                  run's clean LD measured against row i's labels (for the paired donor, LD_ref = -LD_pair).
                  0 = no effect, 1 = behaves like the reference.
CIs: percentile bootstrap over groups (cluster bootstrap; rows of one group, e.g. a pair, are resampled
together), `n_boot` resamples seeded by `seed`. Every metric reports its own n.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from stats.bootstrap import ClusterBootstrap, percentile_ci


def label_ld(logits: torch.Tensor, labels, label_ids, other=None) -> np.ndarray:
    """LD = logit(label word of `labels`) - logit(label word of `other`), per row. logits [B, V].

    `other` default: 1 - labels (binary tasks only)."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    if other is None:
        if len(label_ids) != 2:
            raise ValueError("label_ld needs `other` labels when there are more than two label words")
        other = 1 - labels
    other = torch.as_tensor(other, dtype=torch.long)
    z = logits[:, list(label_ids)].double()  # [B, K]
    true = z.gather(1, labels[:, None])[:, 0]
    oth = z.gather(1, other[:, None])[:, 0]
    return (true - oth).cpu().numpy()


def decisions(logits: torch.Tensor, labels, ref_labels, label_ids) -> tuple[np.ndarray, np.ndarray]:
    """(correct, follow) per row for K label words: 1/m where the own (resp. reference) label is among the m
    tied argmax label words, else 0."""
    z = logits[:, list(label_ids)].double()
    top = z == z.max(1, keepdim=True).values  # [B, K]
    m = top.sum(1).double()
    own = top.gather(1, torch.as_tensor(labels, dtype=torch.long)[:, None])[:, 0].double() / m
    ref = top.gather(1, torch.as_tensor(ref_labels, dtype=torch.long)[:, None])[:, 0].double() / m
    return own.cpu().numpy(), ref.cpu().numpy()


def changed(logits: torch.Tensor, clean_logits: torch.Tensor, label_ids) -> np.ndarray:
    """Per row: 1 - P(argmax over the label words of `logits` == that of `clean_logits`), ties picked uniformly."""
    ids = list(label_ids)
    a, b = logits[:, ids].double(), clean_logits[:, ids].double()
    ta = (a == a.max(1, keepdim=True).values).double()  # [B, K] tied argmax sets
    tb = (b == b.max(1, keepdim=True).values).double()
    agree = (ta * tb).sum(1) / (ta.sum(1) * tb.sum(1))
    agree = torch.where((ta == tb).all(1), torch.ones_like(agree), agree)  # the same tie is no change
    return (1.0 - agree).cpu().numpy()


def correctness(ld) -> np.ndarray:
    """Per row: 1 where LD > 0, 1/2 on a tie, 0 below; NaN where the LD is NaN (no decision: every metric it
    enters is then undefined, as in `decisions`' K > 2 path, not a wrong answer)."""
    ld = np.asarray(ld, dtype=np.float64)
    return np.where(np.isnan(ld), np.nan, np.where(ld > 0, 1.0, np.where(ld == 0, 0.5, 0.0)))


def _finite(x):
    return None if x is None or not math.isfinite(x) else float(x)


def summarize(ld_patched, ld_clean, ld_ref, labels, ref_labels, groups, n_boot: int = 1000, seed: int = 0,
              correct=None, follow=None, changed=None) -> dict:
    """All metrics of one intervention; see the module doc. Arrays are per row [B].

    `correct`, `follow` (K > 2 label words, from `decisions`): per-row decision scores; default (binary) derived
    from the LD. `changed` (from `changed`): per-row; default (binary) from the signs of LD patched and clean."""
    ld_p = np.asarray(ld_patched, dtype=np.float64)
    ld_c = np.asarray(ld_clean, dtype=np.float64)
    ld_r = np.asarray(ld_ref, dtype=np.float64)
    y = np.asarray(labels)
    r = np.asarray(ref_labels)
    groups = np.asarray(groups)
    n = len(ld_p)
    if not (len(ld_c) == len(ld_r) == len(y) == len(r) == len(groups) == n) or n == 0:
        raise ValueError("summarize needs non-empty per-row arrays of equal length")
    acc = correctness(ld_p) if correct is None else np.asarray(correct, dtype=np.float64)
    fmask = (r != y).astype(np.float64)
    flip = ((1.0 - acc) if follow is None else np.asarray(follow, dtype=np.float64)) * fmask
    if changed is None:  # binary: the decision is the sign of LD (a tie is a coin flip on either side)
        acc_c = correctness(ld_c)
        changed = np.where(np.sign(ld_p) == np.sign(ld_c), 0.0, acc * (1 - acc_c) + (1 - acc) * acc_c)
    chg = np.asarray(changed, dtype=np.float64)
    dp, dr = ld_p - ld_c, ld_r - ld_c

    boot = ClusterBootstrap(groups, n_boot, seed)
    sums = {k: boot.sums(v) for k, v in {"ld": ld_p, "acc": acc, "flip": flip, "nflip": fmask, "chg": chg, "dp": dp, "dr": dr,
                                         "n": np.ones(n)}.items()}

    def stats(s):
        with np.errstate(divide="ignore", invalid="ignore"):
            return {"ld_mean": s["ld"] / s["n"], "accuracy": s["acc"] / s["n"], "follows_donor_rate": s["flip"] / s["nflip"],
                    "changed_rate": s["chg"] / s["n"],
                    "normalized_effect": (s["dp"] / s["n"]) / (s["dr"] / s["n"])}

    point = stats({k: v[0] for k, v in sums.items()})
    reps = stats({k: v[1] for k, v in sums.items()})
    out = {"n": int(n), "n_groups": boot.n_groups, "n_donor_rows": int(fmask.sum()), "follows_donor": float(flip.sum()),
           "changed": float(chg.sum()),
           "ld_clean_mean": float(ld_c.mean()), "ld_ref_mean": float(ld_r.mean())}
    # the groups holding a rate's own rows (the follows-donor rate's: the rows whose donor has another label): one
    # group has no interval (stats.bootstrap), whatever the number of groups overall
    n_groups = {k: boot.n_groups for k in point}
    n_groups["follows_donor_rate"] = len(np.unique(groups[fmask > 0]))
    for k, v in point.items():
        out[k] = _finite(float(v))
        ci = percentile_ci(reps[k]) if math.isfinite(float(v)) and n_groups[k] >= 2 else None  # stats.bootstrap
        out[k + "_ci"] = None if ci is None else list(ci)
    return out
