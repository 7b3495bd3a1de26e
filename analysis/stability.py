"""Stability of iterated feedback (paper Fig. 3): validation loss and state change per fused-k pass.

    python -m analysis.stability --models tiny-fbt,tiny-fbt-no3
    python -m analysis.stability --models tiny-fbt --long          # also k = 100 and 1000

For each model and task, runs the Jacobi passes of fused-k prefill on held-out samples (prompt + answer)
and records after every pass k: validation NTP loss, label accuracy at the final prompt position, and the
mean state change ||h^(k) - h^(k-1)|| over real positions. A map that contracts shows a falling state
change and a flat loss; a diverging one shows both rising. Also per model: how much the fusion gate depends on
the token (``gate`` in the JSON), since past the trained pass count only the gate carries a token into its
own fused input.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.cli import (Parser, add_output_flags, add_plotly_flag, add_progress_flag, add_task_flags, add_tokenizer_flag,
                        int_in, output_dir)
from common.errors import UserError, cli_entry
from common.io import fresh_output, json_text
from common.paths import figures_dir
from common.plotlyjs import include_plotlyjs, stage_plotly_js
from common.staged import Staged
from analysis.evaluate import EVAL_SEED, parse_tasks
from engine.prefill import MAX_FUSED_PASSES, iter_fused, pad_left
from models.fingerprint import weights_hash
from models.loading import load_model, model_dir
from probes.depth_curves import PALETTE
from tasks import ALL_TASKS, TASKS, make_dataset, prompt_ids, prompt_prefix, prompt_prefix_tokens, tokenize_samples

MAX_DISTRACTORS = 1024  # fused-k passes are full-width: quadratic in the prompt


def task_ids(tok, task: str, n: int, n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's held-out prompts with their answers, left-padded: (ids, mask) [batch, pos]. Refuses (UserError) a
    tokenizer that cannot spell the task, before any model runs."""
    samples = make_dataset(task, n_pairs=n_pairs, n_distractors=n, seed=EVAL_SEED)
    _, samples = tokenize_samples(samples, tok)  # validates the words and the shared final token
    prefix = prompt_prefix(tok)  # a BOS, where the tokenizer puts one before a text
    seqs = [prompt_ids(tok, s.full_text, prefix) for s in samples]
    return pad_left(seqs, tok.pad_token_id)


@torch.no_grad()  # each pass's top state feeds the next: with autograd on, every pass's graph stays in memory
def stability_curve(model, ids: torch.Tensor, mask: torch.Tensor, task: str, n: int, passes: int,
                    keep: set[int]) -> list[dict]:
    real = mask.bool()
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    rows, prev = [], None
    for k, out in iter_fused(model, ids, mask, passes):
        if k in keep:
            nll = F.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
            label_ok = out.logits[:, -2].argmax(-1) == ids[:, -1]  # prediction at the final prompt token
            rows.append({"task": task, "n_distractors": n, "passes": k,
                         "val_loss": float(nll[valid].mean()),
                         "label_accuracy": float(label_ok.float().mean()),
                         "state_change": None if prev is None else float((out.top - prev).norm(dim=-1)[real].mean()),
                         "state_norm": float(out.top.norm(dim=-1)[real].mean())})
        prev = out.top
    return rows


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "hexagon")


