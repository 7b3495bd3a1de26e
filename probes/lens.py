"""Logit lens (nostalgebraist 2020): the model's own final norm and LM head applied to the residual stream at
every depth of the probed position T, read against the task's label words.

For a residual x [D] at depth d (0 = input of block 0, l = output of 0-based block l - 1, L = raw output of the last
block) the lens logits are z = W_U norm_f(x) [V], where norm_f is the model's final norm (the one between the last
block and the LM head) and W_U the LM head. At depth L this is exactly the model's output at T.
The fed state h_{T-1} is already post-final-norm (it is what the LM head reads at T-1), so its lens is
W_U h_{T-1}, without the norm.

Per row, with own label y among K label words:
    LD    = z[word(y)] - max over the other label words of z[word(o)]. For K = 2 this is the usual logit
            difference; for K > 2 it is the margin of the own label over its strongest competitor, so LD > 0
            exactly when the label word the lens prefers among the K is the right one (the mean over the others
            would hide a strong wrong competitor behind a weak one).
    rank  = 1 + the number of vocabulary tokens whose lens logit is strictly above word(y)'s (1 = the lens'
            top token over the full vocabulary, ties in favour of the label).
Per (mode, N, depth) the rows of probes.json carry `logit_lens_ld` (mean LD), `logit_lens_ld_ci` (95% bootstrap
over groups), `logit_lens_accuracy` (share of rows with LD > 0; 1/2 for a tie) and `logit_lens_rank` (mean rank).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.errors import UserError
from engine.result import require_finite
from models.families import family_of

LENS_FIELDS = ("logit_lens_ld", "logit_lens_ld_ci", "logit_lens_accuracy", "logit_lens_rank")
LENS_META = {"enabled": True,
             "method": "logit lens (nostalgebraist 2020): the final norm and the LM head on the residual at T",
             "ld": "logit(own label word) - max over the other label words (K = 2: the logit difference)",
             "rank": "1 + tokens of the full vocabulary with a strictly higher lens logit than the own label word",
             "accuracy": "share of rows with ld > 0 (1/2 on a tie)",
             "ci": "95% percentile bootstrap over groups",
             "fed_state": "W_U h_{T-1} (already post-final-norm), the state fed into T"}


def final_norm(lm) -> nn.Module:
    """The final norm of an HF causal LM's base model, where its family keeps it (models.families: Llama/Qwen/Gemma
    `norm`, GPT-2 `ln_f`, GPT-NeoX `final_layer_norm`)."""
    return family_of(lm).final_norm(lm)


@torch.no_grad()
def lens_logits(model, resid, normed: bool = False, chunk: int = 4096) -> torch.Tensor:
    """Lens logits [..., V] of residuals [..., D] (float32); `normed`: the input is already post-final-norm."""
    lm = model.lm
    family = family_of(lm)
    norm, head = final_norm(lm), lm.get_output_embeddings()
    x = torch.as_tensor(np.asarray(resid) if not torch.is_tensor(resid) else resid).float()
    flat = x.reshape(-1, x.shape[-1])
    w = head.weight  # the model's own device and dtype (--device / --dtype): the lens reads as the model does
    out = []
    for i in range(0, len(flat), chunk):  # bounded memory: [chunk, V] at a time
        part = flat[i:i + chunk].to(device=w.device, dtype=w.dtype)
        out.append(family.logits(lm, part if normed else norm(part)).float().cpu())  # Gemma 2's soft-cap too
    return torch.cat(out).reshape(*x.shape[:-1], -1)


def label_margin_and_rank(logits: torch.Tensor, labels, label_ids) -> tuple[np.ndarray, np.ndarray]:
    """(LD [n], rank [n]) of lens logits [n, V] against each row's own label (see the module doc)."""
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    ids = torch.as_tensor(list(label_ids), dtype=torch.long)
    K = len(ids)
    if K < 2 or logits.ndim != 2 or logits.shape[0] != len(labels):
        raise UserError("the logit lens needs [rows, vocab] logits, one label per row and >= 2 label words")
    require_finite(logits, "the logit lens")
    z = logits.double()
    zl = z[:, ids]  # [n, K]
    own = zl.gather(1, labels[:, None])[:, 0]
    others = zl.masked_fill(torch.nn.functional.one_hot(labels, K).bool(), float("-inf"))
    ld = own - others.max(1).values
    rank = 1 + (z > own[:, None]).sum(1)
    return ld.numpy(), rank.numpy()


def lens_summary(logits: torch.Tensor, labels, label_ids, groups, n_boot: int = 1000, seed: int = 0) -> dict:
    """The probes.json lens fields of one set of rows."""
    from stats.bootstrap import group_bootstrap_ci

    ld, rank = label_margin_and_rank(logits, labels, label_ids)
    acc = np.where(ld > 0, 1.0, np.where(ld == 0, 0.5, 0.0))
    return {"logit_lens_ld": float(ld.mean()), "logit_lens_ld_ci": group_bootstrap_ci(ld, groups, n_boot, seed),
            "logit_lens_accuracy": float(acc.mean()), "logit_lens_rank": float(rank.mean())}


def depth_lens(model, acts, labels, label_ids, groups, n_boot: int = 1000, seed: int = 0) -> list[dict]:
    """Lens fields per depth of activations [n, L+1, D] at T."""
    logits = lens_logits(model, acts)  # [n, L+1, V]
    return [lens_summary(logits[:, d], labels, label_ids, groups, n_boot, seed) for d in range(logits.shape[1])]


def fed_state_mode(mode: str) -> str | None:
    """The engine mode whose top state at T-1 is the state fed into T under `mode` (None: nothing is fed).

    recurrent-k: its own run (the recurrence feeds the previous column's top state of the same run);
    fused-n: pass n fuses pass n-1's top states, i.e. fused-(n-1) (fused-0 = standard)."""
    from engine.modes import parse_mode

    return parse_mode(mode).fed_top_source


@torch.no_grad()
def fed_states(model, token_ids, mode: str, pad_id: int = 0, batch_size: int = 32) -> np.ndarray:
    """The state h_{T-1} [n, D] entering the fusion at T under `mode`, via the prefill engine."""
    from engine.prefill import pad_left, prefill_many

    src = fed_state_mode(mode)
    if src is None:
        raise UserError(f"mode {mode!r} feeds no state")
    order = sorted(range(len(token_ids)), key=lambda i: (len(token_ids[i]), i))  # by length: little padding
    out = np.zeros((len(token_ids), model.d_model), dtype=np.float32)
    for s in range(0, len(order), batch_size):
        rows = order[s:s + batch_size]
        ids, mask = pad_left([token_ids[i] for i in rows], pad_id)
        res = prefill_many(model, ids, mask, [src], positions=(-2,), collect=False, logits=False)[src]
        out[rows] = res.top[:, 0].float().numpy()  # [batch, D]: top state of column T-1
    return out
