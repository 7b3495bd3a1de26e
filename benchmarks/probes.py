"""Benchmark: the probe solver (row-space logistic regression) against scikit-learn's lbfgs and newton-cholesky.

    python benchmarks/probes.py [--depths 8] [--d-model 576] [--n-pairs 48] [--classes 2] [--tight-tol 1e-8]
                                [--threads 1]

Synthetic activations shaped like SmolLM2-135M's (576 dims, 96 samples in 48 pair groups, the label linearly
present at half the depths). The problems are exactly the fits ``grouped_cv_scores`` runs for them with the
default ``ProbeConfig``: every inner-CV training fold of every outer fold, and every outer training fold, each
standardized on its own training rows, at every C of ``Cs``. Each solver fits the same problems (same data,
same C, same objective: unweighted for 2 classes, ``class_weight="balanced"`` for K > 2) through the
scikit-learn estimator API; reported side by side: total fit time and the ratio to ours, the held-out accuracy
agreement with ours (problems whose held-out accuracy differs, largest difference), and how far each solution's
objective lies above the lowest of them (relative). Each scikit-learn solver runs twice: at its default
``tol`` (what a caller gets) and at ``--tight-tol`` (ours stops at 1e-8; the criteria differ, the objective
excess shows the precision actually reached). Then one end-to-end ``grouped_cv_scores`` run for scale.
Exit 1 if a tight-tolerance solver's pooled held-out accuracy differs from ours. Last line: one JSON object.
(``--classes 3`` takes minutes: newton-cholesky builds a (K d)^2 Hessian.)
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cli import Parser, add_threads_flag, float_in, int_in  # noqa: E402
from common.errors import cli_entry  # noqa: E402


def _objective(clf, X, y, C, classes, balanced):
    """sklearn's L2 logistic objective of a fitted linear classifier: 0.5 ||W||^2 + C * sum_i w_i * loss_i."""
    import numpy as np
    from scipy.special import log_softmax

    dec = X @ clf.coef_.T + clf.intercept_
    if len(classes) == 2:
        t = np.where(y == classes[1], 1.0, -1.0)
        loss = np.logaddexp(0.0, -t * dec[:, 0])
        pen = 0.5 * float(np.sum(clf.coef_ ** 2))
    else:
        loss = -log_softmax(dec, axis=1)[np.arange(len(y)), np.searchsorted(classes, y)]
        pen = 0.5 * float(np.sum(clf.coef_ ** 2))
    w = np.ones(len(y))
    if balanced:
        counts = np.array([np.sum(y == c) for c in classes])
        w = (len(y) / (len(classes) * counts))[np.searchsorted(classes, y)]
    return pen + C * float(np.sum(w * loss))


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python benchmarks/probes.py", description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=int_in(1, 1000), default=8,
                   help="depths, 1..1000 (SmolLM2 has 31; time scales linearly) (default 8)")
    p.add_argument("--d-model", type=int_in(2, 100_000), default=576,
                   help="width of the random activations, 2..100000 and at least --classes (default 576, SmolLM2's)")
    p.add_argument("--n-pairs", type=int_in(10, 5000), default=48,
                   help="sample pairs (2 rows each, one group), 10..5000 (default 48)")
    p.add_argument("--classes", type=int_in(2, 100), default=2,
                   help="label classes, 2..100 (3: shell_game-like pairs) (default 2)")
    p.add_argument("--tight-tol", type=float_in(0, 1, lo_open=True, hi_open=True), default=1e-8,
                   help="tol of the tight scikit-learn runs, in (0, 1) (default 1e-8)")
    add_threads_flag(p, 1, "; here the BLAS / OpenMP pools of the scikit-learn fits (threadpoolctl; 0: no limit)")
    a = p.parse_args(argv)
    if a.d_model < a.classes:
        p.error(f"--d-model must be at least --classes ({a.classes}): one informative direction per class")

    import numpy as np
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits  # a scikit-learn dependency

    import stats.linear as lin
    from stats.estimator import RowSpaceLogisticRegression

    threadpool_limits(a.threads or None)
    rng = np.random.default_rng(0)
    k = a.classes
    # pairs of two different labels, one group each (binary: (0, 1); K classes: (c, c + 1 mod K) cycling)
    y = np.array([(p + j) % k for p in range(a.n_pairs) for j in (0, 1)])
    groups = np.repeat(np.arange(a.n_pairs), 2)
    lin.check_groups(y, groups, lin.ProbeConfig().n_splits)  # many --classes need more --n-pairs
    n = len(y)
    Xs = []
    for depth in range(a.depths):
        X = rng.normal(size=(n, a.d_model))
        if depth >= a.depths // 2:
            X[np.arange(n), y] += 1.6  # one informative direction per class (binary: 0.8 * (2y - 1) contrast)
        Xs.append(X)
    cfg = lin.ProbeConfig(n_boot=200)

    plan = lin._Plan(y, groups, cfg)  # the folds grouped_cv_scores uses
    problems = []
    for X in Xs:
        for tr, te, inner in plan.outer:
            for itr, ite in [(tr[i], tr[j]) for i, j in inner] + [(tr, te)]:
                sc = StandardScaler().fit(X[itr])
                for C in cfg.Cs:
                    problems.append((sc.transform(X[itr]), y[itr], sc.transform(X[ite]), y[ite], C))

    balanced = k > 2
    cw = "balanced" if balanced else None

    def sk(solver, **tol):
        return lambda C: LogisticRegression(C=C, solver=solver, max_iter=cfg.max_iter, class_weight=cw, **tol)

    solvers = {
        "ours": lambda C: RowSpaceLogisticRegression(C=C, max_iter=cfg.max_iter),
        "lbfgs": sk("lbfgs"),
        "lbfgs_tight": sk("lbfgs", tol=a.tight_tol),
        "newton_cholesky": sk("newton-cholesky"),
        "newton_cholesky_tight": sk("newton-cholesky", tol=a.tight_tol),
    }
    times, correct, objective, n_warn = {}, {}, {}, {}
    for name, make in solvers.items():
        ok, obj = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            t = time.perf_counter()
            fitted = [make(C).fit(Xtr, ytr) for Xtr, ytr, _, _, C in problems]
            times[name] = time.perf_counter() - t
        n_warn[name] = sum(issubclass(w.category, ConvergenceWarning) for w in caught)
        for clf, (Xtr, ytr, Xte, yte, C) in zip(fitted, problems):
            ok.append(int(np.sum(clf.predict(Xte) == yte)))
            obj.append(_objective(clf, Xtr, ytr, C, clf.classes_, balanced))
        correct[name], objective[name] = np.array(ok), np.array(obj)
    n_test = np.array([len(yte) for _, _, _, yte, _ in problems])
    best = np.min(np.stack(list(objective.values())), axis=0)

    t = time.perf_counter()
    lin.grouped_cv_scores(Xs, y, groups, cfg)
    t_cv = time.perf_counter() - t

    out = {"depths": a.depths, "d_model": a.d_model, "samples": n, "classes": k, "problems": len(problems),
           "tight_tol": a.tight_tol, "grouped_cv_scores_s": round(t_cv, 2), "solvers": {}}
    agree = True
    print(f"{len(problems)} fits ({a.depths} depths x {a.d_model} dims, {n} samples, {k} classes, Cs {list(cfg.Cs)}):")
    for name in solvers:
        diff = np.abs(correct[name] - correct["ours"]) / n_test
        gap = (objective[name] - best) / np.maximum(best, 1e-300)
        same_pooled = int(correct[name].sum()) == int(correct["ours"].sum())
        if name.endswith("_tight"):
            agree &= same_pooled
        out["solvers"][name] = {
            "fit_s": round(times[name], 3), "time_vs_ours": round(times[name] / times["ours"], 2),
            "heldout_correct": int(correct[name].sum()), "problems_differing": int(np.sum(diff > 0)),
            "max_heldout_accuracy_diff": round(float(diff.max()), 4), "max_objective_excess": float(gap.max()),
            "convergence_warnings": n_warn[name]}
        r = out["solvers"][name]
        print(f"  {name:22s} {times[name]:7.2f}s  x{r['time_vs_ours']:<6} held-out correct {r['heldout_correct']} "
              f"({r['problems_differing']} problems differ, max {r['max_heldout_accuracy_diff']}), objective "
              f"excess <= {r['max_objective_excess']:.1e}, {n_warn[name]} convergence warnings")
    print(f"  end to end: grouped_cv_scores on the {a.depths} depths {t_cv:.2f}s")
    out["tight_pooled_accuracy_agrees"] = bool(agree)
    print(json.dumps(out))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
