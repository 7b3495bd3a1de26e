"""The multi-pass (Jacobi) trainer, docs/design.md (Training): the K-pass loss against a hand-written reference, gradients
through every pass, the prefix mixin, bit-identical resume, flags derived from the recipe, and clean CLI errors
(several processes: tests/test_ddp.py).

Kept cheap (the CI box has 2 shared cores): tiny models, the `smoke` preset, training runs in-process through
`main(argv)` where a subprocess would only add interpreter start-up; the real CLI is exercised by one
subprocess error case (and the torchrun run of tests/test_ddp.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import numpy as np
import torch

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM, decoder_layers
from training.config import TrainConfig
from training.presets import PRESETS, get_preset
import training.checkpoint as tckpt
import training.cli as tcli
import training.data as tdata
import training.loop as tloop
import training.loss as tloss
import training.model as tmodel

ROOT = Path(__file__).resolve().parent.parent
CKPT_FILES = ("model.safetensors", "config.json", "trainer_state.safetensors", "train_log.json")
FAST = ["--preset", "smoke", "--threads", "1", "--no-progress"]


# ----- hand-written reference ----------------------------------------------------------------------------------
def _batch(seed=0, rows=3, width=12, vocab=50):
    """Left-padded ids/mask with rows of different lengths (row 0 full, others padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, rows):
        pad = 2 * r + 1
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    return ids, mask


def _ref_forward(model, x, mask):
    """The wrapped HF model on given block-0 inputs (positions = count of real tokens before), tied LM head."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    top = model.lm.base_model(inputs_embeds=x, attention_mask=mask, position_ids=pos).last_hidden_state
    return top, top @ model.lm.get_input_embeddings().weight.T


def _ref_states(model, x, mask, cfg):
    """The states the consistency term compares: the top, or every block's output (the last one normed)."""
    if cfg.consistency_layers == "top":
        return [_ref_forward(model, x, mask)[0]]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model.lm.base_model(inputs_embeds=x, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    return list(out.hidden_states[1:])


def _ref_fuse(model, h_prev, e):
    """u = RMSNorm((W_U h_{t-1}) * sigmoid(W_G e_t)), written out."""
    f = model.fusion
    v = (h_prev @ f.up.weight.T) * torch.sigmoid(e @ f.gate.weight.T)
    return f.norm.weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + f.norm.eps)


def _ref_ntp(logits, ids, mask, label_weight):
    """Mean NTP over real (t, t+1) pairs; the target in the last column (the label token) weighs label_weight."""
    lp = torch.log_softmax(logits.float(), -1)
    num, den = 0.0, 0.0
    rows, width = ids.shape
    for b in range(rows):
        for t in range(width - 1):
            if mask[b, t] and mask[b, t + 1]:
                w = label_weight if t + 1 == width - 1 else 1.0
                num = num - w * lp[b, t, ids[b, t + 1]]
                den += w
    return num / den


def _ref_multipass(model, ids, mask, k, cfg, fuse_from=None, generator=None):
    rows, width = ids.shape
    e = model.lm.get_input_embeddings()(ids)
    top, logits = _ref_forward(model, e, mask)  # pass 1: plain teacher forcing
    losses = [_ref_ntp(logits, ids, mask, cfg.label_weight)]
    # consistency: fused passes pulled toward pass 1's states, no gradient into them
    target, cons = [h.detach() for h in _ref_states(model, e, mask, cfg)], []
    for _ in range(2, k + 1):
        noise = None
        if cfg.noise > 0:  # U[-sigma, sigma] on the carried state, one draw of the whole grid per pass
            noise = (torch.rand(top.shape, generator=generator, dtype=top.dtype) * 2 - 1) * cfg.noise
        x = e.clone()
        fused = []
        for b in range(rows):
            for t in range(1, width):
                if mask[b, t - 1] and mask[b, t] and (fuse_from is None or t >= int(fuse_from[b])):
                    h = top[b, t - 1] if noise is None else top[b, t - 1] + noise[b, t]
                    x[b, t] = _ref_fuse(model, h, e[b, t])
                    fused.append((b, t))
        top, logits = _ref_forward(model, x, mask)
        losses.append(_ref_ntp(logits, ids, mask, cfg.label_weight))
        hs = _ref_states(model, x, mask, cfg)
        rel = {(b, t): sum((h[b, t] - g[b, t]).pow(2).sum() / g[b, t].pow(2).sum() for h, g in zip(hs, target))
               / len(hs) for b, t in fused}
        near = [bt for bt in fused if width - 1 - cfg.consistency_window <= bt[1] < width - 1]  # before the label
        cons.append(sum(rel.values()) / len(rel) + (sum(rel[bt] for bt in near) / len(near) if near else 0.0))
    total = losses[0] + cfg.lam / (k - 1) * sum(losses[1:]) if k > 1 else losses[0]
    if k > 1 and cfg.consistency > 0:
        total = total + cfg.consistency / (k - 1) * sum(cons)
    return total, losses


def _cfg(**kw):
    return replace(get_preset("smoke"), **{"noise": 0.0, "lam": 0.7, "label_weight": 3.0, **kw})


def _close(a, b):
    return torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
@torch.no_grad()
def test_multipass_loss_matches_hand_written_reference(tiny_model, k):
    ids, mask = _batch()
    cfg = _cfg()
    total, parts = tloss.multipass_loss(tiny_model, ids, mask, k, cfg)
    ref_total, ref_parts = _ref_multipass(tiny_model, ids, mask, k, cfg)
    assert len(parts) == k
    for p, r in zip(parts, ref_parts):
        assert _close(p, r), (p, r)
    assert _close(total, ref_total), (total, ref_total)
    # Later passes really see different inputs (the fused state), so the test is not vacuous.
    if k > 1:
        assert not _close(parts[1], parts[0])


@torch.no_grad()
def test_multipass_loss_with_prefix_and_noise_is_reproduced(make_tiny_config):
    tiny_model = FullBandwidthLM.from_config(make_tiny_config("qwen3"), seed=0).eval()
    ids, mask = _batch(seed=1)
    cfg = _cfg(noise=0.05)
    fuse_from = torch.tensor([5, 7, 6])
    total, parts = tloss.multipass_loss(tiny_model, ids, mask, 3, cfg, fuse_from, torch.Generator().manual_seed(7))
    ref_total, ref_parts = _ref_multipass(tiny_model, ids, mask, 3, cfg, fuse_from, torch.Generator().manual_seed(7))
    assert all(_close(p, r) for p, r in zip(parts, ref_parts)) and _close(total, ref_total)
    again, _ = tloss.multipass_loss(tiny_model, ids, mask, 3, cfg, fuse_from, torch.Generator().manual_seed(7))
    assert torch.equal(again, total)  # same generator seed: bit-identical
    quiet, _ = tloss.multipass_loss(tiny_model, ids, mask, 3, _cfg(), fuse_from)
    other, _ = tloss.multipass_loss(tiny_model, ids, mask, 3, cfg, fuse_from, torch.Generator().manual_seed(8))
    assert not _close(quiet, total) and not _close(other, total)  # the noise is really applied


