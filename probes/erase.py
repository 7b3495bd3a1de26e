"""`probes.run --erase DEPTH`: the depth curve after LEACE erasure of the label at (DEPTH, T) (docs/methods.md).

The erasers are fitted per outer grouped fold (stats.erasure); the model runs on the erased residual through the
mode's patcher (engine.patching, `erased_depth_acts`), and the probe and the logit lens read every depth >= DEPTH
of the run.
"""
from __future__ import annotations

import numpy as np
import torch

from stats.erasure import FoldErasers, grouped_folds, heldout_accuracy, package_version
from stats.linear import ProbeConfig


def erase_meta(depth: int) -> dict:
    """probes.json meta.erase for --erase DEPTH."""
    return {"depth": int(depth), "position": "T",
            "method": "LEACE (Belrose et al. 2023), concept-erasure " + (package_version() or "?") +
                      ", float64, constrain_cov_trace=False",
            "protocol": "per outer grouped fold f: the eraser fitted on f's training rows' residual at (depth, T) "
                        "erases every row there, the model runs on (engine.patching patch, depths > depth "
                        "recomputed from the erased value and the unchanged context); a probe fitted on f's "
                        "erased training rows is scored on its erased held-out rows (pooled over folds). At depth "
                        "itself that probe is at chance by the guarantee; above it, accuracy is what the model "
                        "recomputes. The lens reads each row as erased by the fold that held it out."}


def erased_depth_rows(model, token_ids, samples, label_ids, mode: str, depth: int, acts: np.ndarray,
                      config: ProbeConfig, batch_pairs: int = 16, pad_id: int = 0, y=None) -> list[dict]:
    """probes.run --erase: probe accuracy and logit lens per depth >= `depth` after LEACE at (depth, T).

    `acts` [n, L+1, D]: the clean activations at T (the collector's). `y` [n]: what the probes fit and LEACE
    erases, the clean depth curve's labels (tasks.probe_labels: the answers, default, or the pair roles where
    the answers have too many classes for grouped CV); the lens reads the answers either way."""
    from probes.lens import LENS_FIELDS, depth_lens

    answers = np.array([s.label for s in samples])
    y = answers if y is None else np.asarray(y)
    groups = np.array([s.group_id for s in samples])
    # classes are indices 0..K-1 (label words, or the pair roles): the largest one present sets K, whether or not
    # every class below it is among these samples (a class absent here is an all-zero column of the one-hot)
    K = max(2, int(y.max()) + 1)
    folds = grouped_folds(y, groups, config)
    per_fold, _ = erased_depth_acts(model, token_ids, samples, mode, depth, acts[:, depth], folds, K, batch_pairs,
                                    pad_id, y=y)
    held = np.array(acts, dtype=np.float32, copy=True)  # each row as erased by the fold that holds it out
    for f, (_, te) in enumerate(folds):
        held[te, depth:] = per_fold[f][te, depth:]
    lens = [dict.fromkeys(LENS_FIELDS)] * (acts.shape[1] - depth) if label_ids is None else \
        depth_lens(model, held[:, depth:], answers, label_ids, groups, config.n_boot, config.random_state)
    rows = []
    for j, d in enumerate(range(depth, acts.shape[1])):
        acc = heldout_accuracy(lambda f: per_fold[f][:, d], lambda f: per_fold[f][:, d], y, groups, folds, config)
        ci = acc["ci"] or [None, None]
        rows.append({"erased_at": int(depth), "depth": int(d), "accuracy": acc["accuracy"],
                     "accuracy_std": float(np.std(acc["fold_accuracies"])), "ci_low": ci[0], "ci_high": ci[1],
                     "fold_accuracies": acc["fold_accuracies"], "n_samples": int(len(y)),
                     "n_groups": int(len(np.unique(groups))), **lens[j]})
    return rows


@torch.no_grad()
def erased_depth_acts(model, token_ids, samples, mode: str, depth: int, clean_at_depth: np.ndarray, folds,
                      n_classes: int, batch_pairs: int = 16, pad_id: int = 0,
                      y=None) -> tuple[list[np.ndarray], FoldErasers]:
    """Per fold f, activations [n, L+1, D] at T of every row with the residual at (depth, T) replaced by fold f's
    LEACE-erased value (depths < depth: zeros, not recomputed).

    `clean_at_depth` [n, D]: the clean residual at (depth, T) (the collector's), on which the erasers are fitted
    (training rows of each fold). Rows run in batches of whole pairs, sorted by length (little padding)."""
    from engine.inputs import eval_mode
    from engine.modes import parse_mode
    from engine.patching import Patch, patcher, record_at_T
    from engine.prefill import pad_left

    m = parse_mode(mode, model.n_layers)
    n = len(samples)
    y = np.array([s.label for s in samples]) if y is None else np.asarray(y)  # the concept erased
    X = torch.from_numpy(np.asarray(clean_at_depth, dtype=np.float32))
    fe = FoldErasers(X, y, folds, n_classes)
    members: dict = {}
    for i, s in enumerate(samples):
        members.setdefault(s.pair_id, []).append(i)
    pairs = sorted(members.values(), key=lambda g: (max(len(token_ids[i]) for i in g), g))
    out = [np.zeros((n, m.depth(model) + 1, model.d_model), dtype=np.float32) for _ in folds]
    w = next(model.parameters())
    for s in range(0, len(pairs), batch_pairs):
        rows = [i for g in pairs[s:s + batch_pairs] for i in g]
        ids, mask = pad_left([token_ids[r] for r in rows], pad_id)
        with eval_mode(model):  # the caller's model keeps its own mode afterwards
            run = patcher(m, model, ids.to(w.device), mask.to(w.device))
            for f in range(len(folds)):
                patch = [Patch("resid", fe.by_fold(X[rows], f).to(w.device, w.dtype), depth=depth, pos=-1)]
                _, resid = record_at_T(run, lambda: run.run(patch), patch)
                out[f][rows, depth:] = resid[:, depth:].float().cpu().numpy()
    return out, fe
