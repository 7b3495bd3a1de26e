"""(f) Mediation: recirculation only within the task-state subspace (the probe's subspace at the source depth),
only in its complement, or in a random subspace of equal rank; label logit difference on held-out groups.
The subspace routine is the interventions' (interventions.subspace.orthonormal), the probe the probes' own.

Label logit difference LD_true = logit(true label word) - logit(the paired sample's label word) (the pair partner
is the other sample with the same pair_id). Binary tasks: that is logit(true) - logit(other), and the subspace is
the probe's unit direction (rank 1), exactly as before K > 2 tasks were supported. The language tasks (one class
per word: too many for grouped CV) fit the pair role instead (tasks.probe_labels), a binary probe: their task
subspace is its one direction (rank 1), not the span of the label words. K > 2 label words (shell_game, s5, a5):
the probe is multinomial and the task subspace is the orthonormalized span of its
class-centred class weight vectors (W_k / scale in the raw input space, k = 1..K, minus their mean): a softmax
reads only differences of class weights, so that span is the whole of what the probe reads, of rank
min(K' - 1, D) with K' the classes present in the training groups (K' = K unless the pairs are too few to show
every label; lower only if the weights are degenerate; `rank` reports the rank used). The complement has rank
D - rank, the random subspace the task subspace's rank. Accuracy: binary LD_true > 0, a tie counting 1/2; K > 2 the
argmax over the K label words at the last position, an m-way tie counting 1/m (interventions.metrics, the rule
of every causal report). The
s.e. of a mean LD change is clustered by group (`clustered_se`): a group's samples are not independent."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from analysis.recirculation.text import ByteTokenizer
from common.cli import derived_seed
from common.errors import UserError
from engine.prefill import pad_left, prefill
from engine.recirculation import RecirculatedLM
from interventions.metrics import correctness, decisions
from interventions.subspace import orthonormal
from stats.linear import LinearProbe, ProbeConfig
from tasks import TaskSource, probe_labels, resolve_task
from tasks.samples import ANSWER_PROBE_LABEL


def clustered_se(d: np.ndarray, groups: np.ndarray) -> float | None:
    """Standard error of the mean of `d`, clustered by group (the samples of a group are not independent: completion
    has 10 groups however many pairs); None for fewer than 2 groups. sqrt(G / (G - 1) * sum_g S_g^2) / n, S_g the
    group's sum of deviations from the mean (the sandwich estimator of a mean with the usual small-G factor)."""
    ug, inv = np.unique(groups, return_inverse=True)
    if len(ug) < 2:
        return None
    sums = np.bincount(inv, weights=d - d.mean())
    return float(np.sqrt(len(ug) / (len(ug) - 1) * np.sum(sums ** 2)) / len(d))


def mediation_inputs(tok, task, n_pairs: int, n_distractors: int, seed: int):
    """(task source, samples, token ids, label token ids) of (f)'s dataset; the task's and the tokenizer's refusals
    (label words that share a first token, ...) come from here, so the CLI runs it before any experiment."""
    src = task if isinstance(task, TaskSource) else resolve_task(task)  # a built-in name, a file, module:function
    samples = src.make(n_pairs, n_distractors, seed)
    ids, samples = src.tokenize(samples, tok)
    lab = src.label_token_ids(tok, prompt=None if src.builtin else samples[0].text)
    pair_partner_labels(samples)  # pairs are pairs
    return src, samples, ids, lab