@pytest.mark.parametrize("k, window, layers", [(2, 0, "top"), (3, 0, "top"), (3, 3, "top"), (3, 3, "all")])
def test_consistency_loss_matches_the_reference_and_keeps_pass1_as_target(make_tiny_config, k, window, layers):
    # Relative squared distance of each fused pass's top state to pass 1's, over the fused positions (prefix and
    # padding excluded), weighted consistency / (K - 1); pass 1's states are a target, not trained by it.
    model = FullBandwidthLM.from_config(make_tiny_config("qwen3"), seed=0).train()
    ids, mask = _batch(seed=3)
    fuse_from = torch.tensor([4, 6, 8])
    cfg = _cfg(consistency=2.5, consistency_window=window, consistency_layers=layers)
    grads, totals = [], []
    for fn in (tloss.multipass_loss, _ref_multipass):
        model.zero_grad()
        total = fn(model, ids, mask, k, cfg, fuse_from)[0]
        total.backward()
        totals.append(total.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert _close(totals[0], totals[1])
    for n in grads[0]:
        # every block's term: gradients ~4 in magnitude, float32 sums in another order
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-5), n
    ex: dict = {}
    with torch.no_grad():
        off = tloss.multipass_loss(model, ids, mask, k, _cfg(), fuse_from)[0]
        on, parts = tloss.multipass_loss(model, ids, mask, k, cfg, fuse_from, extras=ex)
    assert len(ex["consistency"]) == k - 1 and all(c > 0 for c in ex["consistency"])  # not vacuous
    assert _close(on - off, cfg.consistency / (k - 1) * sum(ex["consistency"]))
    if window:  # the window term is really there
        plain = tloss.multipass_loss(model, ids, mask, k, _cfg(consistency=2.5), fuse_from)[0]
        assert on - plain > 1e-4
    with pytest.raises(UserError, match="consistency"):
        _cfg(consistency=-1.0)
    if layers == "all":  # not the top-only term
        top_only = tloss.multipass_loss(model, ids, mask, k, replace(cfg, consistency_layers="top"), fuse_from)[0]
        assert not _close(on, top_only)
    with pytest.raises(UserError, match="consistency_window"):
        _cfg(consistency_window=-1)
    with pytest.raises(UserError, match="consistency_layers"):
        _cfg(consistency_layers="some")


def _ref_fixed_point(model, ids, mask, fuse_from):
    """The recurrence written out: position t's input fuses the top state of t-1 from this same run."""
    rows, width = ids.shape
    e = model.lm.get_input_embeddings()(ids)
    x, top = e.clone(), torch.zeros(rows, width, model.d_model)
    for t in range(width):
        for b in range(rows):
            if t > 0 and mask[b, t - 1] and mask[b, t] and t >= int(fuse_from[b]):
                x[b, t] = _ref_fuse(model, top[b, t - 1], e[b, t])
        top[:, t] = _ref_forward(model, x[:, :t + 1], mask[:, :t + 1])[0][:, t]
    return top


@torch.no_grad()
def test_fixed_point_start_matches_the_written_out_recurrence(tiny_model):
    from engine.prefill import fixed_point_top, shift_state
    ids, mask = _batch(seed=2)
    fuse_from = torch.tensor([3, 7, 9])
    real = mask.bool()
    ref = _ref_fixed_point(tiny_model, ids, mask, fuse_from)
    fuse = shift_state(torch.zeros(*ids.shape, 1), mask)[1] & (torch.arange(ids.shape[1])[None] >= fuse_from[:, None])
    got = fixed_point_top(tiny_model, ids, mask, fuse)
    # float32 rounding compounds along the recurrence (12 steps here: up to ~6e-6), hence a looser atol
    assert torch.allclose(got[real], ref[real], rtol=1e-4, atol=1e-5)
    # It is the limit of the Jacobi passes (exact after T of them), and not already reached after a few.
    cfg = _cfg()
    T = ids.shape[1]
    ends = {}
    for warm in (2, T, tdata.FIXED_POINT):
        ends[warm] = tloss.multipass_loss(tiny_model, ids, mask, 3, cfg, fuse_from, warm=warm)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(ends[T][1], ends[tdata.FIXED_POINT][1]))
    # The trainer's tolerance path (16 Jacobi passes >= T + 1 here, so they converge) trains on the same start.
    tol = tloss.multipass_loss(tiny_model, ids, mask, 3, replace(cfg, fixed_point_tol=1e-5), fuse_from,
                               warm=tdata.FIXED_POINT)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(tol[1], ends[tdata.FIXED_POINT][1]))
    assert not _close(ends[2][1][1], ends[tdata.FIXED_POINT][1][1])
    assert _close(ends[2][1][0], ends[tdata.FIXED_POINT][1][0])  # pass 1 does not depend on the start


@torch.no_grad()
def test_fixed_point_tolerance_path_lands_on_the_exact_fixed_point(tiny_model, monkeypatch):
    """fixed_point_top(tol=...): Jacobi passes until the state stops moving, else the exact recurrence."""
    import engine.prefill as prefill
    ids, mask = _batch(seed=4)
    fuse = prefill.shift_state(torch.zeros(*ids.shape, 1), mask)[1] & (torch.arange(ids.shape[1])[None] >= 2)
    real = mask.bool()
    exact = prefill.fixed_point_top(tiny_model, ids, mask, fuse)
    T = ids.shape[1]

    def no_recurrence(*a, **k):
        raise AssertionError("the exact recurrence ran although the Jacobi passes had converged")

    # T Jacobi passes are exact (causal map), so pass T + 1 changes nothing: this must return from the Jacobi
    # path alone, and equal the recurrence.
    with monkeypatch.context() as m:
        m.setattr(prefill, "recurrent_run", no_recurrence)
        jac = prefill.fixed_point_top(tiny_model, ids, mask, fuse, tol=1e-5, max_jacobi=T + 1)
    assert torch.allclose(jac[real], exact[real], rtol=1e-4, atol=1e-5)
    # Not converged within the allowed passes: the exact recurrence, not the last Jacobi iterate.
    one = prefill.fixed_point_top(tiny_model, ids, mask, fuse, tol=1e-12, max_jacobi=1)
    assert torch.allclose(one[real], exact[real], rtol=1e-4, atol=1e-5)
    std = tiny_model(ids, mask).top
    two_passes = std
    for _ in range(2):
        two_passes = tiny_model(ids, mask, state=prefill.shift_state(two_passes, mask)[0], fuse_mask=fuse).top
    assert not torch.allclose(two_passes[real], exact[real], rtol=1e-4, atol=1e-5)  # so the case above is not trivial
    # Many short rows: straight to the exact recurrence (cheaper there), whatever the tolerance.
    with monkeypatch.context() as m:
        m.setattr(prefill, "JACOBI_MAX_ROWS", 2)
        calls = []
        m.setattr(prefill, "recurrent_run",
                  lambda *a, **k: calls.append(1) or prefill.RecurrentRun(None, None, None, exact, None, None))
        prefill.fixed_point_top(tiny_model, ids, mask, fuse, tol=0.5)
    assert calls == [1]


def test_fixed_point_batches_are_drawn_only_when_asked():
    rng_draws = lambda cfg: [tdata._passes(cfg, s, np.random.default_rng(s)) for s in range(200)]
    base = _cfg(warm_passes=3, warm_prob=0.5, curriculum_steps=0)
    off, on = rng_draws(base), rng_draws(replace(base, fixed_point_prob=0.5))
    assert [k for k, _ in off] == [k for k, _ in on]  # the same pass counts
    fp = [w == tdata.FIXED_POINT for k, w in on if k > 1]
    assert 0.3 < np.mean(fp) < 0.7 and not any(w == tdata.FIXED_POINT for _, w in off)
    assert all(w == tdata.FIXED_POINT or w == w0 for (_, w), (_, w0) in zip(on, off))
    with pytest.raises(UserError, match="fixed_point_prob"):
        replace(base, fixed_point_prob=1.5)
    for bad in (-0.1, 1.0):
        with pytest.raises(UserError, match="fixed_point_tol"):
            replace(base, fixed_point_tol=bad)


