"""Where a feedback model's fixed point departs from its standard pass (the diagnostic behind docs/recipe.md
items 10-11): `python -m analysis.fixed_point MODEL [--probe]`.

Relative error = ||h - h_std||^2 / ||h_std||^2 of the top state, for fused-k from the standard states (k = 1..8)
and for the exact fixed point (= recurrent-full), averaged over real positions and shown per position for the
last tokens of one prompt. --probe: the project's grouped-CV probe (stats.linear.grouped_cv_score) on
multi_register at the queried name's position (8 classes) and the last position (the answer), at every depth,
for the standard pass and for one fused pass from the fixed point. Output: printed only (a diagnostic).
"""
from __future__ import annotations

import numpy as np
import torch

from common.cli import Parser, add_model_flag, add_tokenizer_flag, int_in
from common.errors import UserError, cli_entry
from engine.inputs import check_inputs
from engine.prefill import fixed_point_top, jacobi_pass, pad_left, shift_state
from tasks import make_dataset
from models.loading import load_model

MAX_DISTRACTORS = 1024


def _batch(tok, task, n_pairs, n, seed):
    from tasks import tokenize_samples

    # the suite's one tokenization: a prompt with words the tokenizer does not know is refused, not run on [UNK]
    ids, s = tokenize_samples(make_dataset(task, n_pairs, n, seed=seed), tok)
    ids, mask = pad_left(ids, tok.pad_token_id)
    return s, ids, mask


@torch.no_grad()
def _runs(m, ids, mask):
    std = m(ids, mask, hidden_states=True)
    fuse = shift_state(std.top, mask)[1]
    gate = m.token_gate(ids)
    fp_top = fixed_point_top(m, ids, mask, fuse, gate)

    def step(top):  # one fused pass from these top states
        return jacobi_pass(m, ids, mask, top, fuse, gate, hidden_states=True)
    return std, fp_top, step


ERROR_TASKS = ("completion", "memory", "multi_register")


def _checked_batches(m, tok, n: int, with_probe: bool) -> dict:
    """Every batch this run will use, made and checked against the model (its context, its vocabulary) before the
    first forward: a prompt past the context is one line, not a run past it (or a late refusal)."""
    out = {task: _batch(tok, task, 8, n, 123) for task in ERROR_TASKS}
    if with_probe:
        out["probe"] = _batch(tok, "multi_register", 150, n, 321)
    for _, ids, mask in out.values():
        check_inputs(m, ids, mask)
    return out


def errors(m, tok, n=8, batches=None):
    batches = batches or _checked_batches(m, tok, n, False)
    for task in ERROR_TASKS:
        _, ids, mask = batches[task]
        std, fp_top, step = _runs(m, ids, mask)
        rel = lambda h: (h - std.top).pow(2).sum(-1) / std.top.pow(2).sum(-1)  # noqa: E731  [batch, pos]
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


def probe(m, tok, n=8, batches=None):
    from stats.linear import ProbeConfig, grouped_cv_score

    s, ids, mask = (batches or _checked_batches(m, tok, n, True))["probe"]
    names = np.array([x.text.split("get ")[-1].split("\n")[0] for x in s])
    labels = np.array([x.label for x in s])
    groups = np.array([x.group_id for x in s])
    col_name = -4  # "get F \n value :" : the queried name is 4 tokens before the end
    if tok.convert_ids_to_tokens([int(ids[0, col_name])])[0] != names[0]:
        raise UserError("the multi_register prompt format changed: the queried name is not 4 tokens from the end")
    std, fp_top, step = _runs(m, ids, mask)
    fp = step(fp_top)
    config = ProbeConfig(n_boot=50)  # the CI is not printed

    def acc(x, y):
        return grouped_cv_score(x.detach().double().numpy(), y, groups, config).accuracy

    for col, what, y in ((col_name, "queried name", names), (-1, "answer", labels)):
        cells = [f"{acc(a[:, col], y):.2f}/{acc(b[:, col], y):.2f}" for a, b in zip(std.hidden, fp.hidden)]
        print(f"{what}, depth 0..{len(cells) - 1} (standard / fixed point): " + " ".join(cells))


@cli_entry
def main(argv=None):
    ap = Parser(prog="python -m analysis.fixed_point", description=__doc__)
    add_model_flag(ap, help_extra=", with a fusion module", positional=True)
    ap.add_argument("--probe", action="store_true", help="also probe the name and the answer per depth "
                                                          "(multi_register, grouped CV)")
    ap.add_argument("--n", type=int_in(0, MAX_DISTRACTORS), default=8,
                    help=f"distractor lines N, 0..{MAX_DISTRACTORS} (default 8)")
    add_tokenizer_flag(ap)
    a = ap.parse_args(argv)
    from models.tokenizers import resolve_tokenizer, tokenizer_source

    if a.tokenizer is not None:
        tokenizer_source(a.tokenizer)
    model, tok, _ = load_model(a.model)
    if not model.has_fusion:
        raise UserError(f"{a.model} has no fusion module: it has no fixed point to diagnose")
    tok = resolve_tokenizer(model, tok, a.model, a.tokenizer)  # its own or --tokenizer's; none: refused
    model.eval()
    batches = _checked_batches(model, tok, a.n, a.probe)
    errors(model, tok, a.n, batches)
    if a.probe:
        probe(model, tok, a.n, batches)
    return 0


if __name__ == "__main__":
    main()
