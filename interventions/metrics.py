"""Intervention metrics with cluster-bootstrap 95% CIs (SPEC section 5).

For row i with true label y_i, reference (donor) label r_i and label-word logits z:
    LD_i        = z[y_i] - z[1 - y_i]                    label logit difference at T
    correct_i   = 1 if LD_i > 0, 1/2 if LD_i == 0, 0 otherwise   (binary decision between the two label words;
                                                                   an exact tie is a coin flip)
    flip_i      = 1 - correct_i, over rows whose reference label differs from their own (r_i != y_i): the
                  prediction follows the donor's label. Rows with a same-label donor (possible under
                  resampling) are left out of the flip rate; `n_flip` counts the rows used.
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


def label_ld(logits: torch.Tensor, labels, label_ids) -> np.ndarray:
    """LD = logit(label word of `labels`) - logit(the other label word), per row. logits [B, V]."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    z = logits[:, list(label_ids)].double()  # [B, 2]
    true = z.gather(1, labels[:, None])[:, 0]
    other = z.gather(1, (1 - labels)[:, None])[:, 0]
    return (true - other).cpu().numpy()


def correctness(ld) -> np.ndarray:
    ld = np.asarray(ld, dtype=np.float64)
    return np.where(ld > 0, 1.0, np.where(ld == 0, 0.5, 0.0))


def _finite(x):
    return None if x is None or not math.isfinite(x) else float(x)


def summarize(ld_patched, ld_clean, ld_ref, labels, ref_labels, groups, n_boot: int = 1000, seed: int = 0) -> dict:
    """All metrics of one intervention; see the module doc. Arrays are per row [B]."""
    ld_p = np.asarray(ld_patched, dtype=np.float64)
    ld_c = np.asarray(ld_clean, dtype=np.float64)
    ld_r = np.asarray(ld_ref, dtype=np.float64)
    y = np.asarray(labels)
    r = np.asarray(ref_labels)
    groups = np.asarray(groups)
    n = len(ld_p)
    if not (len(ld_c) == len(ld_r) == len(y) == len(r) == len(groups) == n) or n == 0:
        raise ValueError("summarize needs non-empty per-row arrays of equal length")
    acc = correctness(ld_p)
    fmask = (r != y).astype(np.float64)
    flip = (1.0 - acc) * fmask
    dp, dr = ld_p - ld_c, ld_r - ld_c

    uniq, inv = np.unique(groups, return_inverse=True)
    G = len(uniq)

    def gsum(v):
        return np.bincount(inv, weights=v, minlength=G)

    cols = {"ld": gsum(ld_p), "acc": gsum(acc), "flip": gsum(flip), "nflip": gsum(fmask), "dp": gsum(dp),
            "dr": gsum(dr), "n": np.bincount(inv, minlength=G).astype(np.float64)}

    def stats(s):
        with np.errstate(divide="ignore", invalid="ignore"):
            return {"ld_mean": s["ld"] / s["n"], "accuracy": s["acc"] / s["n"], "flip_rate": s["flip"] / s["nflip"],
                    "normalized_effect": (s["dp"] / s["n"]) / (s["dr"] / s["n"])}

    point = stats({k: v.sum() for k, v in cols.items()})
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, G, size=(n_boot, G))
    boot = stats({k: v[draws].sum(1) for k, v in cols.items()})
    out = {"n": int(n), "n_groups": int(G), "n_flip": int(fmask.sum()),
           "ld_clean_mean": float(ld_c.mean()), "ld_ref_mean": float(ld_r.mean())}
    for k, v in point.items():
        b = boot[k][np.isfinite(boot[k])]
        out[k] = _finite(float(v))
        if len(b) and math.isfinite(float(v)):
            lo, hi = np.percentile(b, [2.5, 97.5])
            out[k + "_ci"] = [float(lo), float(hi)]
        else:
            out[k + "_ci"] = None
    return out
