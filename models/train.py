"""Multi-pass (Jacobi) training of a FullBandwidthLM on the synthetic task mixture.

    python -m models.train --preset tiny-fbt                     # trains into checkpoints/tiny-fbt
    python -m models.train --preset tiny-fbt --out runs/x --resume
    torchrun --nproc_per_node=2 -m models.train --preset smoke --out runs/ddp

Loss: L = NTP(pass 1) + lambda/(K-1) * sum_{k=2..K} NTP(pass k); pass k>1 fuses pass k-1's top states shifted
right by one; gradients flow through every pass (nothing detached). K is drawn per batch from the schedule.
Every batch is a pure function of (seed, step, rank), so `--resume` continues bit-identically.
Every flag is checked before any work; a run holds a lock on --out, stops at the first non-finite loss, gradient
or weight without saving it, and with --overwrite replaces an earlier run only once its own last checkpoint is
written (models.train.RunOutput).
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from common.cli import Parser, float_in, int_in, output_dir
from common.errors import UserError, cli_entry
from common.io import DirLock, atomic_write, json_text, remove_stale_tmp
from models.configs import gpt2_config, qwen3_config
from models.full_bandwidth import FullBandwidthLM, embedding_rms, load_weights
from models.presets import (FLOAT_LIMITS, INT_LIMITS, MAX_DISTRACTORS, MAX_PASSES, MAX_STEPS, PRESETS, REGISTER_LEVELS,
                            TrainConfig, checkpoint_dir, get_preset)
from engine.prefill import fixed_point_top, pad_left, prefill_many, recurrent_logits, shift_state
from tasks import build_tokenizer, label_token_ids, make_dataset
from tasks.samples import REGISTERS, WRITES_CHOICES

FIXED_POINT = -1  # Batch.warm value: pass 2 fuses the fixed-point states (engine.prefill.fixed_point_top)
STATE_FILE = "trainer_state.safetensors"  # optimizer state + step: tensors and JSON, no pickle
LEGACY_STATE_FILE = "trainer_state.pt"  # an earlier version's pickle: never loaded (see load_resume)
LOG_FILE = "train_log.json"


# ----- data --------------------------------------------------------------------------------------------------
class Batch(NamedTuple):
    ids: torch.Tensor  # [batch, pos]
    mask: torch.Tensor  # [batch, pos]
    k: int  # passes
    warm: int  # extra no-grad passes before pass 2; FIXED_POINT: start pass 2 from the exact fixed point
    fuse_from: torch.Tensor  # [batch] first column that may be fused (prefix mixin)
    desc: str
    label_pos: torch.Tensor  # [batch, pos] bool: the token at this column is a label word
    skip_pos: torch.Tensor | None = None  # [batch, pos] bool: a random task value, not a loss target
    dense: torch.Tensor | None = None  # [batch, pos] target id of the logits AT each column (-100: none)


def value_token_ids(tok) -> list[int]:
    """Ids of the task's random value symbols (digits, register names): uniformly random by construction."""
    vocab = tok.get_vocab()
    return sorted(vocab[t] for t in [*map(str, range(10)), *REGISTERS] if t in vocab)


