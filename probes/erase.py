"""`probes.run --erase DEPTH`: the depth curve after LEACE erasure of the label at (DEPTH, T) (docs/methods.md).

The erasers are fitted per outer grouped fold (stats.erasure); the model runs on the erased residual through the
intervention runner (interventions.erasure.erased_depth_acts), and the probe and the logit lens read every depth
>= DEPTH of the run.
"""
from __future__ import annotations

import numpy as np

from stats.erasure import grouped_folds, heldout_accuracy, package_version
from stats.linear import ProbeConfig


def erase_meta(depth: int) -> dict:
    """probes.json meta.erase for --erase DEPTH."""
    return {"depth": int(depth), "position": "T",
            "method": "LEACE (Belrose et al. 2023), concept-erasure " + (package_version() or "?") +
                      ", float64, constrain_cov_trace=False",
            "protocol": "per outer grouped fold f: the eraser fitted on f's training rows' residual at (depth, T) "
                        "erases every row there, the model runs on (interventions.core patch, depths > depth "
                        "recomputed from the erased value and the unchanged context); a probe fitted on f's "
                        "erased training rows is scored on its erased held-out rows (pooled over folds). At depth "
                        "itself that probe is at chance by the guarantee; above it, accuracy is what the model "
                        "recomputes. The lens reads each row as erased by the fold that held it out."}


def erased_depth_rows(model, token_ids, samples, label_ids, mode: str, depth: int, acts: np.ndarray,
                      config: ProbeConfig, batch_pairs: int = 16, pad_id: int = 0) -> list[dict]:
    """probes.run --erase: probe accuracy and logit lens per depth >= `depth` after LEACE at (depth, T).

    `acts` [n, L+1, D]: the clean activations at T (the collector's)."""
    from interventions.erasure import erased_depth_acts
    from probes.lens import LENS_FIELDS, depth_lens

    y = np.array([s.label for s in samples])
    groups = np.array([s.group_id for s in samples])
    K = len(np.unique(y)) if label_ids is None else len(label_ids)
    folds = grouped_folds(y, groups, config)
    # label_ids None (no lens): the Batch's label ids only serve metrics, unused here
    per_fold, _ = erased_depth_acts(model, token_ids, samples, tuple(range(K)) if label_ids is None else label_ids,
                                    mode, depth, acts[:, depth], folds, K, batch_pairs, pad_id)
    held = np.array(acts, dtype=np.float32, copy=True)  # each row as erased by the fold that holds it out
    for f, (_, te) in enumerate(folds):
        held[te, depth:] = per_fold[f][te, depth:]
    lens = [dict.fromkeys(LENS_FIELDS)] * (acts.shape[1] - depth) if label_ids is None else \
        depth_lens(model, held[:, depth:], y, label_ids, groups, config.n_boot, config.random_state)
    rows = []
    for j, d in enumerate(range(depth, acts.shape[1])):
        acc = heldout_accuracy(lambda f: per_fold[f][:, d], lambda f: per_fold[f][:, d], y, groups, folds, config)
        ci = acc["ci"] or [None, None]
        rows.append({"erased_at": int(depth), "depth": int(d), "accuracy": acc["accuracy"],
                     "accuracy_std": float(np.std(acc["fold_accuracies"])), "ci_low": ci[0], "ci_high": ci[1],
                     "fold_accuracies": acc["fold_accuracies"], "n_samples": int(len(y)),
                     "n_groups": int(len(np.unique(groups))), **lens[j]})
    return rows
