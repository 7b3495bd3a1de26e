"""The quick label-accuracy evaluation a run logs every eval_every steps (the full one is analysis.evaluate)."""
from __future__ import annotations

import torch

from engine.inputs import eval_mode
from engine.prefill import pad_left, prefill_many
from tasks import TRACKING_TASKS, label_token_ids, make_dataset, prompt_ids, prompt_prefix
from training.config import TrainConfig


@torch.no_grad()
def label_accuracy(model, tok, task: str, n: int, modes, n_pairs: int = 32, seed: int = 10_000) -> dict:
    """Label accuracy at the final position per prefill mode (argmax over the two label words)."""
    samples = make_dataset(task, n_pairs=n_pairs, n_distractors=n, seed=seed)
    prefix = prompt_prefix(tok)  # as analysis.evaluate reads them: a BOS first, if the tokenizer adds one
    seqs = [prompt_ids(tok, s.text, prefix) for s in samples]
    ids, mask = pad_left(seqs, tok.pad_token_id)
    dev = next(model.parameters()).device
    words = label_token_ids(tok, task)
    labels = torch.tensor([s.label for s in samples], device=dev)
    res = prefill_many(model, ids.to(dev), mask.to(dev), modes, positions=(-1,), collect=False)
    return {m: float((r.logits[:, 0, words].argmax(-1) == labels).float().mean()) for m, r in res.items()}


def settings(tok, cfg: TrainConfig, context: int | None = None) -> tuple[list, list]:
    """(kept, dropped) (task, N) of the quick evaluations, N = 8 and 64 for the tracking tasks: dropped where a
    prompt (the BOS included) is longer than `context`, a --base model's (an index error or positions it never
    saw); dropped items are (task, N, tokens)."""
    every = [(task, n) for task in cfg.tasks for n in ((8, 64) if task in TRACKING_TASKS else (8,))]
    if context is None:
        return every, []
    kept, dropped = [], []
    lead = prompt_prefix(tok)
    for task, n in every:
        longest = max(len(prompt_ids(tok, s.text, lead))
                      for s in make_dataset(task, n_pairs=16, n_distractors=n, seed=10_000))
        (kept.append((task, n)) if longest <= context else dropped.append((task, n, longest)))
    return kept, dropped


def quick_eval(model, tok, cfg: TrainConfig, context: int | None = None) -> dict:
    """Label accuracy at N = 8 (and, for tracking tasks, N = 64) per mode; log keys `<task>` and `<task> N=64`;
    a setting whose prompts exceed `context` is left out (`settings`). Runs in eval mode and leaves every module
    in the mode it was in (the trainer's model goes on training; an eval-mode one stays so), also on an error."""
    with eval_mode(model):  # the caller's modes are put back however this ends
        return _quick_eval(model, tok, cfg, context)


def _quick_eval(model, tok, cfg: TrainConfig, context: int | None) -> dict:
    out = {}
    if model.has_fusion:
        short, long = ["standard", "recurrent-1", "fused-8", "recurrent-full"], ["standard", "recurrent-full"]
    elif cfg.loop_core:  # a looped model: its trained r (standard) and twice as many iterations
        short = long = ["standard", f"loop-{min(256, 2 * cfg.loop_iterations)}"]
    else:
        short = long = ["standard"]
    for task, n in settings(tok, cfg, context)[0]:  # N = 64: past the depth, where only a recurrence carries the state
        out[task if n == 8 else f"{task} N={n}"] = label_accuracy(model, tok, task, n, short if n == 8 else long,
                                                                  n_pairs=16)
    return out