def series_looks(n: int) -> list[tuple[str, str, str]]:
    """n (colour, dash, marker symbol) looks, one per legend entry, no two with the same (colour, dash): the
    palette's colours solid, then again with each further dash; past those, colours of their own (hues 137.508
    degrees apart: distinct for 30,000 series) with the dashes in turn, and a marker of their own."""
    looks, first = [], len(PALETTE) * len(DASHES)
    for i in range(n):
        symbol = SYMBOLS[(i // first) % len(SYMBOLS)]
        if i < first:
            looks.append((PALETTE[i % len(PALETTE)], DASHES[i // len(PALETTE)], symbol))
        else:
            looks.append((f"hsl({i * 137.508 % 360:.3f},65%,42%)", DASHES[i % len(DASHES)], symbol))
    return looks


def zero_change_note(results: dict) -> list[str]:
    """One line per model / task whose state change is exactly 0 at some k > 0 (a fixed point reached in float):
    the log-y panel cannot draw those points, so the page names them instead of dropping them silently."""
    lines = []
    for model_name, rows in results.items():
        for task in dict.fromkeys(r["task"] for r in rows):
            ks = [r["passes"] for r in rows if r["task"] == task and r["passes"] > 0 and r["state_change"] == 0]
            if ks:
                lines.append(f"{model_name} / {task}: k = {_ranges(ks)}")
    return lines


def _ranges(ks: list[int]) -> str:
    """[1, 2, 3, 5, 7, 8] -> '1-3, 5, 7-8': a fixed point reached at pass 45 of 300 named 256 passes in one line
    that ran off the page."""
    ks = sorted(set(ks))
    runs, start = [], ks[0]
    for a, b in zip(ks, ks[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs)


def figure(results: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean state change ||h(k) - h(k-1)||",
                                                        "validation loss"))
    series = [(model_name, task) for model_name, rows in results.items()
              for task in dict.fromkeys(r["task"] for r in rows)]
    # one look per legend entry, the same on both panels; the legend group toggles both traces together
    for (model_name, task), (color, dash, symbol) in zip(series, series_looks(len(series))):
        rs = [r for r in results[model_name] if r["task"] == task and r["passes"] > 0]
        name = f"{model_name} / {task}"
        look = dict(mode="lines+markers", name=name, legendgroup=name, line=dict(color=color, dash=dash),
                    marker=dict(color=color, symbol=symbol))
        fig.add_trace(go.Scatter(x=[r["passes"] for r in rs], y=[r["state_change"] for r in rs], **look),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=[r["passes"] for r in rs], y=[r["val_loss"] for r in rs], showlegend=False,
                                 **look), row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="fused passes k", type="log")
    height, bottom = 480, 80
    zeros = zero_change_note(results)
    if zeros:  # a log axis drops a 0: say which points are missing from the state-change panel, and why
        text = "<br>".join(["state change exactly 0 (not drawn on the log axis):", *zeros])
        fig.add_annotation(text=text, xref="paper", yref="paper", x=0, y=0, xanchor="left", yanchor="top",
                           yshift=-45, align="left", showarrow=False, font=dict(size=12))
        bottom += 18 * (len(zeros) + 1)
        height += 18 * (len(zeros) + 1)
    fig.update_layout(title="Iterated feedback: does the map contract?", height=height, width=1100,
                      margin=dict(b=bottom))
    return fig


@torch.no_grad()
def gate_token_dependence(model, tok) -> dict:
    """How much the fusion gate sigmoid(W_G e_t) depends on the token: the only path by which a token reaches
    its own fused input (the state sets the signs, the gate can only rescale them).

    `token_std`: std over the vocabulary of each gate unit, averaged over units (0 = the gate ignores the
    token); `digits_01_abs_diff`: mean |gate("0") - gate("1")| (the memory bit, the multi_register answers).
    """
    emb = model.embed(torch.arange(len(tok))[None])[0]  # [vocab, d_model]
    g = torch.sigmoid(model.fusion.gate(emb))
    i0, i1 = (tok.convert_tokens_to_ids(t) for t in ("0", "1"))
    return {"mean": float(g.mean()), "token_std": float(g.std(0).mean()),
            "digits_01_abs_diff": float((g[i0] - g[i1]).abs().mean())}


def summary_lines(results: dict, tasks: list[str]) -> list[str]:
    """The printed summary: per model and task, the first four of k = 1, 2, 3, 5, 10, 30, 100, 1000 that ran, then
    `... ` and the last k that ran when it is not among those four (each k printed once)."""
    def cell(r):
        return (f"k={r['passes']}: dh={r['state_change']:.2e} loss={r['val_loss']:.3f} "
                f"acc={r['label_accuracy']:.2f}")

    lines = []
    for name, rows in results.items():
        for t in tasks:
            rs = {r["passes"]: r for r in rows if r["task"] == t}
            ks = [k for k in (1, 2, 3, 5, 10, 30, 100, 1000) if k in rs]
            cells = " ".join(cell(rs[k]) for k in ks[:4])
            if len(ks) > 4:
                cells += f" ... {cell(rs[ks[-1]])}"
            lines.append(f"{name:14s} {t:15s} {cells}")
    return lines


MAX_PAIRS = 1000  # --n-pairs: every held-out sample of a task runs in one batch
OUTPUTS = ("stability.json", "stability.html")


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m analysis.stability", description=__doc__)
    p.add_argument("--models", default="tiny-fbt,tiny-fbt-no3", help="comma-separated models: shipped presets' names or checkpoint directories "
                                                                   "(default tiny-fbt,tiny-fbt-no3)")
    add_task_flags(p, ALL_TASKS, ",".join(TASKS), several=True, custom=False)
    p.add_argument("--distractors", type=int_in(0, MAX_DISTRACTORS), default=8,
                   help=f"N distractor lines, 0..{MAX_DISTRACTORS} (default 8)")
    p.add_argument("--passes", type=int_in(1, MAX_FUSED_PASSES), default=30,
                   help=f"max fused passes k, 1..{MAX_FUSED_PASSES} (default 30)")
    p.add_argument("--long", action="store_true", help="also run to k = 100 and 1000")
    add_tokenizer_flag(p)
    p.add_argument("--n-pairs", type=int_in(1, MAX_PAIRS), default=16,
                   help=f"held-out pairs per task, 1..{MAX_PAIRS} (default 16)")
    add_output_flags(p, "./figures/stability under the current directory")
    add_plotly_flag(p)
    add_progress_flag(p)
    a = p.parse_args(argv)
    # --- everything that can be refused is checked before any model loads
    tasks = parse_tasks(a.tasks, [a.distractors])
    from models.tokenizers import resolve_tokenizer, tokenizer_source

    if a.tokenizer is not None:
        tokenizer_source(a.tokenizer)
    models = list(dict.fromkeys(m.strip() for m in a.models.split(",") if m.strip()))
    if not models:
        raise UserError("--models is empty")
    out = output_dir(a.out if a.out is not None else figures_dir("stability"))

    passes = 1000 if a.long else a.passes
    keep = set(range(0, a.passes + 1)) | ({100, 1000} if a.long else set())
    with fresh_output(out, OUTPUTS, a.overwrite, "analysis.stability run",
                      f"{out} already holds stability results; pass --overwrite or another --out"):
        for name in models:  # an unknown name, a folder without config.json: refused before anything loads
            model_dir(name)
        t0 = time.time()
        loaded = {}  # every model loaded and checked (tokenizer, its tasks' words, fusion) before any of them runs
        weights, prefixes = {}, {}  # which tensors answered, and how their prompts start (recorded in meta)
        for name in models:
            model, tok, _ = load_model(name)
            tok = resolve_tokenizer(model, tok, name, a.tokenizer)  # its own or --tokenizer's; none: refused
            if not model.has_fusion:
                raise UserError(f"{name} has no fusion module; stability of feedback is undefined for it")
            loaded[name] = (model, tok, {t: task_ids(tok, t, a.distractors, a.n_pairs) for t in tasks})
            weights[name], prefixes[name] = weights_hash(model), prompt_prefix_tokens(tok)
        results, gates = {}, {}
        for name in tqdm(models, desc="models", disable=a.no_progress):
            model, tok, prompts = loaded.pop(name)
            results[name] = [r for t in tasks
                             for r in stability_curve(model, *prompts[t], t, a.distractors, passes, keep)]
            gates[name] = gate_token_dependence(model, tok)
            del model, tok
        doc = {"meta": {"models": models, "tasks": tasks, "n_distractors": a.distractors, "passes": sorted(keep),
                        "n_pairs": a.n_pairs, "seed": EVAL_SEED, "wall_s": round(time.time() - t0, 1),
                        "tokenizer": a.tokenizer, "weights_sha256": weights, "prompt_prefix": prefixes},
               "results": results, "gate": gates}
        text = json_text(doc)
        fig = figure(results)
        with Staged(out) as st:  # the page and its JSON replace an earlier run's together, once both are whole
            stage_plotly_js(st, a.plotly)  # before the page: it never references a missing plotly.min.js
            st.file("stability.html", fig.to_html(include_plotlyjs=include_plotlyjs(a.plotly), full_html=True))
            st.file("stability.json", text)
            st.commit()
    for line in summary_lines(results, tasks):
        print(line)
    for name, g in gates.items():
        print(f"{name:14s} gate sigmoid(W_G e): mean {g['mean']:.3f}, std over tokens {g['token_std']:.4f}, "
              f"|gate('0') - gate('1')| {g['digits_01_abs_diff']:.4f}")
    print(f"wrote {out}/stability.json and stability.html")


if __name__ == "__main__":
    main()
