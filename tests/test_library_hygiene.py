"""Library calls leave the process and the caller's model as they found them.

Researchers load a model once in a notebook and call the engine, probes, interventions and training helpers on it
many times: a call that flips the model's train / eval mode, leaves a hook or an instance attribute behind, or moves
a global setting would change every later computation. Each test snapshots that state (`snapshot`), calls one API
(also one refused, or failing midway), and compares.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from test_families import tiny_lm

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def snapshot(model) -> dict:
    """What a library call must leave as it was: the model's tensors, flags, hooks, instance attributes, config, and
    the process-wide settings and generators it could touch."""
    lm = getattr(model, "lm", model)
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "no_grad_field": {n: p.grad is None for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: {h: len(getattr(m, h)) for h in HOOK_DICTS} for n, m in model.named_modules()},
        "instance_attrs": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "config": lm.config.to_dict(),
        "attn": lm.config._attn_implementation,
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "dtype": torch.get_default_dtype(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
    }


def changes(before: dict, after: dict) -> list[str]:
    out = []
    for k, a in before.items():
        b = after[k]
        if k == "tensors":
            out += [f"tensor {n}" for n in a if n not in b or not torch.equal(a[n], b[n])]
        elif isinstance(a, torch.Tensor) or isinstance(a, np.ndarray):
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                out.append(k)
        elif isinstance(a, dict) and k != "config":
            out += [f"{k}[{n!r}]: {a.get(n)} -> {b.get(n)}" for n in set(a) | set(b) if a.get(n) != b.get(n)]
        elif a != b:
            out.append(f"{k}: {a!r:.80} -> {b!r:.80}")
    return out


def batch():
    from engine.inputs import pad_left

    return pad_left([[5, 9, 2, 7, 3, 11, 4, 8], [6, 1, 12, 3, 10], [7, 7, 2]])


def raise_at(n: int, exc=RuntimeError):
    """A forward hook that raises `exc` at its n-th call."""
    calls = [0]

    def hook(mod, args, out):
        calls[0] += 1
        if calls[0] == n:
            raise exc("raised by a user hook")

    return hook


# ----- training helpers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fbt_and_tok():
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, initializer_range=0.1)
    return FullBandwidthLM.from_config(cfg, seed=0), tok


def test_quick_eval_keeps_the_callers_mode(fbt_and_tok):
    """quick_eval ran in eval mode and then set the model to train mode, whatever mode it came in: an eval-mode
    model came back training (dropout on in every later run); a failure midway left it in eval mode."""
    from models.full_bandwidth import decoder_layers
    from training.config import TrainConfig
    from training.quick_eval import quick_eval

    model, tok = fbt_and_tok
    cfg = TrainConfig(tasks=("completion",))
    model.eval()
    before = snapshot(model)
    quick_eval(model, tok, cfg)
    assert changes(before, snapshot(model)) == []

    model.train()  # the trainer's model: training goes on afterwards, also after a failed evaluation
    before = snapshot(model)
    handle = decoder_layers(model.lm)[1].register_forward_hook(raise_at(3))
    try:
        with pytest.raises(RuntimeError, match="user hook"):
            quick_eval(model, tok, cfg)
    finally:
        handle.remove()
    assert changes(before, snapshot(model)) == []
    model.eval()


# ----- recirculation on a plain HF model ------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_recirculation_leaves_an_hf_models_mode(model_type):
    """Wrapping a plain HF model (or a fused model's LM) for recirculation called `.eval()` on the wrapper, which
    set the caller's whole model to eval mode for good, even when the call was then refused (a bad spec)."""
    from common.errors import UserError
    from engine.modes import parse_mode
    from engine.recirculation import RecirculatedLM, lm_only, recirculated_prefill

    ids, mask = batch()
    lm = tiny_lm(model_type).train()
    before = snapshot(lm)
    with pytest.raises(UserError):
        recirculated_prefill(lm, "9:0:0.5", ids, mask)  # refused: source depth 9 of 2 blocks
    assert changes(before, snapshot(lm)) == []
    recirculated_prefill(lm, "1:0:0.5", ids, mask)
    RecirculatedLM(lm, parse_mode("recirc-1:0:0.5", 2).recirc)
    lm_only(lm)
    assert changes(before, snapshot(lm)) == []
    # an eval-mode model gives the same numbers as before (and stays in eval mode)
    lm.eval()
    before = snapshot(lm)
    a = recirculated_prefill(lm, "1:0:0.5", ids, mask).logits
    b = RecirculatedLM(lm, parse_mode("recirc-1:0:0.5", 2).recirc).prefill(ids, mask, cols=torch.tensor([7])).logits
    assert torch.equal(a, b)
    assert changes(before, snapshot(lm)) == []


def test_recirc_mode_of_a_fused_model_leaves_its_mode(fbt_and_tok):
    """prefill_many's recirc modes on a model with a fusion run its LM alone (lm_only): that wrapper's `.eval()` set
    the caller's LM to eval mode, while the same call's standard mode ran it as it was."""
    from engine.prefill import generate, prefill_many

    model, _ = fbt_and_tok
    ids, mask = batch()
    model.train()
    try:
        before = snapshot(model)
        prefill_many(model, ids, mask, ["standard", "recirc-1:0:0.5"])
        generate(model, ids, mask, 2, "recirc-1:0:0.5")
        assert changes(before, snapshot(model)) == []
    finally:
        model.eval()


def _dropout_gpt2():
    """A tiny GPT-2 with dropout 0.5 everywhere, as AutoModelForCausalLM.from_config gives it: in train mode."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.5, embd_pdrop=0.5,
                     attn_pdrop=0.5, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg)


def test_recirculation_on_a_training_hf_model_stays_deterministic():
    """Recirculation wrapped a plain HF model (or a fused model's LM) in an `.eval()`ed FullBandwidthLM: its numbers
    came without dropout whatever the caller's mode. Once the wrapper stopped calling `.eval()` (to leave the
    caller's mode alone), a training model (from_config's) gave different logits at every call. Its runs are in
    eval mode again: the eval-mode model's numbers, bit for bit, and the caller's mode is left as it was."""
    from engine.modes import parse_mode
    from engine.prefill import generate, prefill_many
    from engine.recirculation import RecirculatedLM, recirculated_prefill
    from models.full_bandwidth import FullBandwidthLM

    ids, mask = batch()
    spec = parse_mode("recirc-1:0:0.5", 2).recirc
    lm = _dropout_gpt2()
    lm.eval()
    ref = recirculated_prefill(lm, spec, ids, mask).logits
    ref_rlm = RecirculatedLM(lm, spec).prefill(ids, mask, method="blockwise").logits
    ref_gen = RecirculatedLM(lm, spec).generate(ids, mask, 3)
    lm.train()
    before = snapshot(lm)
    for seed in (1, 2):
        torch.manual_seed(seed)
        assert torch.equal(recirculated_prefill(lm, spec, ids, mask).logits, ref)
        assert torch.equal(RecirculatedLM(lm, spec).prefill(ids, mask, method="blockwise").logits, ref_rlm)
        assert torch.equal(RecirculatedLM(lm, spec).generate(ids, mask, 3), ref_gen)
    after = snapshot(lm)
    before.pop("torch_rng"), after.pop("torch_rng")
    assert changes(before, after) == []

    fused = FullBandwidthLM(lm, fusion=True)  # a fused model's recirc modes run its LM alone (lm_only)
    fused.eval()
    ref_many = prefill_many(fused, ids, mask, ["recirc-1:0:0.5"])["recirc-1:0:0.5"].logits
    ref_gen = generate(fused, ids, mask, 3, "recirc-1:0:0.5")
    fused.train()
    for seed in (1, 2):
        torch.manual_seed(seed)
        assert torch.equal(prefill_many(fused, ids, mask, ["recirc-1:0:0.5"])["recirc-1:0:0.5"].logits, ref_many)
        assert torch.equal(generate(fused, ids, mask, 3, "recirc-1:0:0.5"), ref_gen)
    assert all(m.training for m in fused.modules())


# ----- probes -----------------------------------------------------------------------------------------------------
def test_collector_leaves_the_models_mode(fbt_and_tok):
    """The collector set the model to eval mode when built and left it so (a model being trained between probes
    lost its dropout for good); a collection that fails midway (here a user hook) leaves it as it was too. The
    activations are those of eval mode either way."""
    import gc

    from models.full_bandwidth import decoder_layers
    from probes.collect import Collector, collect_activations

    model, _ = fbt_and_tok
    seqs = [[5, 9, 2, 7, 3], [6, 1, 12], [7, 7, 2, 4]]
    model.eval()
    ref = collect_activations(model, seqs, ["standard", "recurrent-1"])
    model.train()
    try:
        before = snapshot(model)
        got = collect_activations(model, seqs, ["standard", "recurrent-1"])
        col = Collector(model, progress=False)
        handle = decoder_layers(model.lm)[1].register_forward_hook(raise_at(2))
        try:
            with pytest.raises(RuntimeError, match="user hook"):
                col.collect(seqs, ["recurrent-1"])
        finally:
            handle.remove()
        del col  # (a collector keeps nnsight's wrapper while it lives: test_collection_leaves_no_nnsight_wrapper)
        gc.collect()  # the failed call's traceback held it
        after = snapshot(model)
    finally:
        model.eval()
    assert changes(before, after) == []
    for m in ref:
        assert np.array_equal(got[m], ref[m]), m


def _lean(model) -> bool:
    """Whether a cached one-token step of `model` takes the lean step (models.lean_step)."""
    from engine.cache import new_cache
    from models.lean_step import StepPlan, step_plan

    with torch.no_grad():
        return isinstance(step_plan(model.lm, model.family, torch.zeros(1, 1, model.d_model), new_cache()), StepPlan)


def test_collection_leaves_no_nnsight_wrapper(fbt_and_tok):
    """nnsight installs its wrapper for good: after one collection every module of the caller's model kept an
    instance `forward`, and every later recurrence on it took HF's path instead of the lean one-token step (1.5-2x
    slower on tiny-fbt-track). A collector's wrapper goes once no collector uses it; one the caller made stays."""
    import gc

    from nnsight import NNsight

    from probes.collect import Collector, collect_activations

    model, _ = fbt_and_tok
    model.eval()
    seqs = [[5, 9, 2, 7, 3], [6, 1, 12], [7, 7, 2, 4]]
    assert _lean(model)
    before = snapshot(model)
    ref = collect_activations(model, seqs, ["standard", "recurrent-1"])
    assert changes(before, snapshot(model)) == [] and _lean(model)

    col = Collector(model, progress=False)  # a collector in use keeps its wrapper, however many others come and go
    collect_activations(model, seqs, ["recurrent-1"])
    got = col.collect(seqs, ["standard", "recurrent-1"])
    assert all(np.array_equal(got[m], ref[m]) for m in ref)
    del col
    assert changes(before, snapshot(model)) == [] and _lean(model)

    mine = NNsight(model)  # the caller's own wrapper: left in place, and still reads
    wrapped = snapshot(model)
    collect_activations(model, seqs, ["standard"])
    gc.collect()
    assert changes(wrapped, snapshot(model)) == []
    with mine.trace(torch.tensor([seqs[0]]), torch.ones(1, 5, dtype=torch.long)):
        out = mine.lm.model.layers[0].output.save()
    assert out.shape[-1] == model.d_model


def test_erased_depth_rows_leave_the_models_mode(fbt_and_tok):
    """probes.erase ran its patchers on `model.eval()`, leaving the caller's model in eval mode for good."""
    from probes.collect import collect_activations
    from probes.erase import erased_depth_rows
    from stats.linear import ProbeConfig
    from tasks import make_dataset, tokenize_samples

    model, tok = fbt_and_tok
    samples = make_dataset("completion", n_pairs=10, n_distractors=1, seed=0)
    ids, _ = tokenize_samples(samples, tok)
    model.eval()
    acts = collect_activations(model, ids, ["recurrent-1"])["recurrent-1"]
    config = ProbeConfig(n_boot=20)
    ref = erased_depth_rows(model, ids, samples, None, "recurrent-1", 1, acts, config)
    model.train()
    try:
        before = snapshot(model)
        got = erased_depth_rows(model, ids, samples, None, "recurrent-1", 1, acts, config)
        assert changes(before, snapshot(model)) == []
    finally:
        model.eval()
    assert got == ref  # eval mode's numbers either way