def test_ntp_loss_weights_the_label_token():
    g = torch.Generator().manual_seed(0)
    ids, mask = _batch()
    logits = torch.randn(*ids.shape, 50, generator=g)
    for lw in (1.0, 5.0):
        assert _close(tloss.ntp_loss(logits, ids, mask, lw), _ref_ntp(logits, ids, mask, lw))


def test_labels_only_loss_is_the_label_cross_entropy():
    g = torch.Generator().manual_seed(0)
    ids, mask = _batch()
    logits = torch.randn(*ids.shape, 50, generator=g)
    label_pos = torch.zeros_like(ids, dtype=torch.bool)
    label_pos[:, -1] = True
    label_pos[0, 5] = True  # a second answer inside a row (as the training-only reads)
    lp = torch.log_softmax(logits, -1)
    want = -torch.stack([lp[0, 4, ids[0, 5]], *[lp[b, -2, ids[b, -1]] for b in range(ids.shape[0])]]).mean()
    for lw in (1.0, 20.0):  # label_weight plays no part
        got = tloss.ntp_loss(logits, ids, mask, lw, label_pos, labels_only=True)
        assert _close(got, want), (got, want)
    assert not _close(tloss.ntp_loss(logits, ids, mask, 20.0, label_pos), want)
    assert "targets" not in _cfg().to_dict() and _cfg(targets="labels").to_dict()["targets"] == "labels"
    with pytest.raises(UserError, match="targets"):
        _cfg(targets="some")


# ----- gradients -----------------------------------------------------------------------------------------------
class _Recorder(torch.nn.Module):
    """Passes calls through and keeps every pass's top state with retain_grad()."""

    def __init__(self, model):
        super().__init__()
        self.model, self.tops = model, []

    def token_gate(self, ids):
        return self.model.token_gate(ids)

    def forward(self, *a, **kw):
        out = self.model(*a, **kw)
        out.top.retain_grad()
        self.tops.append(out.top)
        return out


@pytest.mark.parametrize("k", [2, 3])
def test_later_pass_losses_reach_pass1_activations(make_tiny_config, k):
    model = FullBandwidthLM.from_config(make_tiny_config("qwen3"), seed=0).train()
    rec = _Recorder(model)
    ids, mask = _batch()
    _, parts = tloss.multipass_loss(rec, ids, mask, k, _cfg(noise=0.02), generator=torch.Generator().manual_seed(0))
    assert len(rec.tops) == k
    parts[-1].backward()  # the last pass's loss alone
    for j in range(k - 1):  # every earlier pass gets a gradient through the carried state: nothing detached
        g = rec.tops[j].grad
        assert g is not None and g[0, :-1].abs().sum() > 0, j
        # Shift by exactly one: the last column's state is never fed forward.
        assert torch.count_nonzero(g[:, -1]) == 0
    # The fusion weights are trained by the later-pass loss.
    assert model.fusion.up.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("k", [2, 3])
def test_multipass_gradients_match_the_reference(make_tiny_config, k):
    # The trainer computes sigmoid(W_G e) once per batch and reuses it in every pass; the reference recomputes it
    # per position and pass. Every parameter's gradient (W_G's summed over the passes included) must agree.
    model = FullBandwidthLM.from_config(make_tiny_config("qwen3"), seed=0).train()
    ids, mask = _batch()
    cfg = _cfg()
    grads = []
    for fn in (tloss.multipass_loss, _ref_multipass):
        model.zero_grad()
        fn(model, ids, mask, k, cfg)[0].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "fusion.gate.weight" in grads[0]
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6), n
    assert grads[0]["fusion.gate.weight"].abs().sum() > 0


# ----- unpacked batches ----------------------------------------------------------------------------------------
def test_unpacked_batches_one_sample_per_row():
    """packing=False: one micro-batch per task, one whole sample per row (label last), one N per micro-batch,
    deterministic in (seed, step); random value symbols are skipped as targets, labels never are."""
    from tasks import build_tokenizer, label_token_ids

    tok = build_tokenizer()
    cfg = replace(get_preset("smoke"), packing=False, skip_values=True, batch_tokens=600,
                  distractors={0: 0.5, 8: 0.5})
    micro = tdata.make_batches(cfg, tok, 3)
    again = tdata.make_batches(cfg, tok, 3)
    assert [m.desc.split("/")[0] for m in micro] == list(cfg.tasks)
    assert len({m.k for m in micro}) == 1
    values = set(tdata.value_token_ids(tok))
    nl = tok.convert_tokens_to_ids("\n")
    for m, m2, task in zip(micro, again, cfg.tasks):
        assert torch.equal(m.ids, m2.ids) and torch.equal(m.skip_pos, m2.skip_pos)
        words = label_token_ids(tok, task)
        assert bool(m.mask.all()) and not bool(m.skip_pos[:, -1].any())
        assert bool(m.label_pos[:, -1].all()) and int(m.label_pos.sum()) == m.ids.shape[0]
        assert set(m.ids[:, -1].tolist()) <= set(words)
        # rows are single samples: the prompt's final token sits right before the label, nowhere else
        colon = tok.convert_tokens_to_ids(":")
        assert bool((m.ids[:, -2] == colon).all()) and int((m.ids == colon).sum()) == m.ids.shape[0]
        assert not bool((m.ids == nl)[:, -2:].any())
        is_value = torch.isin(m.ids, torch.tensor(sorted(values)))
        assert torch.equal(m.skip_pos, is_value & ~m.label_pos)
    # task_weights set each task's share of the step's tokens
    cfg_w = replace(cfg, task_weights=(0.7, 0.15, 0.15), distractors={0: 1.0})
    sizes = [m.ids.numel() for m in tdata.make_batches(cfg_w, tok, 3)]
    assert sizes[0] > 3 * sizes[1] and sum(sizes) <= cfg_w.batch_tokens + max(sizes)


# ----- prefix mixin --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
@torch.no_grad()
def test_prefix_mixin_keeps_prefix_inputs_unfused(k):
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = replace(get_preset("smoke"), prefix_mix=1.0, noise=0.0)
    batch = tdata.make_batch(cfg, tok, 0)
    ids, mask, fuse_from = batch.ids, batch.mask, batch.fuse_from
    start = ids.shape[1] - mask.sum(-1)
    assert bool((fuse_from >= start).all()) and bool((fuse_from < ids.shape[1]).all())
    assert bool((fuse_from > start).any())  # prefix_mix=1: some rows do have a prefix

    model = tmodel.build_model(cfg, len(tok)).eval()
    inputs = []
    hook = decoder_layers(model.lm)[0].register_forward_pre_hook(
        lambda mod, args, kwargs: inputs.append((args[0] if args else kwargs["hidden_states"]).clone()),
        with_kwargs=True)
    try:
        tloss.multipass_loss(model, ids, mask, k, cfg, fuse_from)
    finally:
        hook.remove()
    assert len(inputs) == k
    emb = model.embed(ids)
    assert torch.equal(inputs[0], emb)  # pass 1 is plain
    cols = torch.arange(ids.shape[1])[None]
    for j in range(1, k):
        prefix = (cols < fuse_from[:, None]) & mask.bool()
        suffix = (cols >= fuse_from[:, None]) & (cols > start[:, None])  # previous column is a real token
        assert torch.equal(inputs[j][prefix], emb[prefix]), j
        # Suffix: the fused input from the previous pass's top state (recomputed from that pass's block-0 input).
        fused = _ref_fuse(model, torch.roll(_top_from_input(model, inputs[j - 1], mask), 1, dims=1), emb)
        assert torch.allclose(inputs[j][suffix], fused[suffix], atol=1e-5), j
        assert not torch.allclose(inputs[j][suffix], emb[suffix])


