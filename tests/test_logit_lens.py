"""Logit lens (probes.lens): the final norm and LM head by hand on the tiny checkpoint, the lens at the top depth
equals the model's output, the label margin and rank, the fed state, and the probes.json fields."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from probes.lens import (fed_state_mode, fed_states, final_norm, label_margin_and_rank, lens_logits, lens_summary)


def test_lens_by_hand_on_the_tiny_checkpoint(tiny_ckpt):
    """Qwen3 final norm = RMSNorm: x / sqrt(mean(x^2) + eps) * w; then the (tied) LM head W_U."""
    from models.full_bandwidth import FullBandwidthLM

    model = FullBandwidthLM.from_pretrained(tiny_ckpt).eval().float()
    norm = final_norm(model.lm)
    x = torch.randn(5, model.d_model, generator=torch.Generator().manual_seed(0)) * 3
    eps = model.config.rms_norm_eps
    h = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps) * norm.weight
    W = model.lm.get_output_embeddings().weight  # [V, D]
    want = (h @ W.T).detach()
    assert torch.allclose(lens_logits(model, x), want, atol=1e-5)
    assert torch.allclose(lens_logits(model, h, normed=True), want, atol=1e-5)  # the fed state: no norm
    # LD = own - best other label word, rank over the full vocabulary, by hand
    label_ids, labels = (7, 9, 11), np.array([0, 1, 2, 0, 2])
    z = want.double().numpy()
    for i, y in enumerate(labels):
        others = [z[i, t] for k, t in enumerate(label_ids) if k != y]
        ld, rank = label_margin_and_rank(want[i:i + 1], labels[i:i + 1], label_ids)
        assert ld[0] == pytest.approx(z[i, label_ids[y]] - max(others), abs=1e-9)
        assert rank[0] == 1 + int((z[i] > z[i, label_ids[y]]).sum())


def test_margin_rank_and_summary_on_known_logits():
    logits = torch.zeros(4, 6)
    logits[0, [1, 2, 3]] = torch.tensor([5.0, 2.0, 1.0])  # own label 0 (token 1) on top: LD 3, rank 1
    logits[1, [1, 2, 3, 5]] = torch.tensor([1.0, 4.0, 2.0, 9.0])  # own 1 (token 2): LD 2, rank 2 (token 5 above)
    logits[2, [1, 2, 3]] = torch.tensor([3.0, 3.0, 0.0])  # own 2 (token 3): LD -3, rank 3
    logits[3, [1, 2, 3]] = torch.tensor([2.0, 2.0, 0.0])  # own 0: tie with label 1 -> LD 0, rank 1
    ld, rank = label_margin_and_rank(logits, [0, 1, 2, 0], (1, 2, 3))
    assert ld.tolist() == [3.0, 2.0, -3.0, 0.0] and rank.tolist() == [1, 2, 3, 1]
    s = lens_summary(logits, [0, 1, 2, 0], (1, 2, 3), groups=[0, 0, 1, 1], n_boot=200)
    assert s["logit_lens_ld"] == pytest.approx(0.5) and s["logit_lens_rank"] == pytest.approx(7 / 4)
    assert s["logit_lens_accuracy"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    lo, hi = s["logit_lens_ld_ci"]
    assert lo <= 0.5 <= hi


def test_lens_at_the_top_depth_is_the_model_output(tiny_model):
    from engine.prefill import prefill

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, tiny_model.config.vocab_size, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    for mode in ("standard", "recurrent-full", "fused-2"):
        res = prefill(tiny_model, ids, mask, mode, collect=True)
        acts = res.resid[:, 0]  # [B, L+1, D] at T
        lens = lens_logits(tiny_model, acts)
        assert torch.allclose(lens[:, -1], res.logits[:, 0], atol=1e-4), mode
        assert not torch.allclose(lens[:, 0], res.logits[:, 0], atol=1e-2)  # depth 0 is not the output


def test_fed_state_is_the_state_entering_the_fusion(tiny_model):
    from engine.prefill import pad_left
    from interventions.core import Batch, CausalContext

    assert fed_state_mode("standard") is None and fed_state_mode("fused-1") == "standard"
    assert fed_state_mode("fused-3") == "fused-2" and fed_state_mode("recurrent-full") == "recurrent-full"
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(2, tiny_model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 5, 7, 7)]
    ids, mask = pad_left(seqs)
    batch = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (10, 11))
    for mode in ("recurrent-1", "recurrent-full", "fused-2"):
        ctx = CausalContext(tiny_model, batch, modes=("standard", mode))
        got = fed_states(tiny_model, seqs, mode, batch_size=2)  # sorted by length, two per batch
        assert np.allclose(got, ctx.state(mode, -1).numpy(), atol=1e-5), mode


def test_probes_json_carries_lens_and_mdl(tiny_ckpt, tmp_path):
    from probes.run import main

    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--n-pairs", "20",
                 "--distractors", "8", "--n-boot", "100", "--no-progress", "--no-cache", "--fed-lens"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["schema"] == "fbprobe.probes/2" and "lens" in doc["meta"] and doc["meta"]["mdl"]["enabled"]
    assert doc["meta"]["lens"]["fed_state_enabled"] and doc["meta"]["run"]["fed_lens"] is True
    for r in doc["results"]:
        assert r["logit_lens_rank"] >= 1 and r["logit_lens_ld_ci"][0] <= r["logit_lens_ld"] <= r["logit_lens_ld_ci"][1]
        assert r["mdl_compression"] == pytest.approx(r["mdl_uniform_bits"] / r["mdl_online_bits"])
        assert r["mdl_uniform_bits"] == pytest.approx(40.0)  # 40 samples, 1 bit each
    std0 = next(r for r in doc["results"] if r["mode"] == "standard" and r["depth"] == 0)
    # every prompt ends with the same token: the standard depth-0 lens is the same for both labels
    assert std0["logit_lens_ld"] == pytest.approx(0.0, abs=1e-5) and std0["logit_lens_accuracy"] == 0.5
    assert std0["mdl_compression"] == pytest.approx(1.0, abs=1e-6)  # and nothing is learnable there
    fed = doc["fed_state_lens"]
    assert [(r["mode"], r["n_distractors"], r["state"]) for r in fed] == [("recurrent-1", 8, "h_{T-1}")]
    html = (out / "depth_curves.html").read_text()
    assert "logit lens" in html and "MDL compression" in html


def test_probes_run_without_label_token_ids_has_no_lens(tiny_ckpt, tmp_path, monkeypatch):
    """A plain HF tokenizer may merge a built-in task's label words (SmolLM2 on parity): the probes still run,
    the lens fields are null and meta.lens says why."""
    from common.errors import UserError
    from probes.run import main
    from tasks.custom import TaskSource

    def merged(self, tokenizer, prompt=None):
        raise UserError("the completion label words do not all have different first tokens under this tokenizer")

    monkeypatch.setattr(TaskSource, "label_token_ids", merged)
    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--n-pairs", "20",
                 "--distractors", "8", "--n-boot", "50", "--no-progress", "--no-cache", "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["lens"]["enabled"] is False and "different first tokens" in doc["meta"]["lens"]["reason"]
    assert all(r["logit_lens_ld"] is None for r in doc["results"]) and doc["fed_state_lens"] == []


def test_fed_state_lens_is_opt_in(tiny_ckpt, tmp_path):
    """The fed-state lens runs the model once more per feedback mode: only with --fed-lens. Without it the rows
    are an empty list, meta.lens says so and the run's signature is the one of earlier plain runs."""
    from probes.run import main

    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--n-pairs", "20",
                 "--distractors", "8", "--n-boot", "20", "--no-progress", "--no-cache", "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["fed_state_lens"] == [] and doc["meta"]["lens"]["fed_state_enabled"] is False
    assert "fed_lens" not in doc["meta"]["run"]
    assert all(r["logit_lens_ld"] is not None for r in doc["results"])  # the depth lens is computed
    assert "diamond: fed state" not in (out / "depth_curves.html").read_text()  # no diamond drawn, none named


@pytest.mark.parametrize("flags, needle", [
    (["--modes", "standard", "--fed-lens"], "--fed-lens reads the state fed into T, and none of standard"),
    (["--no-cache", "--cache-dir", "elsewhere"], "--cache-dir names the activation cache, which --no-cache"),
])
def test_a_probes_flag_that_would_do_nothing_is_refused(tiny_ckpt, tmp_path, capsys, flags, needle):
    from probes.run import main

    with pytest.raises(SystemExit) as e:
        main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(tmp_path / "p"), "--n-pairs", "20",
              "--distractors", "8", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "p").exists() and not (tmp_path / "elsewhere").exists()
