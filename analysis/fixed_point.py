"""Where a feedback model's fixed point departs from its standard pass (diagnostic behind docs/recipe.md 10-11).

    python scripts/fixed_point_diag.py MODEL            # relative state error per position, three tasks, N = 8
    python scripts/fixed_point_diag.py MODEL --probe    # + multi_register: queried name / answer per depth

Relative error = ||h - h_std||^2 / ||h_std||^2 of the top state, for one fused pass from the standard states
(F(std)), k passes, and the exact fixed point (= recurrent-full). --probe fits a logistic regression on half
of 150 multi_register pairs and scores the other half, at the query name's position (8 classes) and the last
position (the answer), at every depth, for the standard pass and for a fused pass from the fixed point.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine.prefill import fixed_point_top, pad_left, shift_state
from models.presets import load_model
from tasks import make_dataset


def _batch(tok, task, n_pairs, n, seed):
    s = make_dataset(task, n_pairs, n, seed=seed)
    ids, mask = pad_left([tok(x.text, add_special_tokens=False)["input_ids"] for x in s], tok.pad_token_id)
    return s, ids, mask


@torch.no_grad()
def _runs(m, ids, mask):
    std = m(ids, mask, hidden_states=True)
    fuse = shift_state(std.top, mask)[1]
    gate = m.token_gate(ids)
    fp_top = fixed_point_top(m, ids, mask, fuse, gate)

    def step(top):  # one fused pass from these top states
        return m(ids, mask, state=shift_state(top, mask)[0], fuse_mask=fuse, gate=gate, hidden_states=True)
    return std, fp_top, step


def errors(m, tok, n=8):
    for task in ("completion", "memory", "multi_register"):
        _, ids, mask = _batch(tok, task, 8, n, 123)
        std, fp_top, step = _runs(m, ids, mask)
        rel = lambda h: (h - std.top).pow(2).sum(-1) / std.top.pow(2).sum(-1)  # [batch, pos]
        real = mask.bool()
        h, ks = std.top, []
        for _ in range(8):
            h = step(h).top
            ks.append(rel(h)[real].mean().item())
        one, fix = rel(step(std.top).top), rel(fp_top)
        print(f"{task} N={n}: fused-k from std, k = 1..8: " + " ".join(f"{e:.3f}" for e in ks)
              + f" | fixed point {fix[real].mean():.3f}")
        print("  last tokens:", tok.convert_ids_to_tokens(ids[0, -12:].tolist()))
        print("  F(std):     ", " ".join(f"{v:.2f}" for v in one[0, -12:].tolist()))
        print("  fixed point:", " ".join(f"{v:.2f}" for v in fix[0, -12:].tolist()))


def probe(m, tok, n=8):
    from sklearn.linear_model import LogisticRegression
    s, ids, mask = _batch(tok, "multi_register", 150, n, 321)
    names = np.array([x.text.split("get ")[-1].split("\n")[0] for x in s])
    labels = np.array([x.label for x in s])
    col_name = -4  # "get F \n value :" : the queried name is 4 tokens before the end
    assert tok.convert_ids_to_tokens([int(ids[0, col_name])])[0] == names[0], "prompt format changed"
    std, fp_top, step = _runs(m, ids, mask)
    fp = step(fp_top)
    half = len(s) // 2  # pairs are adjacent, so the split keeps each pair on one side

    def acc(x, y):
        x = x.float().numpy()
        return LogisticRegression(max_iter=3000).fit(x[:half], y[:half]).score(x[half:], y[half:])
    for col, what, y in ((col_name, "queried name", names), (-1, "answer", labels)):
        cells = [f"{acc(a[:, col], y):.2f}/{acc(b[:, col], y):.2f}" for a, b in zip(std.hidden, fp.hidden)]
        print(f"{what}, depth 0..{len(cells) - 1} (standard / fixed point): " + " ".join(cells))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint dir or preset name")
    ap.add_argument("--probe", action="store_true", help="also probe name and answer per depth (multi_register)")
    ap.add_argument("--n", type=int, default=8, help="distractors N (default 8)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load_model(a.model)
    model.eval()
    errors(model, tok, a.n)
    if a.probe:
        probe(model, tok, a.n)
