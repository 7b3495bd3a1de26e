"""The real SmolLM2-135M-Instruct, the model of the recirculation study (models/smollm2.py), loaded once per
session by the `smollm2` fixture (tests/conftest.py; needs the `smollm2` extra, which `make test` installs).

Two properties, on one short text: alpha = 0 recirculation is the base model bit for bit (and the injection
machinery is live in SmolLM2's blocks), and its tokenizer passes the tasks' shared-final-token check.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import UserError

TEXT = "The quick brown fox jumps over the lazy dog."
SOURCE, TARGET = 20, 8  # the study's example pair (README: --recirculate 20:8:0.1:convex)


def test_alpha_zero_recirculation_is_the_base_model_bit_for_bit(smollm2):
    from engine.recirculation import MODES, RecircSpec, RecirculatedLM

    model, tok = smollm2
    assert model.n_layers == 30 and model.d_model == 576 and not model.has_fusion
    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    assert 5 <= ids.shape[1] <= 16  # one short text: a handful of cached steps below
    with torch.no_grad():
        plain = model(ids, mask)
    for mode in MODES:  # alpha = 0 is beta = 1 in both: the identity
        spec = RecircSpec(SOURCE, TARGET, 0.0, mode)
        assert spec.is_identity
        r = RecirculatedLM(model, spec)
        for method in ("sequential", "blockwise"):
            out = r.prefill(ids, mask, method=method)
            assert torch.equal(out.logits, plain.logits) and torch.equal(out.top, plain.top), (mode, method)
    # Without the short-circuit the hooks run in SmolLM2's Llama blocks: alpha = 0 reproduces the base to float
    # rounding, and alpha = 0.1 changes every position after the first (position 0 attends only to itself, so it
    # has no earlier recirculated token to see), so the comparison above is not vacuous.
    scale = float(plain.logits.abs().max())
    same = RecirculatedLM(model, RecircSpec(SOURCE, TARGET, 0.0, "residual"), bypass_identity=False)
    assert float((same.prefill(ids, mask).logits - plain.logits).abs().max()) <= 1e-5 * scale
    moved = RecirculatedLM(model, RecircSpec(SOURCE, TARGET, 0.1, "convex")).prefill(ids, mask).logits
    change = (moved - plain.logits).abs().amax(dim=(0, 2))
    assert float(change[0]) <= 1e-5 * scale and float(change[1:].min()) > 1e-3 * scale


def test_tokenizer_passes_the_shared_final_token_check(smollm2):
    from tasks import TASKS, TRACKING_TASKS, label_token_ids, make_dataset, resolve_task

    _, tok = smollm2
    (colon,) = tok(":", add_special_tokens=False)["input_ids"]
    for task in TASKS + TRACKING_TASKS:  # the language tasks end otherwise (tests/test_tasks_language.py)
        # the check probes.run and interventions.run apply (tasks.tokenize_samples): it raises unless every
        # prompt ends with the same token id
        samples = make_dataset(task, n_pairs=4, n_distractors=2, seed=0)
        ids, out = resolve_task(task).tokenize(samples, tok)
        assert {row[-1] for row in ids} == {colon}, task
        assert [s.n_tokens for s in out] == [len(row) for row in ids], task
    # The label words of the tasks the recirculation study scores (analysis.recirculation's mediation tasks
    # completion / memory) are distinct tokens under SmolLM2's tokenizer.
    for task in ("completion", "memory"):
        lab = label_token_ids(tok, task)
        assert len(lab) == 2 and len(set(lab)) == 2 and colon not in lab, task
    # and the check is live with this tokenizer: one prompt that ends elsewhere is refused, by name
    samples = make_dataset("memory", n_pairs=2, n_distractors=2, seed=0)
    bad = samples[:3] + [dataclasses.replace(samples[3], text=samples[3].text + " x")]
    with pytest.raises(UserError, match="do not all end with the same final token") as e:
        resolve_task("memory").tokenize(bad, tok)
    assert f"pair {samples[3].pair_id}" in str(e.value)
