"""Is the whole group element decodable, or only the tracked cup? Grouped-CV probes of the running permutation.

    python scripts/permutation_probe.py s5 [--model checkpoints/tiny-fbt-group] [--distractors 64] [--n-pairs 600]

For the S5 / A5 word problems (tasks.groups) the answer is one cup (5 classes), but a recurrence that tracks it
at every length must carry more than the answer: the ball's cup after the next line depends only on the ball's
cup, so 5 values suffice in principle; the whole permutation (120 / 60 values) is what a model would carry if it
tracked the group element. Probed at the fed state entering the fusion at T (h_{T-1} of recurrent-full) and on
the residual stream at T (depth 0 = the fused input, the middle depth, the top), each with the one probe routine
(stats.linear.LinearProbe, the outer StratifiedGroupKFold of probes.run, pairs held out together):
    label         the tracked cup (5-way)
    permutation   the running permutation's index (120-way on s5, 60 reachable on a5)
    cups          the five 5-way probes "where is the content of cup c" (c = 0..4); `all five` = the row's five
                  held-out predictions all right, i.e. the permutation read cup by cup
Accuracies pool every held-out prediction, with 95% cluster-bootstrap CIs over groups; chance is the majority
class's share. The last line of stdout is one JSON object.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.cli import Parser, add_model_flag, add_seed_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402


def heldout_predictions(X: np.ndarray, y: np.ndarray, groups: np.ndarray, config) -> np.ndarray:
    """Every row's prediction by a probe fitted on the outer folds that hold it out (stats.linear.LinearProbe)."""
    from sklearn.model_selection import StratifiedGroupKFold

    from stats.linear import LinearProbe

    pred = np.full(len(y), -1)
    cv = StratifiedGroupKFold(n_splits=config.n_splits, shuffle=True, random_state=config.random_state)
    with warnings.catch_warnings():  # 120 classes: some have fewer members than folds (stratification is best effort)
        warnings.simplefilter("ignore", UserWarning)
        for tr, te in cv.split(X, y, groups):
            try:
                probe = LinearProbe(config).fit(X[tr], y[tr], groups[tr])
            except ValueError as e:  # sklearn: a class with fewer members than the inner folds
                raise UserError(f"too few samples a class for the probes' folds ({e}): raise --n-pairs "
                                f"(120 permutations: 600 pairs fit)") from None
            pred[te] = probe.predict(X[te])
    return pred


def score(correct: np.ndarray, groups: np.ndarray, y: np.ndarray, config) -> dict:
    from stats.bootstrap import group_bootstrap_ci

    chance = float(np.bincount(y).max() / len(y))
    return {"accuracy": float(correct.mean()), "ci": group_bootstrap_ci(correct, groups, config.n_boot,
                                                                         config.random_state),
            "chance": chance, "n": int(len(correct)), "classes": int(len(np.unique(y)))}


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python scripts/permutation_probe.py", description=__doc__.splitlines()[0])
    add_model_flag(p, "tiny-fbt-group")
    p.add_argument("task", choices=("s5", "a5"), help="the word problem")
    p.add_argument("--distractors", type=int_in(1, 1024), default=64, help="update lines N, 1..1024 (default 64)")
    p.add_argument("--n-pairs", type=int_in(50, 5000), default=600,
                   help="sample pairs, 50..5000 (default 600: 1200 rows)")
    p.add_argument("--mode", default="recurrent-full", help="the prefill mode (default recurrent-full)")
    p.add_argument("--batch-size", type=int_in(1, 1024), default=64, help="prompts per forward, 1..1024 (default 64)")
    p.add_argument("--sites", choices=("fed", "all"), default="fed",
                   help="fed: the fed state h_{T-1} only (default); all: also the residual at T at depths 0, L/2, L")
    add_seed_flag(p, "the dataset and the probes' folds")
    add_threads_flag(p, 2)
    args = p.parse_args(argv)
    set_threads(args.threads)

    from engine.modes import parse_mode
    from engine.prefill import pad_left, prefill_many
    from models.loading import load_model
    from models.tokenizers import resolve_tokenizer
    from stats.linear import ProbeConfig
    from tasks import make_dataset, prompt_ids, prompt_prefix
    from tasks.groups import N_CUPS, permutation_index, running_permutations

    mode = parse_mode(args.mode).name
    if mode != "recurrent-full" and not mode.startswith("recurrent-"):
        raise UserError(f"--mode {mode}: the fed state h_{{T-1}} exists under recurrent-K modes")
    model, tok, _ = load_model(args.model)
    tok = resolve_tokenizer(model, tok, args.model)  # none of its own: one line, not a TypeError later
    samples = make_dataset(args.task, args.n_pairs, args.distractors, args.seed)
    perms = [running_permutations(s)[-1] for s in samples]
    y_label = np.array([s.label for s in samples])
    y_perm = np.array([permutation_index(s) for s in perms])
    y_cups = np.array(perms)  # [B, 5]: cup c's content is under cup sigma[c]
    groups = np.array([s.group_id for s in samples])
    L = model.n_layers
    depths = sorted({0, L // 2, L})
    fed, resid = [], []
    lead = prompt_prefix(tok)  # a BOS first, where the tokenizer puts one before a text (as every command)
    with torch.no_grad():
        for i in range(0, len(samples), args.batch_size):
            part = samples[i:i + args.batch_size]
            ids, mask = pad_left([prompt_ids(tok, s.text, lead) for s in part], tok.pad_token_id)
            r = prefill_many(model, ids, mask, [mode], positions=(-2, -1), collect=True)[mode]
            fed.append(r.top[:, 0].double().numpy())  # the top state of T-1: what the fusion at T reads
            resid.append(r.resid[:, 1][:, depths].double().numpy())  # [b, |depths|, D] at T
    fed, resid = np.concatenate(fed), np.concatenate(resid)
    config = ProbeConfig(random_state=args.seed)
    sites = {"fed state h_{T-1}": fed}
    if args.sites == "all":
        sites.update({f"resid d{d} at T": resid[:, j] for j, d in enumerate(depths)})
    out = {"model": args.model, "task": args.task, "mode": mode, "distractors": args.distractors,
           "n_samples": len(samples), "sites": {}}
    print(f"{args.task}, N = {args.distractors}, {len(samples)} samples ({args.n_pairs} pairs), {mode}: held-out "
          "accuracy [95% CI] (chance)")
    for name, X in sites.items():
        row = {}
        for key, y in (("label", y_label), ("permutation", y_perm)):
            row[key] = score((heldout_predictions(X, y, groups, config) == y).astype(float), groups, y, config)
        cup_ok = np.stack([heldout_predictions(X, y_cups[:, c], groups, config) == y_cups[:, c]
                           for c in range(N_CUPS)], 1)
        row["cups_each"] = [score(cup_ok[:, c].astype(float), groups, y_cups[:, c], config)["accuracy"]
                            for c in range(N_CUPS)]
        row["cups_all_five"] = score(cup_ok.all(1).astype(float), groups, y_perm, config)
        out["sites"][name] = row

        def fmt(s):
            return f"{s['accuracy']:.3f} [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}] ({s['chance']:.3f})"

        print(f"  {name:>20}: label {fmt(row['label'])}; permutation {fmt(row['permutation'])} "
              f"({row['permutation']['classes']} classes seen); cups each "
              f"{', '.join(f'{a:.2f}' for a in row['cups_each'])}; all five {fmt(row['cups_all_five'])}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
