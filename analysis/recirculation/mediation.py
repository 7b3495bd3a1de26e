"""(f) Mediation: recirculation only within the task-state subspace (the probe's direction at the source
depth), only in its complement, or in a random subspace of equal rank; label logit difference on held-out groups.
The subspace routine is the interventions' (interventions.subspace.orthonormal), the probe the probes' own."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from analysis.recirculation.text import ByteTokenizer
from common.cli import derived_seed
from common.errors import UserError
from engine.prefill import pad_left, prefill
from engine.recirculation import RecirculatedLM
from interventions.subspace import orthonormal
from stats.linear import LinearProbe
from tasks import label_token_ids, make_dataset, tokenize_samples


def mediation(model, tok, specs, task: str, n_pairs: int, n_distractors: int, batch: int, seed: int) -> dict:
    """(f): recirculate the task-state subspace vs its complement vs a random subspace of equal rank.

    With several candidate `specs`, the one whose full recirculation changes the label logit difference most
    (mean |change|) on the TRAINING groups is used; every reported number is on the held-out groups.
    """

    if isinstance(tok, ByteTokenizer):
        raise UserError("--mediation needs a real tokenizer (not the byte stand-in of the tiny random models)")
    samples = make_dataset(task, n_pairs=n_pairs, n_distractors=n_distractors, seed=seed)
    ids, samples = tokenize_samples(samples, tok)
    lab = label_token_ids(tok, task)
    y = np.array([smp.label for smp in samples])
    groups = np.array([smp.group_id for smp in samples])
    ug = np.unique(groups)
    rng = np.random.default_rng(seed)
    test_groups = set(rng.permutation(ug)[: len(ug) // 2].tolist())
    te = np.array([g in test_groups for g in groups])
    if te.all() or not te.any():
        raise UserError("--mediation-pairs too small: need at least 2 groups")

    def run(spec_or_none, rows):
        # Residuals are only read from the base model (probe fit / probe test accuracy): the recirculated runs,
        # 2 x pairs x modes of them when tuning, skip collecting them.
        collect = spec_or_none is None
        lds, resids = [], []
        for i in range(0, len(rows), batch):
            x, m = pad_left([ids[j] for j in rows[i:i + batch]])
            if collect:
                r = prefill(model, x, m, "standard", collect=True)
                resids.append(r.resid[:, -1])
            else:
                r = RecirculatedLM(model, spec_or_none, bypass_identity=False).prefill(
                    x, m, cols=torch.tensor([x.shape[1] - 1]), collect=False)
            lg = r.logits[:, -1].float()  # numpy has no bfloat16
            lds.append(lg[:, lab[1]] - lg[:, lab[0]])
        # LD(label 1 - label 0) [n]; base only: resid [n, L+1, D]
        return torch.cat(lds).numpy(), (torch.cat(resids) if collect else None)

    train_rows = np.where(~te)[0].tolist()
    test_rows = np.where(te)[0].tolist()
    base_tr, resid_tr = run(None, train_rows)
    tuning = []
    if len(specs) > 1:
        for sp in specs:
            ld_tr, _ = run(sp, train_rows)
            tuning.append({"config": sp.name, "train_mean_abs_ld_change": float(np.abs(ld_tr - base_tr).mean())})
            print(f"[f] tune {sp.name:28s} train mean |LD change| {tuning[-1]['train_mean_abs_ld_change']:.4f}",
                  flush=True)
        spec = specs[int(np.argmax([t["train_mean_abs_ld_change"] for t in tuning]))]
    else:
        spec = specs[0]
    X = resid_tr[:, spec.source].double().numpy()
    probe = LinearProbe().fit(X, y[~te], groups[~te])
    u = torch.tensor(np.asarray(probe.direction), dtype=torch.float32)[:, None]  # [D, 1]
    D = u.shape[0]
    rnd = torch.randn(1, D, generator=torch.Generator().manual_seed(derived_seed(seed, 3))).T  # [D, 1]
    conds = {"base": None, "full": spec,
             "task_subspace": dataclasses.replace(spec, subspace=orthonormal(u)),
             "complement": dataclasses.replace(spec, subspace=orthonormal(u), subspace_complement=True),
             "random_subspace": dataclasses.replace(spec, subspace=orthonormal(rnd))}
    ysign = np.where(y[te] == 1, 1.0, -1.0)
    out = {"task": task, "n_pairs": n_pairs, "n_distractors": n_distractors, "rank": 1,
           "probe_depth": spec.source, "n_test": int(te.sum()), "n_train": int((~te).sum()),
           "probe_train_accuracy": probe.score(X, y[~te]), "config": spec.name, "tuning": tuning, "conditions": {}}
    base_ld = None
    for name, sp in conds.items():
        ld, resid_te = run(sp, test_rows)
        ld_true = ysign * ld  # logit(true) - logit(other)
        if name == "base":
            base_ld = ld_true
            out["probe_test_accuracy"] = probe.score(resid_te[:, spec.source].double().numpy(), y[te])
        d = ld_true - base_ld
        out["conditions"][name] = {"mean_ld": float(ld_true.mean()), "accuracy": float((ld_true > 0).mean()),
                                   "mean_ld_change": float(d.mean()),
                                   "ld_change_se": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0}
        print(f"[f] {name:16s} LD {ld_true.mean():+.3f} (change {d.mean():+.4f}) acc {(ld_true > 0).mean():.3f}",
              flush=True)
    return out