def mediation(model, tok, specs, task, n_pairs: int, n_distractors: int, batch: int, seed: int,
              inputs=None) -> dict:
    """(f): recirculate the task-state subspace vs its complement vs a random subspace of equal rank.

    With several candidate `specs`, the one whose full recirculation changes the label logit difference most
    (mean |change|) on the TRAINING groups is used; every reported number is on the held-out groups.
    """

    if isinstance(tok, ByteTokenizer):
        raise UserError("--mediation needs a real tokenizer (not the byte stand-in of the tiny random models)")
    # `inputs`: mediation_inputs' result for these arguments, made once by the CLI's early check (a user's
    # module:function task runs once)
    src, samples, ids, lab = inputs or mediation_inputs(tok, task, n_pairs, n_distractors, seed)
    task = src.name
    K = len(lab)
    y = np.array([smp.label for smp in samples])
    other = pair_partner_labels(samples)  # the paired sample's label (binary: 1 - y)
    # What the probe fits: the labels, or each sample's role in its pair where one class per word is too many
    # for grouped CV (the language tasks; tasks.probe_labels, as probes.run and interventions.run choose)
    try:
        py_list, probe_label = probe_labels(samples, ProbeConfig().n_splits)
    except UserError:  # too few groups for 5 grouped folds: the probe below needs no outer folds
        py_list, probe_label = y, ANSWER_PROBE_LABEL
    py = np.asarray(py_list)
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
        zs, resids = [], []
        for i in range(0, len(rows), batch):
            x, m = pad_left([ids[j] for j in rows[i:i + batch]])
            if collect:
                r = prefill(model, x, m, "standard", collect=True)
                resids.append(r.resid[:, -1])
            else:
                r = RecirculatedLM(model, spec_or_none, bypass_identity=False).prefill(
                    x, m, cols=torch.tensor([x.shape[1] - 1]), collect=False)
            lg = r.logits[:, -1].float()  # numpy has no bfloat16
            zs.append(lg[:, lab])
        z = torch.cat(zs)  # label-word logits [n, K]
        if K == 2:  # LD(label 1 - label 0) [n], float32 (the binary numbers of before, bit for bit)
            ld = (z[:, 1] - z[:, 0]).numpy()
        else:  # LD_true = logit(true) - logit(pair partner's label) [n], float32
            ix = torch.as_tensor(rows, dtype=torch.long)
            yt, ot = torch.as_tensor(y[ix], dtype=torch.long), torch.as_tensor(other[ix], dtype=torch.long)
            ld = (z.gather(1, yt[:, None])[:, 0] - z.gather(1, ot[:, None])[:, 0]).numpy()
        # base only: resid [n, L+1, D]
        return ld, z, (torch.cat(resids) if collect else None)

    train_rows = np.where(~te)[0].tolist()
    test_rows = np.where(te)[0].tolist()
    base_tr, _, resid_tr = run(None, train_rows)
    tuning = []
    if len(specs) > 1:
        for sp in specs:
            ld_tr, _, _ = run(sp, train_rows)
            tuning.append({"config": sp.name, "train_mean_abs_ld_change": float(np.abs(ld_tr - base_tr).mean())})
            print(f"[f] tune {sp.name:28s} train mean |LD change| {tuning[-1]['train_mean_abs_ld_change']:.4f}",
                  flush=True)
        spec = specs[int(np.argmax([t["train_mean_abs_ld_change"] for t in tuning]))]
    else:
        spec = specs[0]
    X = resid_tr[:, spec.source].double().numpy()
    try:
        probe = LinearProbe().fit(X, py[~te], groups[~te])
    except ValueError as e:  # e.g. the inner grouped CV with fewer samples of a class than folds (K > 2)
        raise UserError(f"the mediation probe cannot be fitted on {len(X)} training samples of "
                        f"{len(np.unique(py[~te]))} classes ({e}): raise --mediation-pairs") from None
    u = probe_subspace(probe)  # [D, rank]
    D, rank = u.shape
    rnd = torch.randn(rank, D, generator=torch.Generator().manual_seed(derived_seed(seed, 3))).T  # [D, rank]
    conds = {"base": None, "full": spec,
             "task_subspace": dataclasses.replace(spec, subspace=orthonormal(u)),
             "complement": dataclasses.replace(spec, subspace=orthonormal(u), subspace_complement=True),
             "random_subspace": dataclasses.replace(spec, subspace=orthonormal(rnd))}
    ranks = {"task_subspace": int(conds["task_subspace"].subspace.shape[1]),
             "complement": D - int(conds["complement"].subspace.shape[1]),
             "random_subspace": int(conds["random_subspace"].subspace.shape[1])}
    ysign = np.where(y[te] == 1, 1.0, -1.0)
    out = {"task": task, "n_pairs": n_pairs, "n_distractors": n_distractors, "n_classes": K, "rank": rank,
           "subspace_ranks": ranks, "probe_depth": spec.source, "n_test": int(te.sum()),
           "n_test_groups": len(test_groups),
           "n_train": int((~te).sum()), "probe_label": probe_label,
           "probe_train_accuracy": probe.score(X, py[~te]), "config": spec.name,
           "tuning": tuning, "conditions": {}}
    base_ld = None
    for name, sp in conds.items():
        ld, z, resid_te = run(sp, test_rows)
        # logit(true) - logit(the pair partner's label); binary: the sign flip of before
        ld_true = ysign * ld if K == 2 else ld.astype(np.float64)
        if name == "base":
            base_ld = ld_true
            out["probe_test_accuracy"] = probe.score(resid_te[:, spec.source].double().numpy(), py[te])
        d = ld_true - base_ld
        acc = float(correctness(ld_true).mean()) if K == 2 else float(decisions(z, y[te], y[te], range(K))[0].mean())
        out["conditions"][name] = {"mean_ld": float(ld_true.mean()), "accuracy": acc,
                                   "mean_ld_change": float(d.mean()),
                                   "ld_change_se": clustered_se(d, groups[test_rows])}
        print(f"[f] {name:16s} LD {ld_true.mean():+.3f} (change {d.mean():+.4f}) acc {acc:.3f}", flush=True)
    base_acc = out["conditions"]["base"]["accuracy"]
    if base_acc < SOLVES:  # interventions.report's rule: with no answer to move, no change measures use
        out["note"] = (f"inconclusive: the model does not solve {task} (base accuracy {base_acc:.2f} < {SOLVES}), so "
                       "its LD changes say nothing about whether the recirculated state is used")
        print(f"[f] note: {out['note']}", flush=True)
    return out