def _top_from_input(model, x, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model.lm.base_model(inputs_embeds=x, attention_mask=mask, position_ids=pos).last_hidden_state


# ----- CLI runs (in-process) -----------------------------------------------------------------------------------
def _snapshot(path: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()} if path.exists() else {}


class _Stop(Exception):
    pass


def _cheap_eval(model, tok, cfg, context=None):
    # quick_eval costs seconds per call on a shared CPU; the mode toggling (all it does to the model) is kept.
    model.eval()
    model.train()
    return {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step smoke run straight, and the same recipe stopped after its step-2 checkpoint then resumed."""
    base = tmp_path_factory.mktemp("runs")
    straight, split, stopped = base / "straight", base / "split", base / "stopped"
    real_save = tloop.save_checkpoint

    def save_then_stop(model, tok, opt, cfg, step, log, out):
        real_save(model, tok, opt, cfg, step, log, out)
        if step == 2:
            raise _Stop  # as if the job were killed right after its step-2 checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tloop, "quick_eval", _cheap_eval)
        tcli.main(FAST + ["--out", str(straight), "--steps", "4", "--save-every", "2"])
        mp.setattr(tloop, "save_checkpoint", save_then_stop)
        with pytest.raises(_Stop):
            tcli.main(FAST + ["--out", str(split), "--steps", "4", "--save-every", "2"])
        shutil.copytree(split, stopped)
        mp.setattr(tloop, "save_checkpoint", real_save)
        tcli.main(FAST + ["--out", str(split), "--steps", "4", "--save-every", "2", "--resume"])
    return {"straight": straight, "split": split, "stopped": stopped}


def test_resume_continues_bit_identically(runs):
    from safetensors.torch import load_file

    a = load_file(str(runs["straight"] / "model.safetensors"))
    b = load_file(str(runs["split"] / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    log_a = json.loads((runs["straight"] / "train_log.json").read_text())
    log_b = json.loads((runs["split"] / "train_log.json").read_text())
    assert [h["step"] for h in log_b["history"]] == [1, 2, 3, 4]
    assert log_a["history"] == log_b["history"]  # losses per step and per pass, batches, pass counts
    assert "config_changes" not in log_b, "a plain resume is not a change of recipe"
    sa, sb = (tckpt._unflatten(m["optimizer"], t) | {"step": m["step"]}
              for m, t in (tckpt.read_trainer_state(runs[r]) for r in ("straight", "split")))
    assert sa["step"] == sb["step"] == 4
    for pa, pb in zip(sa["state"].values(), sb["state"].values()):
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
    # Training did move the weights between step 2 and 4 (a resume that silently did nothing would fail above
    # only if the straight run were also a no-op).
    mid = load_file(str(runs["stopped"] / "model.safetensors"))
    assert any(not torch.equal(mid[k], a[k]) for k in a)
    # The history covers several pass counts, so the resumed steps exercise the multi-pass path.
    assert len({h["passes"] for h in log_a["history"]}) > 1


def test_resume_into_a_one_pass_step_is_bit_identical(tmp_path, monkeypatch):
    """Resumed after step 1 (3 passes) into step 2 (1 pass, the fusion unused): AdamW must go on stepping the
    fusion from its zero gradient as the straight run does (a fresh process once skipped it)."""
    from safetensors.torch import load_file

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    argv = FAST + ["--steps", "3", "--eval-every", "1000", "--save-every", "1000"]
    tcli.main(argv + ["--out", str(tmp_path / "straight")])
    tcli.main(argv + ["--out", str(tmp_path / "split"), "--stop-at", "1"])
    tcli.main(argv + ["--out", str(tmp_path / "split"), "--resume"])
    passes = [h["passes"] for h in json.loads((tmp_path / "straight" / "train_log.json").read_text())["history"]]
    assert passes[0] > 1 and passes[1] == 1  # the case this test is about
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_attention_dropout_is_bit_identical(tmp_path, monkeypatch):
    """Dropout masks come from torch's global generator, which the trainer state keeps: a resumed run draws the
    masks the straight run drew (it replayed the stream from the start)."""
    from safetensors.torch import load_file

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    argv = FAST + ["--steps", "4", "--attn-dropout", "0.1", "--eval-every", "1000", "--save-every", "1000"]
    tcli.main(argv + ["--out", str(tmp_path / "straight")])
    tcli.main(argv + ["--out", str(tmp_path / "split"), "--stop-at", "2"])
    tcli.main(argv + ["--out", str(tmp_path / "split"), "--resume"])
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_looped_model_resumes_bit_identically(tmp_path, monkeypatch):
    """A looped model (models.looped) saves its physical blocks and runs with the core unrolled: the resume check
    compares the physical ones (it compared the unrolled count, and refused every looped run)."""
    from safetensors.torch import load_file

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    argv = ["--preset", "tiny-loop-track", "--n-layers", "3", "--loop-prelude", "1", "--loop-core", "1", "--d-model",
            "32", "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "64", "--batch-tokens", "300", "--steps", "4",
            "--warmup", "2", "--eval-every", "1000", "--save-every", "1000", "--loop-truncate", "2", "--threads", "1",
            "--no-progress"]
    tcli.main(argv + ["--out", str(tmp_path / "straight")])
    tcli.main(argv + ["--out", str(tmp_path / "split"), "--stop-at", "2"])
    tcli.main(argv + ["--out", str(tmp_path / "split"), "--resume"])
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_logged_config_reads_back_as_the_recipe(name, tmp_path):
    """A resume compares the config read back from train_log.json with to_dict(): equal, or every resume looks
    like a change of recipe (the shipped presets' tuple task_weights once did). And the logged config is the
    whole recipe: rebuilt from it, the preset comes back (to_dict leaves out only options that are off)."""
    from common.io import json_text

    cfg = get_preset(name)
    (tmp_path / "log.json").write_text(json_text({"config": cfg.to_dict()}))  # as save_checkpoint writes the log
    logged = json.loads((tmp_path / "log.json").read_text())["config"]
    assert logged == cfg.to_dict()
    assert TrainConfig(**logged) == cfg
    assert replace(cfg, seed=cfg.seed + 1).to_dict() != logged  # the comparison does tell recipes apart


def test_lr_legs_follow_the_cosine_of_each_leg():
    cfg = replace(get_preset("smoke"), steps=40, warmup=5, lr_legs=(10, 25))
    for end, steps in ((10, range(0, 10)), (25, range(10, 25)), (40, range(25, 40))):
        leg = replace(cfg, steps=end, lr_legs=())
        assert all(tloop.lr_at(cfg, s) == tloop.lr_at(leg, s) for s in steps)
    # Each new leg jumps back up to where the longer cosine stands, then decays to the floor at its end.
    assert tloop.lr_at(cfg, 10) > tloop.lr_at(cfg, 9) and tloop.lr_at(cfg, 25) > tloop.lr_at(cfg, 24)
    assert tloop.lr_at(cfg, 39) == pytest.approx(0.1 * cfg.lr, rel=0.05)  # one step short of the floor


def test_lr_legs_run_equals_the_chain_of_resumed_runs(tmp_path, monkeypatch):
    """One run with --lr-legs 3 is bit-identical to a 3-step run resumed with --steps 6 (how tiny-fbt was made)."""
    from safetensors.torch import load_file

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    one, chain = tmp_path / "one", tmp_path / "chain"
    tcli.main(FAST + ["--out", str(one), "--steps", "6", "--lr-legs", "3"])
    tcli.main(FAST + ["--out", str(chain), "--steps", "3"])
    tcli.main(FAST + ["--out", str(chain), "--steps", "6", "--resume"])
    a, b = load_file(str(one / "model.safetensors")), load_file(str(chain / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    log_a = json.loads((one / "train_log.json").read_text())
    log_b = json.loads((chain / "train_log.json").read_text())
    assert log_a["history"] == log_b["history"] and len(log_a["history"]) == 6
    assert log_a["config"]["lr_legs"] == [3] and "lr_legs" not in log_b["config"]
    from training.card import write_card
    for run in (one, chain):  # the card names the legs either way
        assert "re-spread at steps 3 (legs)" in write_card(run, "cmd")
    # A --steps override of a legged preset keeps only the legs that end before it, so the chain's legs can be
    # run from the preset as they were (without the filter, --steps 2 under legs (2,) would be an error).
    legged = replace(get_preset("smoke"), lr_legs=(2,))
    monkeypatch.setattr(tcli, "get_preset", lambda name: replace(legged))
    for steps, want in ((2, None), (3, [2])):
        tcli.main(FAST + ["--out", str(tmp_path / f"legged{steps}"), "--steps", str(steps)])
        cfg = json.loads((tmp_path / f"legged{steps}" / "train_log.json").read_text())["config"]
        assert cfg.get("lr_legs") == want and cfg["steps"] == steps


def test_shared_one_pass_phase_then_another_preset_is_identical(tmp_path, monkeypatch):
    """A 1-pass run stopped with --stop-at and resumed under the multi-pass recipe equals that recipe run
    straight: the curriculum phase is identical for every schedule, so presets can share it exactly."""
    from safetensors.torch import load_file

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    common = FAST + ["--steps", "4", "--save-every", "2", "--curriculum-steps", "2"]
    tcli.main(common + ["--out", str(tmp_path / "straight")])
    tcli.main(common + ["--out", str(tmp_path / "shared"), "--schedule", "1", "--stop-at", "2"])
    assert json.loads((tmp_path / "shared" / "train_log.json").read_text())["history"][-1]["step"] == 2
    tcli.main(common + ["--out", str(tmp_path / "shared"), "--resume"])
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "shared" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((tmp_path / "shared" / "train_log.json").read_text())
    assert log["config"]["schedule"] != "1" and log["config_changes"][0]["previous"]["schedule"] == "1"
    assert log["config_changes"][0]["step"] == 2


def test_checkpoint_loads_as_a_model(runs):
    model = FullBandwidthLM.from_pretrained(runs["straight"])
    assert model.has_fusion and model.n_layers == get_preset("smoke").n_layers


# ----- bad input -----------------------------------------------------------------------------------------------
def _expect_error(argv, capsys, match):
    with pytest.raises(SystemExit) as e:
        tcli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert re.search(match, err), err
    return err


@pytest.mark.parametrize("argv, match", [
    (["--preset", "no-such-preset"], "unknown preset 'no-such-preset'"),
    (["--schedule", "75/x"], "bad schedule '75/x'"),
    (["--schedule", ""], "bad schedule ''"),
    (["--schedule=-1/2"], "bad schedule '-1/2'"),
    (["--schedule", "0/0"], "bad schedule '0/0'"),
    (["--lr-legs", "3,2"], "lr_legs must be increasing"),
    (["--steps", "4", "--lr-legs", "4"], "lr_legs must be increasing"),
    (["--lr-legs", "two"], "--lr-legs must be comma-separated integers"),
    (["--task-weights", "0.3,x,0.6"], "bad --task-weights '0.3,x,0.6'"),
    (["--task-weights", "1,2"], "task_weights needs one positive weight per task"),
    (["--task-weights", "1,0,2"], "task_weights needs one positive weight per task"),
    # a warm-up past the run never reached the learning rate (tiny-fbt's 50 steps under --steps 10); a batch below
    # one packed row trained a whole row
    (["--preset", "tiny-fbt", "--steps", "10"], r"warmup \(50 steps\) is longer than the run \(steps 10\)"),
    (["--batch-tokens", "1"], r"batch_tokens \(1\) is less than one packed row \(seq_len 128\)"),
])
def test_bad_recipe_is_a_one_line_error_and_overwrites_nothing(runs, tmp_path, capsys, argv, match):
    out = tmp_path / "ckpt"
    shutil.copytree(runs["stopped"], out)
    before = _snapshot(out)
    argv = FAST + ["--out", str(out), "--overwrite"] + argv  # a later --preset wins
    _expect_error(argv, capsys, match)
    assert _snapshot(out) == before


def test_existing_checkpoint_needs_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "ckpt"
    shutil.copytree(runs["stopped"], out)
    before = _snapshot(out)
    _expect_error(FAST + ["--out", str(out)], capsys, "already holds a checkpoint.*--overwrite")
    assert _snapshot(out) == before


def test_resume_without_checkpoint(tmp_path, capsys):
    _expect_error(FAST + ["--out", str(tmp_path / "nothing"), "--resume"], capsys, "--resume: no trainer_state.safetensors")
    assert not (tmp_path / "nothing" / "model.safetensors").exists()


@pytest.mark.parametrize("victim", ["model.safetensors", "trainer_state.safetensors", "train_log.json"])
def test_resume_from_truncated_checkpoint(runs, tmp_path, capsys, victim):
    out = tmp_path / "ckpt"
    shutil.copytree(runs["stopped"], out)
    data = (out / victim).read_bytes()
    (out / victim).write_bytes(data[: len(data) // 2])
    before = _snapshot(out)
    _expect_error(FAST + ["--out", str(out), "--resume"], capsys, "corrupt checkpoint")
    assert _snapshot(out) == before


def test_resume_from_other_architecture(runs, tmp_path, capsys):
    out = tmp_path / "ckpt"
    shutil.copytree(runs["stopped"], out)
    before = _snapshot(out)
    argv = ["--preset", "tiny-fbt", "--threads", "1", "--no-progress", "--out", str(out), "--resume"]
    _expect_error(argv, capsys, "another architecture")
    assert _snapshot(out) == before
    # the same sizes with another window or context: what each position attends to changed silently before
    for flags, key in ((["--attn-window", "16"], "attn_window 0 -> 16"), (["--max-len", "300"], "max_len")):
        _expect_error(FAST + ["--steps", "4", "--out", str(out), "--resume", *flags], capsys,
                      f"another architecture.*{key}")
        assert _snapshot(out) == before


# The flags of the hand-written parser the derived one replaced: existing commands must still run.
EARLIER_FLAGS = (
    "--base --batch-tokens --consistency --consistency-layers --consistency-window --curriculum-max-n "
    "--curriculum-seq-len --curriculum-steps --dense-targets --depth-scale --distractors --eval-every "
    "--fixed-point-prob --fixed-point-tol --gate-init --gate-std --label-weight --lam --length-doubling "
    "--length-start --lr --lr-legs --no-dense-targets --no-packing --no-progress --no-skip-values --noise "
    "--objective --out --overwrite --packing --prefix-mix --preset --reads --register-curriculum --resume "
    "--save-every --schedule --seed --seq-len --skip-values --steps --stop-at --targets --task-weights --tasks "
    "--threads --untied --warm-passes --warm-prob").split()


def test_every_recipe_field_is_a_flag_with_help_and_bounds(capsys):
    from dataclasses import fields

    from common.cli import MAX_SEED
    from training.config import FLOAT_LIMITS, INT_LIMITS, bounds_text

    parser = tcli.build_parser()
    by_dest: dict = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    for f in fields(TrainConfig):
        actions = by_dest.get(f.name)
        assert actions, f"no flag for {f.name}"
        assert all(a.help and a.default is None for a in actions), f.name  # unset: the preset's value stays
        if f.name == "seed":  # the shared --seed of every command (common.cli.add_seed_flag), same bound
            assert f"0..{INT_LIMITS['seed'][1]}," in actions[0].help and INT_LIMITS["seed"][1] == MAX_SEED
        elif f.name in INT_LIMITS or f.name in FLOAT_LIMITS:
            assert actions[0].help.endswith("; " + bounds_text(f.name)), f.name
    options = [o for a in parser._actions for o in a.option_strings]
    assert set(EARLIER_FLAGS) <= set(options), sorted(set(EARLIER_FLAGS) - set(options))
    with pytest.raises(SystemExit) as e:
        tcli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    missing = [o for o in options if o not in text]
    assert not missing, missing


def test_derived_flags_reach_the_recipe():
    """A flag of each kind lands in its field: integer, float, word, switch (both ways), text, alias."""
    cfg = tcli.config_of(tcli.parse_args(["--preset", "smoke", "--warmup", "3", "--weight-decay", "0.5",
                                          "--arch", "gpt2", "--no-tie-embeddings", "--depth-scale",
                                          "--distractors", "0:1,8:3", "--tasks", "memory"]))
    smoke = get_preset("smoke")
    assert (cfg.warmup, cfg.weight_decay, cfg.arch, cfg.tie_embeddings, cfg.depth_scale) == (3, 0.5, "gpt2", False, True)
    assert cfg.distractors == {0: 1.0, 8: 3.0} and cfg.tasks == ("memory",)
    assert replace(cfg, warmup=smoke.warmup, weight_decay=smoke.weight_decay, arch=smoke.arch, tie_embeddings=True,
                   depth_scale=False, distractors=smoke.distractors, tasks=smoke.tasks) == smoke  # nothing else moved
    assert tcli.config_of(tcli.parse_args(["--preset", "smoke", "--untied"])).tie_embeddings is False
    assert tcli.config_of(tcli.parse_args(["--preset", "smoke"])) == smoke


@pytest.mark.parametrize("argv, bad", [
    (["--preset", "tiny-fbt-track", "--noise", "0.1"], "--noise"),
    (["--preset", "tiny-fbt-track", "--schedule", "75/25", "--consistency", "1"], "--schedule, --consistency"),
    (["--preset", "tiny-fbt", "--objective", "recurrent", "--prefix-mix", "0.2"], "--prefix-mix"),
    (["--preset", "tiny-std", "--lam", "2", "--warm-passes", "3"], "--lam, --warm-passes"),  # schedule 1
    (["--preset", "smoke", "--schedule", "1/0/0", "--fixed-point-prob", "0.5"], "--fixed-point-prob"),
])
def test_a_multipass_flag_where_no_fused_pass_runs_is_refused(argv, bad):
    """The recurrent objective and a one-pass schedule run no fused pass: a flag shaping those passes would be
    recorded in the config and do nothing."""
    with pytest.raises(UserError, match=f"^{re.escape(bad)} would have no effect: .*no fused pass"):
        tcli.config_of(tcli.parse_args(argv))


@pytest.mark.parametrize("argv, bad, why", [
    (["--base", "tiny-base", "--n-layers", "2", "--depth-scale"], "--n-layers, --depth-scale", "keeps its own arch"),
    (["--arch", "gpt2", "--d-ff", "64"], "--d-ff", "gpt2 has neither"),
    (["--gate-init", "default", "--gate-std", "3"], "--gate-std", "spread of --gate-init unit"),
    (["--warm-passes", "0", "--warm-prob", "0.5"], "--warm-prob", "no warm passes"),
    (["--fixed-point-tol", "0.01"], "--fixed-point-tol", "no fixed-point start"),
    (["--consistency-window", "4"], "--consistency-window", "no consistency term"),
    (["--targets", "labels", "--label-weight", "5"], "--label-weight", "weighs every label 1"),
    (["--length-start", "8"], "--length-start", "no length curriculum"),
    (["--tasks", "completion", "--register-curriculum", "10"], "--register-curriculum", "multi_register is not"),
    (["--curriculum-steps", "0", "--curriculum-max-n", "4"], "--curriculum-max-n", "no curriculum"),
    (["--no-packing", "--seq-len", "64"], "--seq-len", "unpacked rows"),
    (["--base", "tiny-base", "--untied"], "--tie-embeddings / --untied", "keeps its own arch"),
    # found by a review (2026-12-07): each was read, logged and changed nothing
    (["--task-weights", "1,1,8"], "--task-weights", "packed rows draw every task alike"),
    (["--curriculum-steps", "5", "--curriculum-seq-len", "512"], "--curriculum-seq-len", "at most --seq-len"),
    (["--curriculum-steps", "5", "--distractors", "8:1,32:1", "--curriculum-max-n", "4"], "--curriculum-max-n",
     "keeps none of the N"),
    (["--tasks", "memory,completion", "--all-answers"], "--all-answers", "the shell game is not trained"),
    (["--preset", "tiny-loop-track", "--depth-scale", "--gate-std", "50"], "--depth-scale, --gate-std",
     "a looped model has no fusion gate"),
])
def test_a_flag_whose_option_does_nothing_is_refused(argv, bad, why):
    with pytest.raises(UserError, match=f"^{re.escape(bad)} would have no effect: .*{re.escape(why)}"):
        tcli.config_of(tcli.parse_args(["--preset", "smoke", *argv]))


def test_a_reordered_task_list_keeps_each_tasks_share():
    """The preset's shares follow their tasks by name: a reordered --tasks swapped them by position."""
    cfg = tcli.config_of(tcli.parse_args(["--preset", "tiny-fbt-track", "--tasks", "shell_game,parity"]))
    pre = get_preset("tiny-fbt-track")
    assert dict(zip(cfg.tasks, cfg.task_weights)) == dict(zip(pre.tasks, pre.task_weights)) and cfg.tasks != pre.tasks
    cfg = tcli.config_of(tcli.parse_args(["--preset", "smoke", "--tasks", "parity,completion", "--variants",
                                          "uniform:1,hold:1", "--distractors", "8:1", "--all-answers"]))
    assert cfg.all_answers  # a tracking task's variants read it: taken


def test_the_same_flags_are_taken_where_they_act():
    cfg = tcli.config_of(tcli.parse_args(["--preset", "smoke", "--gate-init", "unit", "--gate-std", "3",
                                          "--warm-passes", "2", "--warm-prob", "0.5", "--consistency", "1",
                                          "--consistency-window", "4", "--length-doubling", "10", "--length-start",
                                          "8", "--curriculum-steps", "5", "--curriculum-max-n", "4"]))
    assert (cfg.gate_std, cfg.warm_prob, cfg.consistency_window, cfg.length_start, cfg.curriculum_max_n) == \
        (3.0, 0.5, 4, 8, 4)


def test_the_flags_a_refusal_leaves_are_enough():
    """What the refusals leave must still configure every run: an unpacked preset at a shorter context (its packed
    rows' seq_len no longer has to fit: there are none), a --base preset at a packed length past the default
    max_len (the base's own context is checked by the trainer, not --max-len)."""
    cfg = tcli.config_of(tcli.parse_args(["--preset", "tiny-fbt-track", "--max-len", "512"]))
    assert (cfg.max_len, cfg.packing) == (512, False)
    cfg = tcli.config_of(tcli.parse_args(["--preset", "smoke", "--base", "tiny-base", "--seq-len", "4096",
                                          "--batch-tokens", "4096"]))
    assert (cfg.seq_len, cfg.base, cfg.packing) == (4096, "tiny-base", True)
    with pytest.raises(UserError, match="must be at most the model's max_len"):  # packed, from scratch: checked
        tcli.config_of(tcli.parse_args(["--preset", "smoke", "--seq-len", "4096"]))


def test_resume_with_overwrite_is_refused(tmp_path):
    from training.output import check_output

    with pytest.raises(UserError, match="--overwrite would have no effect with --resume"):
        check_output(tmp_path, resume=True, overwrite=True)


def test_multipass_flags_stay_where_fused_passes_run():
    cfg = tcli.config_of(tcli.parse_args(["--preset", "tiny-fbt-track", "--objective", "multipass", "--schedule",
                                          "60/40", "--noise", "0.1", "--consistency", "1"]))
    assert (cfg.objective, cfg.noise, cfg.consistency) == ("multipass", 0.1, 1.0)
    # a preset's own values of them are not the user's: the recurrent presets keep theirs
    assert tcli.config_of(tcli.parse_args(["--preset", "tiny-fbt-track"])) == get_preset("tiny-fbt-track")
    assert tcli.config_of(tcli.parse_args(["--preset", "tiny-fbt", "--objective", "recurrent"])).noise == \
        get_preset("tiny-fbt").noise


# ----- the real CLI --------------------------------------------------------------------------------------------
def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


# Subprocess timeouts are hang guards only: a niced run on a CPU shared with training jobs was measured at >2 min
# just to import torch.


def test_cli_error_in_a_subprocess(tmp_path):
    r = subprocess.run([sys.executable, "-m", "training.train", "--preset", "nope", "--out", str(tmp_path / "x")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: unknown preset 'nope'") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


def test_untied_model_round_trips(tmp_path):
    """--untied: separate output embedding, kept distinct through save_pretrained / from_pretrained."""
    from models.full_bandwidth import FullBandwidthLM

    cfg = replace(get_preset("smoke"), tie_embeddings=False)
    model = tmodel.build_model(cfg, 39)
    emb, head = model.lm.get_input_embeddings().weight, model.lm.get_output_embeddings().weight
    assert emb.data_ptr() != head.data_ptr() and not torch.equal(emb, head)
    model.save_pretrained(tmp_path / "u")
    again = FullBandwidthLM.from_pretrained(tmp_path / "u")
    assert torch.equal(again.lm.get_output_embeddings().weight, head)
    assert torch.equal(again.lm.get_input_embeddings().weight, emb)


def test_reads_make_every_answer_a_weighted_label_target():
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = replace(get_preset("smoke"), packing=False, skip_values=True, batch_tokens=900, tasks=("multi_register",),
                  reads=4, distractors={0: 1.0})
    (mb,) = tdata.make_batches(cfg, tok, 2)
    v, c = tok.convert_tokens_to_ids("value"), tok.convert_tokens_to_ids(":")
    after = torch.zeros_like(mb.label_pos)
    after[:, 2:] = (mb.ids[:, :-2] == v) & (mb.ids[:, 1:-1] == c)
    assert torch.equal(mb.label_pos, after)
    per_row = mb.label_pos.sum(1)
    assert bool((per_row >= 2).all()) and bool((per_row <= 5).all())  # the final answer + up to 4 reads
    assert not bool((mb.skip_pos & mb.label_pos).any())  # answers are digits, yet never skipped
    digits = {tok.convert_tokens_to_ids(d) for d in "01"}
    assert set(mb.ids[mb.label_pos].tolist()) <= digits
    with pytest.raises(UserError, match="reads"):
        replace(get_preset("smoke"), reads=2)  # the smoke preset packs rows


@pytest.mark.parametrize("packing", [False, True])
def test_register_curriculum_ramps_to_the_task(packing):
    from training.config import REGISTER_LEVELS
    from tasks import build_tokenizer

    tok = build_tokenizer()
    names = {tok.convert_tokens_to_ids(r) for r in "ABCDEFGH"}
    eq = tok.convert_tokens_to_ids("=")
    cfg = replace(get_preset("smoke"), packing=packing, tasks=("multi_register",), batch_tokens=1024, seq_len=512,
                  distractors={0: 1.0}, register_curriculum=80)
    get = tok.convert_tokens_to_ids("get")

    def widest(step):  # most distinct registers written in one sample, most writes of one register in one sample
        regs, writes = 0, 0
        for b in tdata.make_batches(cfg, tok, step):
            for row in b.ids.tolist():
                start = 0
                for end in [i for i, t in enumerate(row) if t == get]:  # a packed row streams samples (last one cut)
                    seg = row[start:end]
                    keys = [seg[i - 1] for i in range(1, len(seg)) if seg[i] == eq and seg[i - 1] in names]
                    if keys:
                        regs = max(regs, len(set(keys)))
                        writes = max(writes, max(keys.count(k) for k in set(keys)))
                    start = end
        return regs, writes

    assert widest(0) == REGISTER_LEVELS[0] == (2, 1)  # first level: two registers, written once
    after = [widest(s) for s in range(80, 92)]  # the task itself: 8 registers, 2/4/8 writes
    assert all(r == 8 for r, _ in after) and {w for _, w in after} <= {2, 4, 8}
    # during the ramp: levels drawn uniformly from the unlocked ones, the plain lookup among them to the end
    rng = np.random.default_rng(0)
    for step, unlocked in ((0, 1), (9, 1), (10, 2), (45, 5), (79, 8)):
        drawn = {tdata._register_level(cfg, step, rng) for _ in range(400)}
        assert drawn == set(REGISTER_LEVELS[:unlocked]), step
    # past its end the curriculum leaves no trace: the batches are exactly those of a run without it (off is the
    # default and omitted from the logged config)
    plain = replace(cfg, register_curriculum=0)
    assert "register_curriculum" not in plain.to_dict() and cfg.to_dict()["register_curriculum"] == 80
    assert torch.equal(tdata.make_batches(plain, tok, 3)[0].ids, tdata.make_batches(replace(cfg, register_curriculum=3),
                                                                                       tok, 3)[0].ids)
    with pytest.raises(UserError, match="register_curriculum"):
        replace(cfg, register_curriculum=-1)


def test_unit_gate_init_makes_the_gate_token_dependent():
    from tasks import build_tokenizer

    tok = build_tokenizer()
    pre = {}
    for init in ("default", "unit"):
        model = tmodel.build_model(replace(get_preset("smoke"), gate_init=init), len(tok))
        emb = model.embed(torch.arange(len(tok))[None])[0]
        pre[init] = float(model.fusion.gate(emb).detach().std())
    assert pre["default"] < 0.1  # sigmoid ~0.5 for every token: the token barely reaches its fused input
    assert 0.7 < pre["unit"] < 1.3
    model = tmodel.build_model(replace(get_preset("smoke"), gate_init="unit", gate_std=3.0), len(tok))
    assert 2.1 < float(model.fusion.gate(model.embed(torch.arange(len(tok))[None])[0]).detach().std()) < 3.9
    with pytest.raises(UserError, match="gate_std"):
        replace(get_preset("smoke"), gate_std=0.0)
    with pytest.raises(UserError, match="gate_init"):
        replace(get_preset("smoke"), gate_init="big")


def test_task_weights_flag_sets_the_token_shares(tmp_path, monkeypatch):
    """--task-weights reaches the config (and the training log) and so the per-task micro-batch sizes."""
    from tasks import build_tokenizer

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    out = tmp_path / "w"
    tcli.main(FAST + ["--out", str(out), "--steps", "1", "--no-packing", "--task-weights", "0.1,0.1,0.8"])
    cfg = json.loads((out / "train_log.json").read_text())["config"]
    assert cfg["task_weights"] == [0.1, 0.1, 0.8] and cfg["packing"] is False
    run = replace(get_preset("smoke"), packing=False, task_weights=tuple(cfg["task_weights"]), distractors={0: 1.0})
    sizes = [m.ids.numel() for m in tdata.make_batches(run, build_tokenizer(), 0)]
    assert sizes[2] > 3 * max(sizes[:2])


def test_resume_of_a_shipped_copy_says_why(tmp_path, capsys):
    """A shipped checkpoint holds weights without optimizer state: the refusal says so and what to do."""
    out = tmp_path / "copy"
    shutil.copytree(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-fbt-track", out)
    assert not (out / "trainer_state.safetensors").exists()
    _expect_error(FAST + ["--out", str(out), "--resume"], capsys, "shipped checkpoints carry no optimizer state")


def test_base_fusion_keeps_every_trained_weight(tmp_path):
    """--base-fusion fine-tunes a full-bandwidth checkpoint whole; without it the fusion starts afresh."""
    from training.model import build_model
    from models.loading import load_model

    ship = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-fbt-track"
    shipped = load_model(str(ship))[0]
    want = shipped.state_dict()
    cfg = replace(get_preset("tiny-fbt-track"), base=str(ship), base_fusion=True)
    kept = build_model(cfg, 0, cfg.base).state_dict()
    assert kept.keys() == want.keys() and all(torch.equal(kept[k], want[k]) for k in want)
    fresh = build_model(replace(cfg, base_fusion=False), 0, cfg.base).state_dict()
    assert not torch.equal(fresh["fusion.gate.weight"], want["fusion.gate.weight"])
    assert torch.equal(fresh["lm.model.embed_tokens.weight"], want["lm.model.embed_tokens.weight"])
    with pytest.raises(UserError, match="base_fusion needs --base"):
        replace(get_preset("tiny-fbt-track"), base_fusion=True)
    plain = tmp_path / "plain"  # a plain HF causal LM (no fusion): the shipped model's decoder alone
    shipped.lm.save_pretrained(plain)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ship / f, plain / f)
    with pytest.raises(UserError, match="has no fusion to keep"):
        build_model(replace(cfg, base=str(plain)), 0, str(plain))


def test_card_of_an_eval_on_whole_task_files(tmp_path):
    """eval.json's meta.n_pairs is null when every task is a file used whole: the card reads the cell sizes from
    the rows (it multiplied n_pairs by 2) and its command has no --n-pairs."""
    import shutil

    from training.card import write_card

    run = tmp_path / "m"
    shutil.copytree(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-fbt-track2", run)
    ev = json.loads((run / "eval.json").read_text())
    ev["meta"]["n_pairs"] = None
    ev["results"][0]["n_samples"] = 30
    (run / "eval.json").write_text(json.dumps(ev))
    line = next(x for x in write_card(run, "cmd").splitlines() if "samples per cell" in x)
    assert "--n-pairs" not in line and f"(n = 30-{ev['results'][1]['n_samples']} samples per cell" in line


def test_the_card_names_a_fused_sweep_only_where_every_pass_ran():
    """fused-3 and fused-8 alone were drawn as one "min fused-1..8" column, their columns dropped."""
    from training.card import eval_table, fused_sweep

    row = lambda m, a: {"task": "memory", "n_distractors": 8, "mode": m, "accuracy": a}  # noqa: E731
    two = [row("std", 1.0), row("fused-3", 0.5), row("fused-8", 0.75)]
    assert fused_sweep(two) == []
    table = eval_table(two, ["std", "fused-3", "fused-8"])
    assert "min fused" not in table and "| memory | 8 | 1.000 | 0.500 | 0.750 |" in table
    full = [row("std", 1.0)] + [row(f"fused-{k}", 1.0 - k / 10) for k in (1, 2, 3)]
    assert fused_sweep(full) == [1, 2, 3]
    assert "| memory | 8 | 1.000 | 0.900 | 0.700 |" in eval_table(full, ["std", "fused-1"])


def test_a_batch_without_loss_targets_is_named_not_called_divergence(tmp_path, capsys):
    """Rows shorter than one sample under --targets labels hold no target: 0 / 0 stopped the run as "diverged"."""
    with pytest.raises(SystemExit) as e:
        tcli.main(FAST + ["--steps", "2", "--targets", "labels", "--seq-len", "8", "--batch-tokens", "8",
                          "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds no loss target" in err and "diverged" not in err
    assert not (tmp_path / "o").exists()


def test_the_card_lists_only_the_objective_settings_that_ran():
    """A 1-pass or recurrent run listed warm passes, state noise and a prefix mixin its recipe carried unused, and a
    dense-target run said "loss on the label tokens only"; warm passes run in warm_prob * (1 - fixed_point_prob)
    of the multi-pass batches (the fixed-point start replaces them)."""
    from training.card import _objective

    common = dict(noise=0.02, prefix_mix=0.5, warm_passes=16, warm_prob=0.5, lam=1.0, targets="labels",
                  depth_scale=False)
    one_pass = " ".join(_objective(dict(common, schedule="1"), None))
    assert "warm no-grad" not in one_pass and "noise U" not in one_pass and "prefix" not in one_pass
    recurrent = " ".join(_objective(dict(common, schedule="1", objective="recurrent", dense_targets=True), None))
    assert "warm no-grad" not in recurrent and "label tokens only" not in recurrent and "running value" in recurrent
    multi = " ".join(_objective(dict(common, schedule="60/25/15", fixed_point_prob=0.5), None))
    assert "1-16 warm no-grad passes in 0.25 of the multi-pass batches" in multi and "noise U[-0.02, 0.02]" in multi
