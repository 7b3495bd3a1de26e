"""Which decodable direction of the fed state does the model read? The suite's probe subspace against the plain ones.

    python scripts/probe_direction.py --model checkpoints/tiny-fbt-track parity [--distractors 8] [--n-pairs 100]

The causal report's subspace swap interchanges the paired sample's fed state h_{T-1} along the suite's probe
subspace (interventions.subspace.fold_subspaces: a logistic regression on STANDARDIZED features, its direction
mapped back to the state's coordinates, coefficient / feature spread). On tiny-fbt-track's parity that swap
moves nothing while the whole swap flips 99%. This script asks whether that is a property of decoding or of the
probe: per outer grouped fold (the probes' folds; each direction fitted on the training groups, scored on the
held-out rows), it interchanges h_{T-1} at T along
    probe          the suite's probe subspace (rank K - 1)
    class means    the span of the class-mean differences (rank K - 1; binary: mean(y=1) - mean(y=0))
    raw logistic   binary tasks: a logistic regression on the raw state (scikit-learn's default C = 1)
and reports, pooled over folds, the share of rows whose answer follows the donor (rows whose donor has another
label; 95% cluster-bootstrap CI over groups), the energy fraction (share of the squared state difference
inside the subspace), and for the probe the share of its direction on the 10 coordinates of least spread. The last
line of stdout is one JSON object.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.cli import Parser, add_model_flag, add_seed_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402


def raw_logistic_basis(H: np.ndarray, y: np.ndarray) -> np.ndarray:
    from sklearn.linear_model import LogisticRegression

    w = LogisticRegression(max_iter=10_000).fit(H, y).coef_[0]
    return (w / np.linalg.norm(w))[:, None]


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python scripts/probe_direction.py", description=__doc__.splitlines()[0])
    add_model_flag(p, "tiny-fbt-track")
    p.add_argument("task", help="a built-in task with a fed state to read (e.g. parity, shell_game, memory)")
    p.add_argument("--distractors", type=int_in(0, 1024), default=8,
                   help="distractor / update lines N, 0..1024 (default 8)")
    p.add_argument("--n-pairs", type=int_in(10, 2000), default=100, help="sample pairs, 10..2000 (default 100)")
    p.add_argument("--mode", default="recurrent-full", help="a recurrent-K prefill mode (default recurrent-full)")
    add_seed_flag(p, "the dataset and the folds")
    add_threads_flag(p, 2)
    args = p.parse_args(argv)
    set_threads(args.threads)

    from engine.modes import parse_mode
    from interventions.batch import Batch
    from interventions.core import CausalContext
    from interventions.subspace import (FoldSubspace, class_mean_subspaces, energy_fraction, fold_subspaces,
                                        per_fold_states)
    from models.loading import load_model
    from models.tokenizers import resolve_tokenizer
    from stats.bootstrap import group_bootstrap_ci
    from stats.linear import ProbeConfig, check_groups
    from tasks import resolve_task

    mode = parse_mode(args.mode).name
    if not mode.startswith("recurrent-"):
        raise UserError(f"--mode {mode}: the fed state h_{{T-1}} is swapped under recurrent-K modes")
    src = resolve_task(args.task)
    model, tok, _ = load_model(args.model)
    if not model.has_fusion:
        raise UserError(f"{args.model} has no fusion module: no fed state")
    tok = resolve_tokenizer(model, tok, args.model, None)
    src.load()
    batch = Batch.from_samples(src.make(args.n_pairs, args.distractors, args.seed), tok, src)
    ctx = CausalContext(model, batch, modes=(mode,))
    H = ctx.h_prev  # [B, D] the fed state entering the fusion at T
    X = H.double().numpy()
    y, groups, pair = batch.labels.numpy(), np.asarray(batch.groups), batch.pair.numpy()
    label_ids = src.label_token_ids(tok)
    K = len(label_ids)
    config = ProbeConfig(random_state=args.seed)
    # the report's subspace swaps (interventions.suite.Suite.subspace): each held-out row patched by its fold
    check_groups(y, groups, config.n_splits)  # too few groups for the folds: one line, not sklearn's traceback
    probe = fold_subspaces(H, y, groups, rank=max(1, K - 1), config=config)
    subspaces = {"probe": probe, "class means": class_mean_subspaces(H, y, probe)}
    if K == 2:
        subspaces["raw logistic"] = [
            FoldSubspace(f.test, torch.from_numpy(raw_logistic_basis(X[tr], y[tr])).to(H.dtype), f.probe_accuracy)
            for f, tr in ((f, np.setdiff1d(np.arange(len(y)), f.test)) for f in probe)]
    donor = y[pair]
    moved = donor != y

    def follows(states) -> np.ndarray:
        with torch.no_grad():
            pred = ctx.patch_state(states, mode)[:, label_ids].argmax(1).numpy()
        return (pred == donor).astype(float)[moved]

    out = {"model": args.model, "task": src.name, "mode": mode, "distractors": args.distractors,
           "n_samples": int(len(y)), "n_folds": len(probe), "directions": {}}
    print(f"{src.name}, N = {args.distractors}, {len(y)} rows, {mode}, {args.model}: follows the donor (held out, "
          "95% CI over groups) | energy fraction")
    hit = follows(H[pair])
    ci = group_bootstrap_ci(hit, groups[moved], config.n_boot, config.random_state)
    out["whole_swap"] = {"follows_donor": float(hit.mean()), "ci": ci}
    print(f"  {'whole swap':>14}: {hit.mean():.2f} [{ci[0]:.2f}, {ci[1]:.2f}]")
    vectors = {}
    for name, folds in subspaces.items():
        vectors[name] = [f.U[:, 0].double().numpy() for f in folds]
        hit = follows(per_fold_states(H, H[pair], folds, "subspace"))
        ci = group_bootstrap_ci(hit, groups[moved], config.n_boot, config.random_state)
        row = {"follows_donor": float(hit.mean()), "ci": ci, "energy_fraction": energy_fraction(H, H[pair], folds)}
        if name == "probe":
            low = np.argsort(X.std(0))[:10]
            row["mass_on_10_least_spread_coordinates"] = float(np.mean([(v[low] ** 2).sum() for v in vectors[name]]))
        out["directions"][name] = row
        extra = (f"; {row['mass_on_10_least_spread_coordinates']:.2f} of it on the 10 coordinates of least spread"
                 if name == "probe" else "")
        print(f"  {name:>14}: {row['follows_donor']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] | {row['energy_fraction']:.2f}"
              + extra)
    names = list(vectors)
    out["cosines"] = {f"{a} / {b}": float(np.mean([abs(u @ v) for u, v in zip(vectors[a], vectors[b])]))
                      for i, a in enumerate(names) for b in names[i + 1:]}
    print("  |cos| of the first directions (mean over folds): "
          + "; ".join(f"{k} {v:.2f}" for k, v in out["cosines"].items()))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