SOLVES = 0.6  # the clean accuracy below which a causal verdict is "inconclusive" (interventions.report)


def pair_partner_labels(samples) -> np.ndarray:
    """Per sample, the label of the other sample with the same pair_id (UserError unless pairs are pairs)."""
    by_pair: dict = {}
    for i, smp in enumerate(samples):
        by_pair.setdefault(smp.pair_id, []).append(i)
    other = np.empty(len(samples), dtype=np.int64)
    for pid, rows in by_pair.items():
        if len(rows) != 2:
            raise UserError(f"pair {pid} has {len(rows)} samples, not 2: the label logit difference needs the "
                            "paired sample's label")
        a, b = rows
        other[a], other[b] = samples[b].label, samples[a].label
    return other


def probe_subspace(probe: LinearProbe) -> torch.Tensor:
    """Orthonormal basis [D, rank] of what a fitted probe reads, in the raw input space (float32).

    Binary: its unit direction (rank 1). K > 2: the span of the class-centred class weight vectors W_k / scale,
    rank min(K - 1, D) for the K classes it was fitted on (singular values below 1e-8 of the largest are dropped:
    degenerate weights)."""
    if len(probe.classes_) == 2:
        return torch.tensor(np.asarray(probe.direction), dtype=torch.float32)[:, None]  # [D, 1]
    W = probe.clf_.coef_ / probe.scaler_.scale_  # [K, D]
    W = W - W.mean(0, keepdims=True)
    _, S, Vt = np.linalg.svd(W, full_matrices=False)
    keep = S > 1e-8 * S.max() if S.size and S.max() > 0 else np.zeros(len(S), dtype=bool)
    if not keep.any():
        raise UserError("the mediation probe found no direction (constant states at the source depth?)")
    return torch.tensor(Vt[keep].T.copy(), dtype=torch.float32)  # [D, rank]