def _n_mixture(cfg: TrainConfig, step: int) -> tuple[list[int], np.ndarray]:
    """(N values, probabilities) for this step: the curriculum keeps only N <= curriculum_max_n."""
    distractors = cfg.distractors
    if cfg.length_doubling:
        top = cfg.length_start * 2 ** min(step // cfg.length_doubling, 30)
        distractors = {n: w for n, w in distractors.items() if n <= top} or {min(distractors): 1.0}
    if step < cfg.curriculum_steps:
        distractors = {n: w for n, w in distractors.items() if n <= cfg.curriculum_max_n} or distractors
    ns = sorted(distractors)
    return ns, np.array([distractors[k] for k in ns]) / sum(distractors.values())


def _register_level(cfg: TrainConfig, step: int, rng) -> tuple[int, int | None]:
    """(registers, writes) of a multi_register training sample at this step: the task's own (8, one of 2/4/8)
    after the curriculum; during it a level drawn uniformly from the first ones, one more level every
    register_curriculum / len(REGISTER_LEVELS) steps. The plain lookups stay in the mix until the end: with the
    other tasks in the batch the lookup circuit formed later than a fixed ramp moved on (docs/recipe.md)."""
    if step >= cfg.register_curriculum:
        return len(REGISTERS), int(rng.choice(list(WRITES_CHOICES)))
    top = step * len(REGISTER_LEVELS) // cfg.register_curriculum
    return REGISTER_LEVELS[int(rng.integers(top + 1))]


def _passes(cfg: TrainConfig, step: int, rng) -> tuple[int, int]:
    """(K passes, warm no-grad passes) drawn for this step; 1 pass during the curriculum."""
    k = int(rng.choice(len(cfg.probs), p=np.array(cfg.probs))) + 1
    if step < cfg.curriculum_steps:
        k = 1  # feedback passes only once the standard pass has learned the tasks (as the paper's warm start)
    warm = int(rng.integers(1, cfg.warm_passes + 1)) if (k > 1 and cfg.warm_passes and rng.random() < cfg.warm_prob) else 0
    # Drawn only when the option is on, so the batches of recipes without it are unchanged.
    if k > 1 and cfg.fixed_point_prob > 0 and rng.random() < cfg.fixed_point_prob:
        warm = FIXED_POINT
    return k, warm


def _value_targets(ids: torch.Tensor, label_pos: torch.Tensor, tok) -> torch.Tensor:
    # With tied embeddings, uniformly random targets drive the embeddings of exactly the symbols the tasks
    # must tell apart towards one vector (measured: digit embeddings at cosine 0.99 after 750 steps, and
    # every label at chance); they carry no learnable signal, so they are not targets. Labels stay.
    return torch.isin(ids, torch.tensor(value_token_ids(tok))) & ~label_pos


def _answer_pos(ids: torch.Tensor, tok) -> torch.Tensor:
    """[batch, pos] bool: tokens right after "value :", i.e. the answers of multi_register queries (the final
    one and the training-only reads inside the history)."""
    v, c = (tok.convert_tokens_to_ids(t) for t in ("value", ":"))
    out = torch.zeros_like(ids, dtype=torch.bool)
    out[:, 2:] = (ids[:, :-2] == v) & (ids[:, 1:-1] == c)
    return out


def make_batch(cfg: TrainConfig, tok, step: int, rank: int = 0, world: int = 1) -> Batch:
    """Deterministic packed batch for (seed, step, rank).

    Rows of exactly `cfg.seq_len` tokens, each a stream of samples (full text + newline) with task, N and
    writes drawn per sample, so every batch mixes all tasks with no padding (attention keeps its fast causal
    path). One task per batch instead stalled learning on a plateau: see the model card.
    """
    rng = np.random.default_rng([cfg.seed, step, rank])
    ns, p_n = _n_mixture(cfg, step)
    seq_len = min(cfg.seq_len, cfg.curriculum_seq_len) if step < cfg.curriculum_steps else cfg.seq_len
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    rows = max(1, cfg.batch_tokens // seq_len)
    ids = torch.empty(rows, seq_len, dtype=torch.long)
    label_pos = torch.zeros(rows, seq_len, dtype=torch.bool)
    for r in range(rows):
        stream, labels = [], []
        while len(stream) < seq_len:
            task = str(rng.choice(list(cfg.tasks)))
            n = int(rng.choice(ns, p=p_n))
            registers, writes = _register_level(cfg, step, rng) if task == "multi_register" else (len(REGISTERS), None)
            sample = make_dataset(task, 1, n, seed=int(rng.integers(2**31)), writes=writes,
                                  registers=registers)[int(rng.integers(2))]
            toks = tok(sample.full_text, add_special_tokens=False)["input_ids"]
            labels.append(len(stream) + len(toks) - 1)
            stream += toks + newline
        ids[r] = torch.as_tensor(stream[:seq_len])
        label_pos[r, [p for p in labels if p < seq_len]] = True
    mask = torch.ones_like(ids)
    skip_pos = _value_targets(ids, label_pos, tok) if cfg.skip_values else None
    k, warm = _passes(cfg, step, rng)
    # Prefix mixin: a random-length prefix per row keeps plain embeddings (prompt prefilled normally).
    prefix = np.where(rng.random(rows) < cfg.prefix_mix, (rng.random(rows) * seq_len).astype(int), 0)
    return Batch(ids, mask, k, warm, torch.as_tensor(prefix), f"packed/k={k}", label_pos, skip_pos)


def make_batches(cfg: TrainConfig, tok, step: int, rank: int = 0, world: int = 1) -> list[Batch]:
    """The micro-batches of one optimizer step, a pure function of (seed, step, rank).

    packing=True: one packed batch (`make_batch`). packing=False: one micro-batch per task, each of
    ~batch_tokens/len(tasks) tokens, ONE sample per row (the prompt's own context only, as at evaluation) and
    one N (and writes) per micro-batch, so rows have equal length: no padding, fast causal attention. In
    packed rows the label position also attends to every earlier sample in the row (same symbols, other
    values): measured here, labels then stayed at chance for 1000+ steps.
    """
    if cfg.packing:
        return [make_batch(cfg, tok, step, rank, world)]
    rng = np.random.default_rng([cfg.seed, step, rank, 1])
    ns, p_n = _n_mixture(cfg, step)
    k, warm = _passes(cfg, step, rng)
    pad = tok.pad_token_id or 0
    out = []
    shares = np.array(cfg.task_weights or [1.0] * len(cfg.tasks))
    shares = shares / shares.sum()
    for task, share in zip(cfg.tasks, shares):
        n = int(rng.choice(ns, p=p_n))
        registers, writes = _register_level(cfg, step, rng) if task == "multi_register" else (len(REGISTERS), None)
        reads = cfg.reads if task == "multi_register" else 0
        seqs, samples = [], []
        while True:
            sample = make_dataset(task, 1, n, seed=int(rng.integers(2**31)), writes=writes, reads=reads,
                                  registers=registers)[int(rng.integers(2))]
            samples.append(sample)
            seqs.append(tok(sample.full_text, add_special_tokens=False)["input_ids"])
            if sum(map(len, seqs)) + len(seqs[-1]) > cfg.batch_tokens * share:
                break
        T = max(map(len, seqs))
        # Rows are equal-length by construction; right padding (never attended to by real tokens under causal
        # attention) only guards against a tokenizer that breaks that, and pad targets are skipped.
        ids = torch.full((len(seqs), T), pad, dtype=torch.long)
        label_pos = torch.zeros(len(seqs), T, dtype=torch.bool)
        real = torch.zeros(len(seqs), T, dtype=torch.bool)
        for r, sq in enumerate(seqs):
            ids[r, :len(sq)] = torch.as_tensor(sq)
            label_pos[r, len(sq) - 1] = True
            real[r, :len(sq)] = True
        if reads:
            label_pos |= _answer_pos(ids, tok)
        dense = _dense_targets(samples, seqs, T, tok, task) if cfg.dense_targets else None
        skip_pos = ~real
        if cfg.skip_values:
            skip_pos |= _value_targets(ids, label_pos, tok)
        prefix = np.where(rng.random(len(seqs)) < cfg.prefix_mix, (rng.random(len(seqs)) * T).astype(int), 0)
        out.append(Batch(ids, torch.ones_like(ids), k, warm, torch.as_tensor(prefix),
                         f"{task}/N={n}/k={k}", label_pos, skip_pos, dense))
    return out


def _dense_targets(samples, seqs, T: int, tok, task: str) -> torch.Tensor:
    """[rows, T] target ids AT each column: the running value's label word at the last token of every update line
    (line i + 1 of the prompt ends before its newline), and the answer at the prompt's last token; -100 elsewhere."""
    words = label_token_ids(tok, task)
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    if len(newline) != 1:
        raise UserError("dense targets need a tokenizer with a newline token")
    out = torch.full((len(seqs), T), -100, dtype=torch.long)
    for r, (s, sq) in enumerate(zip(samples, seqs)):
        ends = [j - 1 for j, t in enumerate(sq) if t == newline[0]]  # last token of each line
        for i, j in enumerate(ends[1:1 + len(s.running)]):
            out[r, j] = words[s.running[i]]
        out[r, len(sq) - 2] = words[s.label]  # the prompt's final ":" predicts the answer (the row's last token)
    return out


def dense_loss(logits: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits at the columns that have a dense target."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), dense.reshape(-1), ignore_index=-100)


# ----- loss --------------------------------------------------------------------------------------------------
def ntp_loss(logits, ids, mask, label_weight: float, label_pos=None, skip_pos=None, labels_only: bool = False):
    """Weighted next-token loss; label-word targets get `label_weight` (default: each row's last token);
    targets at `skip_pos` get weight 0; `labels_only`: the label targets alone (each weight 1)."""
    tgt = ids[:, 1:]
    valid = (mask[:, 1:] * mask[:, :-1]).float()
    w = valid.clone()
    is_label = torch.zeros_like(w, dtype=torch.bool)
    if label_pos is None:
        is_label[:, -1] = True
    else:
        is_label = label_pos[:, 1:]
    w = w * is_label if labels_only else torch.where(is_label, w * label_weight, w)
    if skip_pos is not None:
        w = w.masked_fill(skip_pos[:, 1:], 0.0)
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="none")
    return (nll.view_as(w) * w).sum() / w.sum()


def multipass_loss(model, ids, mask, k: int, cfg: TrainConfig, fuse_from=None, generator=None, warm: int = 0,
                   label_pos=None, skip_pos=None, extras: dict | None = None, dense=None):
    """Returns (total loss, [per-pass NTP losses]); `extras`, if given, receives the per-pass consistency terms.
    `dense` [batch, pos]: target ids at each column (dense_loss) instead of the next-token targets.

    `warm` > 0 (recipe option, off in the paper's objective): before pass 2, run that many extra Jacobi passes
    without gradient starting from pass 1's states, so pass 2 sees states closer to the recurrent fixed point
    that `recurrent-full` and long `fused-n` produce at inference. `warm` = FIXED_POINT: pass 2 starts from that
    fixed point itself (no gradient through it: pass 2's loss trains one step of the map at its fixed point,
    as a deep-equilibrium model's one-step gradient), computed for this batch's fuse mask without noise.
    `cfg.consistency` > 0 (recipe option): adds consistency/(K-1) * sum_k C_k, C_k = mean over fused positions of
    ||top_k - sg(top_1)||^2 / ||sg(top_1)||^2, pulling every fused pass toward the standard pass's states at
    every position (the label NTP alone lets a fused pass relay what pass 1 computed instead of reading its token
    through the gate, a shortcut that is gone at the fixed point; docs/recipe.md). `cfg.consistency_window` = W > 0
    adds to C_k the same mean over the fused positions among the W before each label target alone.
    """
    def loss_of(logits):
        if dense is not None:
            return dense_loss(logits, dense)
        return ntp_loss(logits, ids, mask, cfg.label_weight, label_pos, skip_pos, cfg.targets == "labels")

    deep = k > 1 and cfg.consistency > 0 and cfg.consistency_layers == "all"
    out = model(ids, mask, hidden_states=deep)
    losses = [loss_of(out.logits)]
    cols = torch.arange(ids.shape[1])[None]
    # sigmoid(W_G e) depends on the tokens only: computed once per batch, its gradient summed over the passes.
    gate = model.token_gate(ids) if k > 1 else None

    def shifted(top):  # the carried state and where it is fused (prefix mixin: not before fuse_from)
        state, fuse = shift_state(top, mask)
        return state, fuse if fuse_from is None else fuse & (cols >= fuse_from[:, None])

    def fused_pass(top, hidden=deep):
        state, fuse = shifted(top)
        if cfg.noise > 0:
            noise = torch.rand(state.shape, generator=generator, dtype=state.dtype) * 2 - 1
            state = state + cfg.noise * noise
        return model(ids, mask, state=state, fuse_mask=fuse, gate=gate, hidden_states=hidden)

    def states(o):  # the states compared by the consistency term: the top, or every block's output
        return o.hidden[1:] if deep else (o.top,)

    top, cons = out.top, []
    if k > 1 and cfg.consistency > 0:
        target = [h.detach() for h in states(out)]  # [batch, pos, d_model] each: the standard pass's, no gradient
        fuse_mask = shifted(top)[1]  # [batch, pos]
        if cfg.consistency_window > 0:  # the columns whose states predict a label target or sit < W before one
            if label_pos is None:  # as ntp_loss: each row's last token is its label
                label_pos = torch.zeros_like(mask, dtype=torch.bool)
                label_pos[:, -1] = True
            window = torch.zeros_like(label_pos)
            for j in range(1, cfg.consistency_window + 1):
                window[:, :-j] |= label_pos[:, j:]
            window &= fuse_mask
    if k > 1 and warm == FIXED_POINT:
        top = fixed_point_top(model, ids, mask, shifted(top)[1], gate.detach(), tol=cfg.fixed_point_tol or None,
                              start=top.detach())
    elif k > 1 and warm > 0:
        with torch.no_grad():
            for _ in range(warm):
                top = fused_pass(top, hidden=False).top
    for _ in range(2, k + 1):
        out = fused_pass(top)
        top = out.top
        losses.append(loss_of(out.logits))
        if cfg.consistency > 0:
            rel = sum((h - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)
                      for h, t in zip(states(out), target)) / len(target)  # [batch, pos]
            c = (rel * fuse_mask).sum() / fuse_mask.sum().clamp_min(1)
            if cfg.consistency_window > 0:
                c = c + (rel * window).sum() / window.sum().clamp_min(1)
            cons.append(c)
    total = losses[0] + (cfg.lam / (k - 1)) * sum(losses[1:]) if k > 1 else losses[0]
    if cons:
        total = total + (cfg.consistency / (k - 1)) * sum(cons)
    if extras is not None:
        extras["consistency"] = cons
    return total, losses


# ----- model -------------------------------------------------------------------------------------------------
def _init_gate(model: FullBandwidthLM, cfg: TrainConfig) -> FullBandwidthLM:
    # The gate reads raw token embeddings (RMS ~0.02-0.05). With nn.Linear's default init its pre-activation has
    # std ~emb_rms / sqrt(3), so sigmoid(W_G e) is ~0.5 for every token and a token barely reaches its own fused
    # input (measured on tiny-fbt after training: |gate("0") - gate("1")| = 0.013 per unit). "unit" starts the
    # pre-activation at std 1 instead.
    if cfg.gate_init == "unit" and model.fusion is not None:
        with torch.no_grad():
            model.fusion.gate.weight.normal_(0.0, cfg.gate_std / (embedding_rms(model.lm) * model.d_model ** 0.5))
    return model


def build_model(cfg: TrainConfig, vocab_size: int, base: str | None = None) -> FullBandwidthLM:
    torch.manual_seed(cfg.seed)
    if base:
        from models.presets import load_model
        model, _, _ = load_model(base)
        return _init_gate(FullBandwidthLM(model.lm, fusion=True), cfg)
    mk = qwen3_config if cfg.arch == "qwen3" else gpt2_config
    kw = dict(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, max_len=cfg.max_len,
              tie_word_embeddings=cfg.tie_embeddings)
    if cfg.arch == "qwen3":
        kw.update(n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff)
    model = _init_gate(FullBandwidthLM.from_config(mk(vocab_size, **kw)), cfg)
    if cfg.depth_scale:
        with torch.no_grad():
            for name, p in model.lm.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                    p.mul_(1 / math.sqrt(2 * cfg.n_layers))
    return model


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    end = next((e for e in cfg.lr_legs if step < e), cfg.steps)  # the leg this step belongs to
    t = (step - cfg.warmup) / max(1, end - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ----- evaluation --------------------------------------------------------------------------------------------
@torch.no_grad()
def label_accuracy(model, tok, task: str, n: int, modes, n_pairs: int = 32, seed: int = 10_000) -> dict:
    """Label accuracy at the final position per prefill mode (argmax over the two label words)."""
    samples = make_dataset(task, n_pairs=n_pairs, n_distractors=n, seed=seed)
    seqs = [tok(s.text, add_special_tokens=False)["input_ids"] for s in samples]
    ids, mask = pad_left(seqs, tok.pad_token_id)
    words = label_token_ids(tok, task)
    labels = torch.tensor([s.label for s in samples])
    res = prefill_many(model, ids, mask, modes, positions=(-1,), collect=False)
    return {m: float((r.logits[:, 0, words].argmax(-1) == labels).float().mean()) for m, r in res.items()}


def quick_eval(model, tok, cfg: TrainConfig) -> dict:
    model.eval()
    out = {}
    from tasks import TRACKING_TASKS
    for task in cfg.tasks:
        out[task] = label_accuracy(model, tok, task, 8, ["standard", "recurrent-1", "fused-8", "recurrent-full"],
                                   n_pairs=16)
        if task in TRACKING_TASKS:  # past the depth: where only the recurrence can carry the state
            out[f"{task}@64"] = label_accuracy(model, tok, task, 64, ["standard", "recurrent-full"], n_pairs=16)
    model.train()
    return out


# ----- checkpoints -------------------------------------------------------------------------------------------
# The trainer state is tensors + JSON (safetensors with a JSON header), never a pickle: loading a pickle runs
# whatever code it names, so a crafted trainer_state.pt ran code on --resume. It is written last and records the
# digests of the model and log files it belongs to, so a save cut short (model newer than the optimizer) is
# refused on --resume instead of continuing from a mismatched pair.
STATE_FORMAT = "fbt-trainer-state/1"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flatten(obj, tensors: dict):
    """A state dict as JSON-able data, its tensors moved into `tensors` (named t0, t1, ...)."""
    if torch.is_tensor(obj):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _flatten(v, tensors) for k, v in obj.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):  # optimizer state: by param index
            return {"__int_keys__": {str(k): _flatten(v, tensors) for k, v in obj.items()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in the trainer state")


def _unflatten(obj, tensors: dict):
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__int_keys__"}:
            return {int(k): _unflatten(v, tensors) for k, v in obj["__int_keys__"].items()}
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    return obj


def _remove_stale(out: Path) -> None:
    """Temporaries a killed earlier save left in `out` (SIGKILL skips every cleanup)."""
    remove_stale_tmp(out)
    for name in ("model.safetensors.tmp", "config.json.tmp"):  # an earlier version's save_pretrained temporaries
        (out / name).unlink(missing_ok=True)
    for p in out.glob(".tokenizer.*.tmp"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(model, tok, opt, cfg, step, log, out: Path):
    """Model, tokenizer, log, then the trainer state (last, with the digests of the model and the log)."""
    from safetensors.torch import save_file

    out = Path(out)
    model.save_pretrained(out, tokenizer=tok)  # atomic per file, no temporary left on any exit path
    log_text = json_text(log).encode()
    atomic_write(out / LOG_FILE, log_text)
    tensors: dict = {}
    meta = {"format": STATE_FORMAT, "step": step, "config": cfg.to_dict(), "optimizer": _flatten(opt.state_dict(), tensors),
            "model_sha256": _sha256((out / "model.safetensors").read_bytes()), "log_sha256": _sha256(log_text)}
    atomic_write(out / STATE_FILE, lambda tmp: save_file(tensors, tmp, metadata={"trainer_state": json_text(meta, None)}))
    (out / LEGACY_STATE_FILE).unlink(missing_ok=True)  # an earlier version's pickle must not lie beside it


def read_trainer_state(out: Path) -> tuple[dict, dict]:
    """(metadata, tensors) of `out`'s trainer state; no code is run, whatever the file holds."""
    from safetensors import safe_open

    with safe_open(str(Path(out) / STATE_FILE), "pt") as f:
        meta = json.loads((f.metadata() or {})["trainer_state"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{STATE_FILE} is not a {STATE_FORMAT} trainer state")
    return meta, tensors


def _check_resume_files(out: Path) -> None:
    if not (out / STATE_FILE).is_file():
        if (out / LEGACY_STATE_FILE).is_file():
            raise UserError(f"--resume: {out} holds {LEGACY_STATE_FILE}, an earlier version's trainer state (a "
                            "pickle, which can run code when loaded, so it is not loaded); start over with --overwrite")
        raise UserError(f"--resume: no {STATE_FILE} in {out}")


def load_resume(model, opt, cfg, out: Path):
    _check_resume_files(out)
    saved = FullBandwidthLM.read_config(out)
    mine = model.lm.config.to_dict()
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "n_embd", "n_layer", "n_head", "n_inner")  # n_*: GPT-2 spells its sizes so
    diff = [k for k in keys if saved["base_config"].get(k) != mine.get(k)]
    if diff:
        raise UserError(f"--resume: checkpoint in {out} has another architecture ({', '.join(diff)} differ)")
    try:
        meta, tensors = read_trainer_state(out)
        for name, digest in (("model.safetensors", meta["model_sha256"]), (LOG_FILE, meta["log_sha256"])):
            if not (out / name).is_file():
                raise ValueError(f"no {name}")
            if _sha256((out / name).read_bytes()) != digest:
                raise ValueError(f"{name} is not the one {STATE_FILE} was saved with (a save cut short?)")
        step = meta["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad step {step!r}")
        log = json.loads((out / LOG_FILE).read_text())
        load_weights(model, out / "model.safetensors")  # names, shapes, finite values: one line each
        opt.load_state_dict(_unflatten(meta["optimizer"], tensors))
    except Exception as e:
        raise UserError(f"--resume: corrupt checkpoint in {out}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    return step, log


# ----- output directory --------------------------------------------------------------------------------------
# Every file a run (or the evaluation and card written beside it) puts in its output directory.
RUN_FILES = frozenset({"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", STATE_FILE, LEGACY_STATE_FILE, LOG_FILE, "eval.json",
                       "MODEL_CARD.md"})


def check_output(out: Path, resume: bool, overwrite: bool) -> bool:
    """Refuse (read-only, before any work) what a run may not do to `out`. True: the run is staged beside `out`
    and replaces it whole once complete (--overwrite over an earlier run); False: it writes into `out`."""
    if resume:
        if not out.is_dir():
            raise UserError(f"--resume: no {STATE_FILE} in {out}")
        _check_resume_files(out)
        return False
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir() if not p.name.endswith(".tmp")}  # temporaries: a killed run's
    ours = sorted(names & RUN_FILES)
    if not ours:
        return False
    if not overwrite:
        what = "a checkpoint" if "model.safetensors" in ours else f"files of an earlier run ({', '.join(ours)})"
        raise UserError(f"{out} already holds {what}; use --resume to continue or --overwrite to replace it")
    foreign = sorted(names - RUN_FILES)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise UserError(f"--overwrite: {out} also holds {', '.join(foreign[:3])}{more}, which no training run "
                        "writes; move them away or choose another --out")
    parent = out.resolve().parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--overwrite: the new run is built beside {out} and swapped in at the end, but {parent} "
                        "is not writable")
    return True


def _exchange(a: Path, b: Path) -> None:
    """Swap the names of two directories: atomically where the kernel can (renameat2 RENAME_EXCHANGE), else
    by three renames."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        at_fdcwd, rename_exchange = -100, 2
        if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(b))
    aside = a.with_name(a.name + ".old")
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(aside, b)
        raise
    os.rename(aside, a)


class RunOutput:
    """Where a run writes, for its duration (rank 0 only; other ranks write nothing).

    `out` is locked (`common.io.DirLock`: a second run into it is refused). A staged run writes into a sibling
    folder `.<name>.staging-*` (locked too) that `commit()` swaps in whole; on error or interrupt the staging
    folder is removed and the earlier run in `out` stays as it was. Otherwise checkpoints go into `out` directly.
    """

    def __init__(self, out: Path, staged: bool, active: bool = True):
        self.out, self.staged, self.active = Path(out), staged, active
        self.target = self.out.resolve() if staged else self.out  # a symlinked --out: replace what it points to
        self.path = self.out
        self._locks: list[DirLock] = []

    def _lock(self, path: Path) -> None:
        lock = DirLock(path, "training run")
        lock.__enter__()
        self._locks.append(lock)

    def __enter__(self):
        if not self.active:
            return self
        self._lock(self.out)
        try:
            prefix = f".{self.target.name}.staging-"
            for old in self.target.parent.iterdir():  # a killed run's (any live one would hold the lock on out)
                if old.name.startswith(prefix) and old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
            _remove_stale(self.out)
            if self.staged:
                self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.target.parent))
                os.chmod(self.path, stat.S_IMODE(self.target.stat().st_mode))  # mkdtemp's 0700 would stay
                self._lock(self.path)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def commit(self) -> None:
        if self.active and self.staged:
            try:
                _exchange(self.path, self.target)  # self.path now holds the earlier run, removed on exit
            except OSError as e:
                raise UserError(f"could not move the new run into {self.out} ({e.strerror}); {self.out} still holds "
                                "the earlier run") from None

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.active and self.staged and self.path != self.out:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            for lock in reversed(self._locks):
                lock.__exit__(exc_type, exc, tb)
            self._locks = []
        return False


def _first_nonfinite(model) -> str | None:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return name
    return None


def _context_limit(lm) -> int | None:
    c = lm.config
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


# ----- main --------------------------------------------------------------------------------------------------
def parse_mixture(s: str) -> dict:
    """'0:0.3,8:0.7' -> {0: 0.3, 8: 0.7}: N in 0..MAX_DISTRACTORS, finite weights >= 0."""
    n_of, w_of = int_in(0, MAX_DISTRACTORS), float_in(0.0)
    try:
        return {n_of(k): w_of(v) for k, v in (part.split(":") for part in s.split(",") if part.strip())}
    except (ValueError, argparse.ArgumentTypeError):
        raise UserError(f"bad --distractors {s!r}: use N:weight pairs, N in 0..{MAX_DISTRACTORS} and finite weights "
                        ">= 0, e.g. 0:0.3,8:0.3,32:0.3,128:0.1") from None


def _int(name: str):  # the flag's type: an integer within the recipe's bounds (models.presets.INT_LIMITS)
    return int_in(*INT_LIMITS[name])


def _float(name: str):  # a finite float within models.presets.FLOAT_LIMITS
    lo, hi, lo_open, hi_open = FLOAT_LIMITS[name]
    return float_in(lo, hi, lo_open=lo_open, hi_open=hi_open)


def _range(name: str) -> str:
    """The bound of a flag as --help shows it, e.g. '1..10000000' or '[0, 1]'."""
    if name in INT_LIMITS:
        return "%d..%d" % INT_LIMITS[name]
    lo, hi, lo_open, hi_open = FLOAT_LIMITS[name]
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def parse_args(argv):
    p = Parser(prog="python -m models.train", description=__doc__)
    p.add_argument("--preset", default="tiny-fbt", help=f"training recipe ({', '.join(PRESETS)}); default tiny-fbt")
    p.add_argument("--out", help="output checkpoint dir (default checkpoints/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue from the trainer state in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in --out: the new run is built beside it and swapped in whole once "
                        "its last checkpoint is written (an error or interrupt leaves the earlier run as it was)")
    p.add_argument("--base", help="warm start from an HF causal LM dir or preset (tokenizer of the base is kept)")
    p.add_argument("--steps", type=_int("steps"), help=f"total optimizer steps (overrides the preset); {_range('steps')}")
    p.add_argument("--schedule", help=f"pass-count weights, e.g. 75/22/3 (overrides the preset); finite, at most "
                                      f"{MAX_PASSES}")
    p.add_argument("--noise", type=_float("noise"), help=f"uniform state noise sigma (default 0.02); {_range('noise')}")
    p.add_argument("--lam", type=_float("lam"), help=f"lambda, weight of the later passes; {_range('lam')}")
    p.add_argument("--label-weight", type=_float("label_weight"),
                   help=f"loss weight of the label token; {_range('label_weight')}")
    p.add_argument("--targets", choices=["all", "labels"], help="loss targets: every token (labels weighted by "
                   "--label-weight) or the label tokens alone")
    p.add_argument("--prefix-mix", type=_float("prefix_mix"),
                   help=f"probability of an unfused prefix per row; {_range('prefix_mix')}")
    p.add_argument("--gate-init", choices=["default", "unit"],
                   help="init of the fusion gate W_G: nn.Linear's default, or scaled to unit pre-activation std")
    p.add_argument("--gate-std", type=_float("gate_std"),
                   help="with --gate-init unit: std of the gate's pre-activation at init (default 1; larger = a "
                        f"stronger token code in the fused input); {_range('gate_std')}")
    p.add_argument("--lr-legs", help="comma-separated ends of earlier legs, e.g. 1500,3000: the cosine decays "
                   "toward each in turn, as a run resumed with a larger --steps at each ('' = one cosine; "
                   "default: the preset's, minus legs that do not end before --steps)")
    p.add_argument("--warm-passes", type=_int("warm_passes"),
                   help=f"max extra no-grad Jacobi passes before pass 2 (recipe option); {_range('warm_passes')}")
    p.add_argument("--warm-prob", type=_float("warm_prob"),
                   help=f"probability of warm passes in a multi-pass batch; {_range('warm_prob')}")
    p.add_argument("--fixed-point-prob", type=_float("fixed_point_prob"),
                   help="probability that a multi-pass batch starts its fused passes from the exact fixed point of "
                        "the feedback map (the recurrent-full states; no gradient through it); default 0 = off; "
                        f"{_range('fixed_point_prob')}")
    p.add_argument("--fixed-point-tol", type=_float("fixed_point_tol"),
                   help="fixed-point start: try up to 16 Jacobi passes first and keep them once the largest relative "
                        "state change is below this (cheaper where the map contracts); default 0 = always the exact "
                        f"one-token-step recurrence; {_range('fixed_point_tol')}")
    p.add_argument("--consistency", type=_float("consistency"),
                   help="weight of the state-consistency loss: each fused pass's top state is pulled toward the "
                        "standard pass's (detached) at every fused position, relative squared error; default 0 = off; "
                        f"{_range('consistency')}")
    p.add_argument("--consistency-window", type=_int("consistency_window"),
                   help="add the consistency term again over the last W positions before each label target alone "
                        f"(where a standard pass holds the answer); default 0 = off; {_range('consistency_window')}")
    p.add_argument("--consistency-layers", choices=["top", "all"],
                   help="states the consistency term compares: the top state (default) or every block's output "
                        "(mean of the per-block relative errors)")
    p.add_argument("--depth-scale", action="store_true", help="scale residual-output init by 1/sqrt(2L)")
    p.add_argument("--untied", action="store_true", help="separate input and output embeddings")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                   help="pack several samples per row (--no-packing: one sample per row, a micro-batch per task)")
    p.add_argument("--skip-values", action=argparse.BooleanOptionalAction, default=None,
                   help="no loss on the random value symbols (digits, register names); labels stay targets")
    p.add_argument("--batch-tokens", type=_int("batch_tokens"),
                   help=f"approximate tokens per batch per process; {_range('batch_tokens')}")
    p.add_argument("--lr", type=_float("lr"), help=f"peak learning rate; {_range('lr')}")
    p.add_argument("--tasks", help="comma-separated training tasks (default: all three)")
    p.add_argument("--distractors", help="N mixture as N:weight pairs, e.g. 0:0.3,8:0.3,32:0.3,128:0.1; N in "
                                         f"0..{MAX_DISTRACTORS}, finite weights >= 0 with a positive sum")
    p.add_argument("--task-weights", help="share of each step's tokens per task, one weight per training task in "
                                          "order, e.g. 0.3,0.1,0.6 (unpacked only; default: the preset's); finite, > 0")
    p.add_argument("--objective", choices=["multipass", "recurrent"],
                   help="multipass: the Jacobi objective (pass k fuses pass k-1's states); recurrent: every batch runs "
                        "recurrent-full and backpropagates through the whole recurrence (state tracking)")
    p.add_argument("--dense-targets", action=argparse.BooleanOptionalAction, default=None,
                   help="state-tracking tasks: the running value is a loss target at the end of every update line")
    p.add_argument("--length-doubling", type=_int("length_doubling"),
                   help=f"length curriculum: N <= length-start * 2**(step // this); 0 = off; {_range('length_doubling')}")
    p.add_argument("--length-start", type=_int("length_start"),
                   help=f"largest N in the first leg of the length curriculum; {_range('length_start')}")
    p.add_argument("--reads", type=_int("reads"),
                   help="answered queries inserted into each multi_register training sample (dense supervision of "
                        f"the latest-write lookup; unpacked only); {_range('reads')}")
    p.add_argument("--register-curriculum", type=_int("register_curriculum"),
                   help="steps over which multi_register training samples ramp from 2-register one-write lookups to "
                        f"the task (8 registers, 2/4/8 writes); 0 = off; {_range('register_curriculum')}")
    p.add_argument("--seq-len", type=_int("seq_len"),
                   help=f"packed row length in tokens; {_range('seq_len')} and at most the model's context (max_len; "
                        "the base's with --base)")
    p.add_argument("--curriculum-steps", type=_int("curriculum_steps"),
                   help=f"initial 1-pass steps on short samples; {_range('curriculum_steps')}")
    p.add_argument("--curriculum-max-n", type=_int("curriculum_max_n"),
                   help=f"largest N during the curriculum; {_range('curriculum_max_n')}")
    p.add_argument("--curriculum-seq-len", type=_int("curriculum_seq_len"),
                   help=f"packed row length during the curriculum; {_range('curriculum_seq_len')} and at most the "
                        "model's context, as --seq-len")
    p.add_argument("--seed", type=_int("seed"), help=f"data and init seed; {_range('seed')}")
    p.add_argument("--eval-every", type=_int("eval_every"), help=f"steps between evaluations; {_range('eval_every')}")
    p.add_argument("--save-every", type=_int("save_every"), help=f"steps between checkpoints; {_range('save_every')}")
    p.add_argument("--stop-at", type=int_in(1, MAX_STEPS),
                   help="stop (with a checkpoint) after this step, keeping the learning-rate schedule of --steps; "
                        "continue later with --resume, possibly under another preset (a shared 1-pass phase); "
                        "1..the total steps")
    p.add_argument("--threads", type=int_in(1, 256), help="torch CPU threads (default: all); 1..256")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def config_of(args) -> TrainConfig:
    """The recipe: the preset with the flags' overrides, validated (TrainConfig checks itself)."""
    cfg = get_preset(args.preset)
    over = {k: getattr(args, k) for k in ("steps", "schedule", "noise", "lam", "label_weight", "prefix_mix",
                                          "batch_tokens", "lr", "seed", "eval_every", "save_every", "warm_passes", "warm_prob", "fixed_point_prob", "fixed_point_tol", "consistency", "consistency_window", "consistency_layers",
                                          "seq_len", "reads", "gate_init", "gate_std", "register_curriculum", "targets", "curriculum_steps", "curriculum_max_n", "curriculum_seq_len",
                                          "objective", "dense_targets", "length_doubling", "length_start")
            if getattr(args, k) is not None}
    if args.tasks is not None:
        over["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        if cfg.task_weights is not None and len(over["tasks"]) != len(cfg.tasks):
            # The preset's token shares are per task of ITS task list; keep a share only where the task stays.
            share = dict(zip(cfg.tasks, cfg.task_weights))
            over["task_weights"] = tuple(share.get(t, 1.0 / len(cfg.tasks)) for t in over["tasks"])
    if args.task_weights is not None:
        try:
            over["task_weights"] = tuple(float(x) for x in args.task_weights.split(","))
        except ValueError:
            raise UserError(f"bad --task-weights {args.task_weights!r}: use one number per task, e.g. 0.3,0.1,0.6") from None
    if args.distractors is not None:
        over["distractors"] = parse_mixture(args.distractors)
    if args.lr_legs is not None:
        try:
            over["lr_legs"] = tuple(int(x) for x in args.lr_legs.split(",") if x.strip())
        except ValueError:
            raise UserError(f"--lr-legs must be comma-separated integers, got {args.lr_legs!r}") from None
    elif "steps" in over:  # a shorter run of a legged preset keeps the legs that end before it (one leg of the chain)
        over["lr_legs"] = tuple(e for e in cfg.lr_legs if e < over["steps"])
    if args.depth_scale:
        over["depth_scale"] = True
    if args.packing is not None:
        over["packing"] = args.packing
    if args.untied:
        over["tie_embeddings"] = False
    if args.skip_values is not None:
        over["skip_values"] = args.skip_values
    if args.base:
        over["base"] = args.base
    return replace(cfg, **over)


@cli_entry
def main(argv=None):
    # Everything is checked before any work and before the output directory is touched.
    args = parse_args(argv)
    cfg = config_of(args)
    stop = cfg.steps if args.stop_at is None else args.stop_at
    if not 0 < stop <= cfg.steps:
        raise UserError(f"--stop-at must be in 1..{cfg.steps} (the total steps), got {args.stop_at}")
    out = output_dir(args.out if args.out is not None else checkpoint_dir(args.preset))
    staged = check_output(out, args.resume, args.overwrite)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")

    tok = build_tokenizer()
    if cfg.base:
        from models.presets import load_model
        base, tok, _ = load_model(cfg.base)
        if tok is None:
            raise UserError(f"--base {cfg.base}: no tokenizer found beside the model")
        limit = _context_limit(base.lm)
        if limit and max(cfg.seq_len, cfg.curriculum_seq_len) > limit:
            raise UserError(f"seq_len ({cfg.seq_len}) and curriculum_seq_len ({cfg.curriculum_seq_len}) must be at "
                            f"most the context of --base {cfg.base} ({limit})")
        del base
    model = build_model(cfg, len(tok), cfg.base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    with RunOutput(out, staged, active=rank == 0) as dest:
        step, log = 0, {"config": cfg.to_dict(), "history": [], "evals": []}
        if args.resume:
            step, log = load_resume(model, opt, cfg, out)
            if log.get("config") != cfg.to_dict():
                # Continuing under another recipe (e.g. a 1-pass phase shared by several presets, whose batches
                # are identical by construction): keep a record of what ran when.
                log.setdefault("config_changes", []).append({"step": step, "previous": log.get("config")})
                log["config"] = cfg.to_dict()
        saved = step if args.resume else None
        t0 = time.time() - log.get("wall_s", 0.0)
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, disable=args.no_progress or rank != 0, dynamic_ncols=True)
        run_loss: dict[int, float] = {}
        tokens_seen, tick = 0, time.time()
        try:
            while step < stop:
                micro = make_batches(cfg, tok, step, rank, world)
                gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 97 + rank)
                for g in opt.param_groups:
                    g["lr"] = lr_at(cfg, step)
                opt.zero_grad(set_to_none=False)
                loss, parts, cons_sum = 0.0, None, {}
                for mb in micro:  # gradient accumulation: the step's loss is the mean over its micro-batches
                    ex: dict = {}
                    if cfg.objective == "recurrent":  # backpropagation through the whole recurrence
                        l_mb = dense_loss(recurrent_logits(model, mb.ids, mb.mask), mb.dense) if mb.dense is not None \
                            else ntp_loss(recurrent_logits(model, mb.ids, mb.mask), mb.ids, mb.mask, cfg.label_weight,
                                          mb.label_pos, mb.skip_pos, cfg.targets == "labels")
                        p_mb = [l_mb]
                    else:
                        l_mb, p_mb = multipass_loss(model, mb.ids, mb.mask, mb.k, cfg, mb.fuse_from, gen, mb.warm,
                                                    mb.label_pos, mb.skip_pos, extras=ex, dense=mb.dense)
                    for j, c in enumerate(ex.get("consistency", [])):
                        cons_sum[j] = cons_sum.get(j, 0.0) + c.item() / len(micro)
                    (l_mb / len(micro)).backward()
                    loss = loss + l_mb.detach() / len(micro)
                    parts = [x.detach() / len(micro) for x in p_mb] if parts is None else \
                        [a + x.detach() / len(micro) for a, x in zip(parts, p_mb)]
                k, n = micro[0].k, "; ".join(mb.desc for mb in micro)
                mask = torch.cat([mb.mask.flatten() for mb in micro])
                if world > 1:
                    import torch.distributed as dist
                    for p in model.parameters():
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad)
                        p.grad /= world
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
                lv = float(loss)
                bad = None if math.isfinite(lv) and math.isfinite(grad_norm) else \
                    f"loss {lv}, gradient norm {grad_norm}"
                if bad is None:
                    opt.step()
                    name = _first_nonfinite(model)
                    bad = None if name is None else f"parameter {name} after the update"
                if bad is not None:  # a NaN/inf run is stopped, never saved
                    kept = (f"{out} still holds the earlier run" if staged else
                            f"the last checkpoint in {out} is step {saved}" if saved else "nothing was saved")
                    raise UserError(f"training diverged at step {step + 1}: non-finite {bad}; stopped ({kept})")
                step += 1
                tokens_seen += int(mask.sum()) * k
                run_loss[k] = 0.9 * run_loss.get(k, lv) + 0.1 * lv
                if rank == 0:
                    log["history"].append({"step": step, "passes": k, "batch": n, "loss": round(lv, 5),
                                           "pass_losses": [round(x.item(), 5) for x in parts],
                                           **({"consistency": [round(cons_sum[j], 5) for j in sorted(cons_sum)]}
                                              if cons_sum else {})})
                    el = time.time() - tick
                    bar.set_postfix({**{f"loss{kk}": f"{v:.3f}" for kk, v in sorted(run_loss.items())},
                                     "tok/s": f"{tokens_seen / max(el, 1e-9):.0f}"})
                    bar.update(1)
                    if step % cfg.eval_every == 0 or step == cfg.steps:
                        ev = quick_eval(model, tok, cfg)
                        log["evals"].append({"step": step, "wall_s": round(time.time() - t0, 1), "label_acc": ev})
                        bar.write(f"step {step}: " + "; ".join(
                            f"{t} " + " ".join(f"{m}={a:.2f}" for m, a in r.items()) for t, r in ev.items()))
                    if step % cfg.save_every == 0 or step in (cfg.steps, stop):
                        log["wall_s"] = round(time.time() - t0, 1)
                        save_checkpoint(model, tok, opt, cfg, step, log, dest.path)
                        saved = step
        finally:
            bar.close()
        dest.commit()
    if rank == 0:
        print(f"done: {step} steps in {time.time() - t0:.0f}s -> {out}")
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
