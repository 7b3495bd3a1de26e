"""Benchmark: grouped-CV probe scoring of a wide model's depths, row-space solve vs the full d-dim Newton solve.

    python benchmarks/probes.py [--depths 8] [--d-model 576] [--n-pairs 48] [--threads 1]

Synthetic activations shaped like SmolLM2-135M's (576 dims, 96 samples in 48 pair groups, the
label linearly present at half the depths), scored twice with the same ``ProbeConfig`` side by side: once as
shipped (``_BinaryLogReg.fit`` works in the row space of X when d > n) and once with that path switched off
(every fit solves the d-dimensional Newton system). Reports both wall times, their ratio and the largest
accuracy difference (must be 0: the two solve the same convex problem). Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=int, default=8, help="depths scored (SmolLM2 has 31; time scales linearly)")
    p.add_argument("--d-model", type=int, default=576)
    p.add_argument("--n-pairs", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads")
    a = p.parse_args(argv)

    import numpy as np

    import probes.linear as lin

    from threadpoolctl import threadpool_limits  # a scikit-learn dependency

    threadpool_limits(a.threads)
    rng = np.random.default_rng(0)
    n = 2 * a.n_pairs
    y = np.tile([0, 1], a.n_pairs)
    groups = np.repeat(np.arange(a.n_pairs), 2)
    Xs = []
    for depth in range(a.depths):
        X = rng.normal(size=(n, a.d_model))
        if depth >= a.depths // 2:
            X[:, :4] += 0.8 * (2 * y[:, None] - 1)
        Xs.append(X)
    cfg = lin.ProbeConfig(n_boot=200)

    def score():
        t = time.perf_counter()
        res = lin.grouped_cv_scores(Xs, y, groups, cfg)
        return time.perf_counter() - t, [r.accuracy for r in res]

    t_fast, acc_fast = score()
    shipped = lin._BinaryLogReg.fit
    lin._BinaryLogReg.fit = lambda self, X, y: (setattr(self, "classes_", np.unique(y)), self._fit(X, y))[1]
    try:
        t_full, acc_full = score()
    finally:
        lin._BinaryLogReg.fit = shipped
    out = {"depths": a.depths, "d_model": a.d_model, "samples": n, "row_space_s": round(t_fast, 2),
           "full_newton_s": round(t_full, 2), "speedup": round(t_full / t_fast, 2),
           "max_accuracy_diff": float(np.max(np.abs(np.array(acc_fast) - np.array(acc_full))))}
    print(f"{a.depths} depths x {a.d_model} dims, {n} samples: row-space {t_fast:.1f}s, full Newton {t_full:.1f}s "
          f"-> {out['speedup']}x; max accuracy difference {out['max_accuracy_diff']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
