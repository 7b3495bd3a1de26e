"""Mutation-testing gaps in probes.run (the CLI's orchestration) and probes.erase (LEACE on recorded states).

Each test checks a documented invariant against a hand-computed reference, not the code's own earlier output."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def fbt():
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from probes.collect import collect_activations
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, initializer_range=0.1)
    model = FullBandwidthLM.from_config(cfg, seed=0).eval()
    samples = make_dataset("completion", n_pairs=12, n_distractors=1, seed=0)
    ids, samples = tokenize_samples(samples, tok)
    acts = collect_activations(model, ids, ["recurrent-1"])["recurrent-1"]
    return model, tok, ids, samples, acts


def test_erased_acts_hold_each_folds_own_eraser_at_the_erased_depth(fbt):
    """erased_depth_acts: per fold f, EVERY row at (depth, T) is fold f's eraser applied to the clean value;
    depths below are zeros, depths above are recomputed (non-zero) for every row, whatever the batching."""
    from probes.erase import erased_depth_acts
    from stats.erasure import grouped_folds
    from stats.linear import ProbeConfig

    model, _, ids, samples, acts = fbt
    y = np.array([s.label for s in samples])
    groups = np.array([s.group_id for s in samples])
    folds = grouped_folds(y, groups, ProbeConfig(n_boot=10))
    depth = 1
    out, fe = erased_depth_acts(model, ids, samples, "recurrent-1", depth, acts[:, depth], folds, 2, batch_pairs=3)
    clean = torch.from_numpy(np.asarray(acts[:, depth], dtype=np.float32))
    assert len(out) == len(folds)
    for f in range(len(folds)):
        want = fe.by_fold(clean, f).float().numpy()
        assert out[f].shape == acts.shape
        np.testing.assert_allclose(out[f][:, depth], want, atol=1e-5)
        assert not out[f][:, :depth].any()
        assert (np.abs(out[f][:, depth + 1:]).sum(axis=-1) > 0).all()  # every row, every depth above
    # the folds' erasers differ, so the per-fold values must too (each fold's own eraser, not one for all)
    assert not np.allclose(out[0][:, depth], out[1][:, depth])
    # batching by whole pairs changes nothing but the padding
    one, _ = erased_depth_acts(model, ids, samples, "recurrent-1", depth, acts[:, depth], folds, 2, batch_pairs=100)
    for f in range(len(folds)):
        np.testing.assert_allclose(out[f], one[f], atol=1e-4)


def test_erased_rows_lens_reads_each_row_as_its_held_out_fold_erased_it(fbt, monkeypatch):
    """erased_depth_rows: the lens reads each row as erased by the fold that holds it out, and the label words'
    index (the answers), not the probe target `y`; the row fields are the documented ones."""
    import probes.lens
    from probes.erase import erased_depth_acts, erased_depth_rows
    from stats.erasure import grouped_folds
    from stats.linear import ProbeConfig

    model, _, ids, samples, acts = fbt
    answers = np.array([s.label for s in samples])
    groups = np.array([s.group_id for s in samples])
    y = 1 - answers  # a probe target other than the answers (as the pair roles are)
    config = ProbeConfig(n_boot=10)
    seen = {}

    def fake_depth_lens(model, held, labels, label_ids, groups, n_boot, seed):
        seen["held"], seen["labels"] = np.array(held), np.array(labels)
        return [dict.fromkeys(probes.lens.LENS_FIELDS, 0.0) for _ in range(held.shape[1])]

    monkeypatch.setattr(probes.lens, "depth_lens", fake_depth_lens)
    depth = 1
    rows = erased_depth_rows(model, ids, samples, [5, 6], "recurrent-1", depth, acts, config, batch_pairs=4, y=y)
    folds = grouped_folds(y, groups, config)
    per_fold, _ = erased_depth_acts(model, ids, samples, "recurrent-1", depth, acts[:, depth], folds, 2, y=y)
    want = np.empty_like(acts[:, depth:])
    for f, (_, te) in enumerate(folds):
        want[te] = per_fold[f][te, depth:]
    np.testing.assert_allclose(seen["held"], want, atol=1e-4)
    assert (seen["labels"] == answers).all()
    assert [r["depth"] for r in rows] == list(range(depth, acts.shape[1]))
    for r in rows:
        assert r["erased_at"] == depth and r["n_samples"] == len(samples)
        assert r["n_groups"] == len(set(groups.tolist())) < len(samples)
        fa = r["fold_accuracies"]
        assert r["accuracy_std"] == pytest.approx(float(np.sqrt(np.mean((np.array(fa) - np.mean(fa)) ** 2))))


def test_probes_cli_meta_describes_the_data_and_an_erase_at_depth_zero(tiny_ckpt, tmp_path):
    """meta.datasets: n_samples, n_pairs (used), n_groups, min/max tokens of the tokenized prompts; --erase 0 is
    used, so it is in meta.run (a plain run's signature must not match it); every row's selectivity is accuracy
    minus control accuracy; the erased rows cover depths 0..L."""
    from probes.run import main
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--n-pairs", "12",
                 "--distractors", "8", "--modes", "standard", "--n-boot", "20", "--no-progress", "--no-cache",
                 "--no-mdl", "--erase", "0"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["run"]["erase"] == 0 and doc["meta"]["erase"]["depth"] == 0
    samples = make_dataset("completion", n_pairs=12, n_distractors=8, seed=0)
    ids, samples = tokenize_samples(samples, build_tokenizer())
    ds = doc["meta"]["datasets"]["8"]
    assert ds["n_samples"] == len(samples) == 24
    assert ds["n_pairs"] == 12
    assert ds["n_groups"] == len({s.group_id for s in samples})
    assert ds["min_tokens"] == min(len(r) for r in ids) and ds["max_tokens"] == max(len(r) for r in ids)
    for r in doc["results"]:
        assert r["selectivity"] == pytest.approx(r["accuracy"] - r["control_accuracy"])
    n_depths = len({r["depth"] for r in doc["results"]})
    assert [r["depth"] for r in doc["erased"]] == list(range(n_depths))


def test_check_out_dir_refusals_follow_the_documented_rules(tmp_path):
    """_check_out_dir: a folder holding outputs but no probes.json is refused unless --overwrite; the same run's
    folder is accepted, and its activations/ refused only for a run that would drop them (no --save-activations)."""
    from common.errors import UserError
    from probes.run import _check_out_dir

    sig = {"task": "completion", "seed": 0}
    out = tmp_path / "o"
    _check_out_dir(out, sig, overwrite=False)  # nothing there yet
    out.mkdir()
    (out / "depth_curves.html").write_text("x")
    with pytest.raises(UserError, match="no probes.json"):
        _check_out_dir(out, sig, overwrite=False)
    _check_out_dir(out, sig, overwrite=True)
    (out / "probes.json").write_text(json.dumps({"meta": {"run": sig}, "results": []}))
    _check_out_dir(out, sig, overwrite=False)  # the same run again, no activations/: allowed either way
    _check_out_dir(out, sig, overwrite=False, save_activations=True)
    with pytest.raises(UserError, match="differs in seed"):
        _check_out_dir(out, {**sig, "seed": 1}, overwrite=False)
    (out / "activations").mkdir()
    with pytest.raises(UserError, match="activations/"):
        _check_out_dir(out, sig, overwrite=False)
    _check_out_dir(out, sig, overwrite=False, save_activations=True)
    _check_out_dir(out, sig, overwrite=True)


def test_erased_probe_scores_read_the_recomputed_run_not_the_clean_activations_above(fbt):
    """Above the erased depth the model recomputes every depth from the erased value: the probe's scores there
    cannot depend on what the clean activations held at those depths (only (depth, T) fits the erasers)."""
    from probes.erase import erased_depth_rows
    from stats.linear import ProbeConfig

    model, _, ids, samples, acts = fbt
    config = ProbeConfig(n_boot=10)
    noisy = np.array(acts, copy=True)
    noisy[:, 2:] = np.random.default_rng(0).normal(size=noisy[:, 2:].shape).astype(noisy.dtype)
    a = erased_depth_rows(model, ids, samples, None, "recurrent-1", 1, acts, config)
    b = erased_depth_rows(model, ids, samples, None, "recurrent-1", 1, noisy, config)
    assert [(r["depth"], r["accuracy"], r["fold_accuracies"]) for r in a] == \
        [(r["depth"], r["accuracy"], r["fold_accuracies"]) for r in b]


class _Accepted(Exception):
    """Raised just after main()'s argument checks: the arguments were accepted."""


@pytest.mark.parametrize("erase, accepted", [(2, True), (3, False)])
def test_erase_at_the_top_depth_is_accepted_and_one_beyond_refused(tiny_ckpt, tmp_path, monkeypatch, capsys,
                                                                  erase, accepted):
    """A 2-block model's depths are 0..2 (docs: depth L before the final norm): --erase 2 is valid, --erase 3 not."""
    import models.fingerprint
    from probes.run import main

    def stop(model):
        raise _Accepted

    monkeypatch.setattr(models.fingerprint, "weights_hash", stop)
    argv = ["--task", "completion", "--model", str(tiny_ckpt), "--out", str(tmp_path / "p"), "--n-pairs", "12",
            "--distractors", "8", "--modes", "standard", "--no-progress", "--no-cache", "--erase", str(erase)]
    if accepted:
        with pytest.raises(_Accepted):
            main(argv)
    else:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and f"--erase {erase}: standard's depths are 0..2" in capsys.readouterr().err
