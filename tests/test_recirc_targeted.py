"""Targeted recirculation (RecirculatedLM mix_mask: mixing only at chosen columns), the targeted-vs-uniform
experiment (g) (analysis/recirculation/targeted.py) and mediation (f) with K > 2 label words, on tiny random
models as tests/test_recirculation.py builds them."""
from __future__ import annotations

import pytest
import torch

from common.errors import UserError
from engine.prefill import pad_left
from engine.recirculation import RecircSpec, RecirculatedLM, mix, recirculated_prefill
from models.full_bandwidth import FullBandwidthLM, decoder_layers

TOL = 1e-5


@pytest.fixture(params=["qwen3", "gpt2"])
def base(request):
    from models.configs import gpt2_config, qwen3_config

    build = {"qwen3": qwen3_config, "gpt2": gpt2_config}[request.param]
    cfg = build(50, n_layers=3, d_model=32, initializer_range=0.1)
    return FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().float()


def _ids(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (B, T), generator=g)
    return ids, torch.ones_like(ids)


def masked_reference(base, spec, ids, mixed_cols):
    """No KV cache, both branches explicit: for token t, one full forward on tokens 0..t in which every earlier
    position u < t enters block d+1 with its stored recirculation-branch state (z'_u if u is a mixed column, else
    its own z_{u,d}: the identity) and position t runs normally (the normal branch n_t gives token t's logits).
    z_d of the recirculation branch r_u is read in the forward where u is the last token, i.e. where every
    earlier position already is a recirculation branch."""
    layers = decoder_layers(base.lm)
    T = ids.shape[1]
    zp, out = [], []
    for t in range(T):
        store = {}

        def pre(mod, args, kwargs, t=t):
            h = args[0] if args else kwargs["hidden_states"]
            store["zd"] = h[:, t].clone()
            if t == 0:
                return None
            h = h.clone()
            h[:, :t] = torch.stack(zp, 1)
            return ((h,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

        def post(mod, args, o, t=t):
            store["zs"] = (o[0] if isinstance(o, tuple) else o)[:, t].clone()

        hs = [layers[spec.target].register_forward_pre_hook(pre, with_kwargs=True),
              layers[spec.source - 1].register_forward_hook(post)]
        try:
            with torch.no_grad():
                o = base(ids[:, :t + 1])
        finally:
            for h in hs:
                h.remove()
        out.append(o.logits[:, t])
        zp.append(mix(store["zd"], store["zs"], spec) if t in mixed_cols else store["zd"])
    return torch.stack(out, 1)


SPECS = [RecircSpec(3, 0, 0.5, "convex"), RecircSpec(2, 1, 0.6, "residual"), RecircSpec(3, 1, 1.0, "convex")]


# ----- the engine ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_all_true_mask_is_todays_run_bit_for_bit(base, spec):
    T = 8
    ids, mask = _ids(2, T, seed=1)
    r = RecirculatedLM(base, spec)
    yes = torch.ones(2, T, dtype=torch.bool)
    for method, kw in (("sequential", {}), ("blockwise", {"passes": T}), ("blockwise", {"passes": 3, "block": 3})):
        plain = r.prefill(ids, mask, method=method, collect=True, **kw)
        got = r.prefill(ids, mask, method=method, collect=True, mix_mask=yes, **kw)
        assert torch.equal(got.logits, plain.logits) and torch.equal(got.resid, plain.resid), (method, kw)
    assert torch.equal(recirculated_prefill(base, spec, ids, mask, mix_mask=yes).logits,
                       recirculated_prefill(base, spec, ids, mask).logits)


@pytest.mark.parametrize("mode", ["convex", "residual"])
def test_all_false_mask_is_the_base_model(base, mode):
    T = 8
    ids, mask = _ids(2, T, seed=2)
    plain = base(ids, mask)
    spec = RecircSpec(3, 1, 0.7, mode)
    no = torch.zeros(2, T, dtype=torch.bool)
    for method in ("sequential", "blockwise"):
        # short-circuited, like alpha = 0: the base model's forward bit for bit
        out = RecirculatedLM(base, spec).prefill(ids, mask, method=method, mix_mask=no)
        assert torch.equal(out.logits, plain.logits) and torch.equal(out.top, plain.top), method
        # the machinery itself: to float rounding
        out = RecirculatedLM(base, spec, bypass_identity=False).prefill(ids, mask, method=method, mix_mask=no,
                                                                         passes=2)
        assert (out.logits - plain.logits).abs().max() <= TOL, method
    # ...and the mask really matters (the comparison is not vacuous)
    assert (RecirculatedLM(base, spec).prefill(ids, mask).logits - plain.logits).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["convex", "residual"])
def test_unmixed_columns_enter_with_z_d_exactly(base, mode):
    """alpha = 0 at a column (outside the mask) gives z' = z_d bit for bit, in both modes (residual: beta = 1
    always), with or without a transform / subspace."""
    T, c = 7, 2
    ids, mask = _ids(2, T, seed=3)
    U = torch.linalg.qr(torch.randn(32, 3, generator=torch.Generator().manual_seed(0)))[0]
    for spec in (RecircSpec(3, 1, 0.5, mode), RecircSpec(3, 1, 0.5, mode, subspace=U)):
        m = torch.zeros(2, T, dtype=torch.bool)
        m[:, c] = True
        rec = RecirculatedLM(base, spec).sequential(ids, mask, record=True, mix_mask=m).steps
        for t in range(T - 1):
            if t == c:
                assert (rec.mixed[:, t] - rec.zd[:, t]).abs().max() > 1e-3
            else:
                assert torch.equal(rec.mixed[:, t], rec.zd[:, t]), t


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("c", [0, 3, 6])
def test_single_targeted_column_equals_the_explicit_reference(base, spec, c):
    T = 8
    ids, mask = _ids(2, T, seed=4)
    m = torch.zeros(2, T, dtype=torch.bool)
    m[:, c] = True
    r = RecirculatedLM(base, spec)
    got = r.prefill(ids, mask, mix_mask=m).logits
    ref = masked_reference(base, spec, ids, {c})
    assert (got - ref).abs().max() <= TOL
    # tokens up to c are untouched (nothing earlier is mixed); later tokens read r_c's keys/values
    plain = base(ids, mask).logits
    assert (got[:, :c + 1] - plain[:, :c + 1]).abs().max() <= TOL
    assert (got[:, c + 1:] - plain[:, c + 1:]).abs().max() > 1e-3
    # the Jacobi engine with passes >= block is the exact result here too
    bw = r.prefill(ids, mask, method="blockwise", passes=T, mix_mask=m).logits
    assert (bw - got).abs().max() <= TOL


def test_per_row_columns_and_a_two_column_mask(base):
    T = 8
    ids, mask = _ids(2, T, seed=5)
    spec = RecircSpec(3, 0, 0.4, "residual")
    m = torch.zeros(2, T, dtype=torch.bool)
    m[0, 1] = m[1, 4] = m[1, 5] = True
    got = RecirculatedLM(base, spec).prefill(ids, mask, mix_mask=m).logits
    assert (got[0] - masked_reference(base, spec, ids[:1], {1})[0]).abs().max() <= TOL
    assert (got[1] - masked_reference(base, spec, ids[1:], {4, 5})[0]).abs().max() <= TOL


def test_mask_on_padding_changes_nothing(base):
    spec = RecircSpec(3, 1, 0.5, "convex")
    r = RecirculatedLM(base, spec)
    rows = [_ids(1, 5, seed=6)[0][0].tolist(), _ids(1, 9, seed=7)[0][0].tolist()]
    ids, mask = pad_left(rows)
    key = [2, 5]  # key column of each row within its unpadded prompt
    m = torch.zeros(2, 9, dtype=torch.bool)
    for i, row in enumerate(rows):
        m[i, 9 - len(row) + key[i]] = True
    on_pad = m | ~mask.bool()
    for method, kw in (("sequential", {}), ("blockwise", {"passes": 9})):
        a = r.prefill(ids, mask, method=method, cols=torch.tensor([8]), mix_mask=m, **kw).logits
        b = r.prefill(ids, mask, method=method, cols=torch.tensor([8]), mix_mask=on_pad, **kw).logits
        assert torch.equal(a, b), method
        for i, row in enumerate(rows):  # and the padded batch is each row alone
            x = torch.tensor([row])
            mm = torch.zeros(1, len(row), dtype=torch.bool)
            mm[0, key[i]] = True
            alone = r.prefill(x, torch.ones_like(x), method=method, cols=torch.tensor([len(row) - 1]),
                              mix_mask=mm, **kw).logits
            assert (a[i] - alone[0]).abs().max() <= TOL, (method, i)
    # a mask set on padding only mixes nothing: the base model
    only_pad = ~mask.bool()
    assert torch.equal(r.prefill(ids, mask, mix_mask=only_pad).logits, base(ids, mask).logits)


def _padded_batch():
    rows = [_ids(1, 6, seed=11)[0][0].tolist(), _ids(1, 10, seed=12)[0][0].tolist(), _ids(1, 8, seed=13)[0][0].tolist()]
    return rows, *pad_left(rows)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("keys", [(4, 7, 6), (5, 9, 7), (0, 0, 0)], ids=["mid", "last", "first"])
def test_skipping_the_unmixed_prefix_is_the_stepwise_run(base, spec, keys):
    """skip_unmixed (one parallel forward up to the first mixed column) against the step-by-step loop: every
    output (logits, top state, residual stream at columns before, at and after the skip point), the kept cache's
    length and z_{T-1,s}, under left padding and a different key column per row; "last" mixes only columns no
    later token reads (the loop is empty), "first" cannot skip anything."""
    rows, ids, mask = _padded_batch()
    T = ids.shape[1]
    m = torch.zeros(ids.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        m[i, T - len(row) + keys[i]] = True
    r = RecirculatedLM(base, spec)
    cols = torch.tensor([1, 5, 6, T - 1])
    kw = dict(cols=cols, collect=True, keep_cache=True, mix_mask=m)
    fast, slow = r.sequential(ids, mask, **kw), r.sequential(ids, mask, skip_unmixed=False, **kw)
    real_col = mask.bool()[:, cols]  # a padding column's output is never read (and differs: no key to attend to)
    for name in ("logits", "top", "resid"):
        diff = (getattr(fast, name) - getattr(slow, name)).abs().flatten(2).amax(-1)
        assert diff[real_col].max() <= TOL, name
    assert (fast.last_zs - slow.last_zs).abs().max() <= TOL
    assert fast.cache.get_seq_length() == slow.cache.get_seq_length() == T - 1
    # the fast path is what the experiment runs, and it agrees with the explicit two-branch reference
    for i, row in enumerate(rows):
        x = torch.tensor([row])
        ref = masked_reference(base, spec, x, {keys[i]})[0, -1]
        assert (fast.logits[i, -1] - ref).abs().max() <= TOL, i
    # the kept cache (r_{<T-1}, what generation continues from) agrees at every real column of every layer
    real = mask[:, :T - 1].bool()[:, None, :, None]
    for lf, ls in zip(fast.cache.layers, slow.cache.layers):
        for a, b in ((lf.keys, ls.keys), (lf.values, ls.values)):
            assert ((a - b).abs() * real).max() <= TOL


def test_uniform_mixing_skips_nothing(base):
    """Without a mask nothing is skipped (an unmasked run makes T calls, as recirc_calls counts): bit for bit the
    stepwise run, and a batch padded in every row still gives the same logits."""
    spec = RecircSpec(3, 1, 0.5, "convex")
    r = RecirculatedLM(base, spec)
    _, ids, mask = _padded_batch()
    a = r.sequential(ids, mask, collect=True)
    b = r.sequential(ids, mask, collect=True, skip_unmixed=False)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.resid, b.resid)
    ids2 = torch.cat([torch.zeros(3, 2, dtype=ids.dtype), ids], 1)
    mask2 = torch.cat([torch.zeros(3, 2, dtype=mask.dtype), mask], 1)
    c = r.sequential(ids2, mask2, cols=torch.tensor([ids2.shape[1] - 1]))
    assert (c.logits[:, 0] - b.logits[:, -1]).abs().max() <= TOL


@pytest.mark.parametrize("bad", [
    torch.ones(2, 7, dtype=torch.bool), torch.ones(1, 8, dtype=torch.bool), torch.ones(2, 8, 1, dtype=torch.bool),
    torch.ones(2, 8), torch.ones(2, 8, dtype=torch.long), [[True] * 8] * 2,
])
def test_bad_masks_are_one_line_user_errors(base, bad):
    ids, mask = _ids(2, 8)
    r = RecirculatedLM(base, RecircSpec(3, 1, 0.3))
    calls = [lambda: r.prefill(ids, mask, mix_mask=bad), lambda: r.sequential(ids, mask, mix_mask=bad),
             lambda: r.blockwise(ids, mask, mix_mask=bad),
             lambda: recirculated_prefill(base, "3:1:0.3", ids, mask, mix_mask=bad)]
    for call in calls:
        with pytest.raises(UserError, match="mix_mask must be a bool tensor") as e:
            call()
        assert "\n" not in str(e.value)


def test_blockwise_records_every_block(base):
    """collect=True with several blocks (pass 0 of a block used to index the previous block's recorded columns):
    passes >= block gives the sequential engine's residual stream."""
    ids, mask = _ids(2, 8, seed=8)
    r = RecirculatedLM(base, RecircSpec(3, 1, 0.5, "convex"))
    seq = r.prefill(ids, mask, collect=True)
    bw = r.prefill(ids, mask, method="blockwise", passes=3, block=3, collect=True)
    assert (bw.resid - seq.resid).abs().max() <= TOL and (bw.logits - seq.logits).abs().max() <= TOL


# ----- (g) targeted vs uniform, and (f) with K > 2 label words ------------------------------------------------
def _stub_keys(samples, tokenizer):
    """Stand-in key tokens for the synthetic tasks: token 2 (memory: the stored bit after 'state =')."""
    return [2] * len(samples)


@pytest.fixture(scope="module")
def task_model():
    from models.configs import qwen3_config
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, initializer_range=0.1)
    return FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().float(), tok


@pytest.mark.parametrize("task,nd", [("memory", 2), ("shell_game", 2)])
def test_targeted_experiment_against_a_direct_computation(task_model, monkeypatch, task, nd):
    import numpy as np

    import tasks
    from analysis.recirculation.targeted import targeted
    from tasks import label_token_ids, make_dataset, tokenize_samples

    model, tok = task_model
    monkeypatch.setattr(tasks, "key_token_positions", _stub_keys, raising=False)
    alphas = [0.0, 0.5, 1.0]
    res = targeted(model, tok, "3:1:convex", task, 6, nd, alphas, 4, 0, n_boot=200)
    assert res["alphas"] == alphas and [p["alpha"] for p in res["points"]] == alphas
    assert res["spec"] == "3:1:convex" and res["n"] == 12 and res["n_classes"] == (3 if task == "shell_game" else 2)
    for p in res["points"]:
        for c in ("uniform", "targeted"):
            for k in ("accuracy", "mean_ld", "accuracy_change", "ld_change"):
                lo, hi = p[c][k + "_ci"]
                assert lo - 1e-9 <= p[c][k] <= hi + 1e-9, (p["alpha"], c, k)
    # alpha = 0 is the base model in both conditions
    p0 = res["points"][0]
    assert all(abs(p0[c][k]) < 1e-6 for c in ("uniform", "targeted") for k in ("accuracy_change", "ld_change"))
    # the failure point is the first alpha whose accuracy is more than 0.05 below base
    for c in ("uniform", "targeted"):
        want = next((p["alpha"] for p in res["points"] if p[c]["accuracy_change"] < -0.05 - 1e-9), None)
        assert res["failure_alpha"][c] == want
    # by hand, one unpadded prompt at a time: LD = logit(true) - logit(pair partner's label), argmax accuracy
    samples = make_dataset(task, n_pairs=6, n_distractors=nd, seed=0)
    ids, samples = tokenize_samples(samples, tok)
    lab = label_token_ids(tok, task)
    partner = {(s.pair_id, s.label): o.label for s in samples for o in samples
               if o.pair_id == s.pair_id and o is not s}
    spec = RecircSpec(3, 1, 1.0, "convex")
    for cond in ("uniform", "targeted"):
        lds, acc = [], []
        for s, row in zip(samples, ids):
            x = torch.tensor([row])
            m = torch.zeros_like(x, dtype=torch.bool)
            m[0, 2] = True
            z = RecirculatedLM(model, spec).prefill(x, torch.ones_like(x), cols=torch.tensor([len(row) - 1]),
                                                    mix_mask=m if cond == "targeted" else None).logits[0, 0, lab]
            lds.append(float(z[s.label] - z[partner[(s.pair_id, s.label)]]))
            top = (z == z.max()).double()
            acc.append(float(top[s.label] / top.sum()))
        assert abs(res["points"][-1][cond]["mean_ld"] - np.mean(lds)) < 1e-4, cond
        assert abs(res["points"][-1][cond]["accuracy"] - np.mean(acc)) < 1e-9, cond
    # targeted is not uniform (the comparison is not vacuous)
    assert abs(res["points"][-1]["targeted"]["mean_ld"] - res["points"][-1]["uniform"]["mean_ld"]) > 1e-3


def test_targeted_needs_two_groups_and_key_tokens(task_model, monkeypatch):
    import tasks
    from analysis.recirculation.targeted import targeted

    model, tok = task_model
    monkeypatch.setattr(tasks, "key_token_positions", _stub_keys, raising=False)
    with pytest.raises(UserError, match="at least 2"):  # memory without distractors: one template, one group
        targeted(model, tok, "3:1", "memory", 4, 0, [0.5], 4, 0)
    monkeypatch.setattr(tasks, "key_token_positions", lambda s, t: [99] * len(s))
    with pytest.raises(UserError, match="outside its"):
        targeted(model, tok, "3:1", "memory", 4, 2, [0.5], 4, 0)


def test_default_targeted_spec_fits_every_depth():
    from analysis.recirculation.targeted import default_sd, parse_sd

    assert default_sd(30) == default_sd(20) == "20:2:residual" and default_sd(12) == "8:1:residual"
    for L in range(1, 40):
        s, d, mode = parse_sd(default_sd(L), L)
        assert 0 <= d < s <= L and mode == "residual"
    for bad in ("20", "20:2:sideways", "2:2", "a:b"):
        with pytest.raises(UserError):
            parse_sd(bad)
    with pytest.raises(UserError, match="out of range"):
        parse_sd("20:2", 12)


def test_targeted_only_cli(task_model, tmp_path, monkeypatch):
    import json

    import tasks
    from analysis.recirculation.cli import main

    model, tok = task_model
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    monkeypatch.setattr(tasks, "key_token_positions", _stub_keys, raising=False)
    monkeypatch.chdir(tmp_path)
    res = main(["--model", str(tmp_path / "m"), "--targeted-only", "--targeted-task", "memory",
                "--targeted-pairs", "6", "--targeted-distractors", "2", "--targeted-alphas", "0.5,0.2",
                "--batch", "3"])
    outs = list((tmp_path / "figures").glob("*/targeted-memory"))
    assert len(outs) == 1
    saved = json.loads((outs[0] / "results.json").read_text())
    assert "heatmap" not in saved and "mediation" not in saved  # no text experiments
    tg = saved["targeted"]
    assert tg["spec"] == "2:1:residual" and tg["alphas"] == [0.2, 0.5]  # the default spec for 3 layers
    assert tg == json.loads(json.dumps(res["targeted"]))
    assert (outs[0] / "targeted.html").is_file() and not (outs[0] / "heatmap.html").exists()


@pytest.mark.parametrize("args,msg", [
    (["--targeted", "--targeted-spec", "3-1"], "--targeted-spec"),
    (["--targeted-alphas", "0.1,2"], "--targeted-alphas"),
    (["--targeted-only", "--targeted-task", "nope"], "--targeted-task"),
    (["--targeted-only", "--mediation-only"], "exclude each other"),
    (["--targeted-pairs", "0"], "--targeted-pairs"),
    # a flag of an experiment the run does not run: refused, not read and ignored
    (["--targeted-only", "--seq-len", "32", "--temps=1.1"], "--seq-len, --temps would have no effect: --targeted-only"),
    (["--mediation-only", "--mediation-spec", "2:1:0.1", "--pairs", "2:1"], "--pairs would have no effect"),
    (["--targeted-only", "--alpha", "0.3"], "--alpha would have no effect"),
    (["--mediation-pairs", "8"], "the mediation experiment runs only with --mediation"),
    (["--targeted-spec", "2:1"], "the targeted experiment runs only with --targeted"),
    (["--mediation-only", "--mediation"], "--mediation-only runs the mediation experiment already"),
    (["--alphas", "0,0"], "--alphas needs at least one alpha above 0"),
    (["--mediation-only", "--targeted-a", "0.5"], "--targeted-alphas would have no effect"),  # an abbreviation
])
def test_targeted_cli_bad_input_one_line(tmp_path, capsys, args, msg):
    from analysis.recirculation.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent/model-dir", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and msg in err[0], err
    assert not (tmp_path / "o").exists()


def test_targeted_refuses_the_byte_tokenizer_before_the_text_experiments(tmp_path, capsys):
    from analysis.recirculation.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny-random-gpt2", "--targeted", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "real tokenizer" in err[0], err


def test_mediation_with_three_label_words(task_model):
    """(f) on shell_game (K = 3): LD against the pair partner's label, the task subspace = the span of the
    class-centred multinomial weights (rank K - 1 = 2), complement of rank D - 2, random subspace of rank 2."""
    import numpy as np

    from analysis.recirculation.mediation import mediation, pair_partner_labels
    from tasks import make_dataset

    model, tok = task_model
    med = mediation(model, tok, [RecircSpec(3, 1, 0.5, "residual")], "shell_game", 18, 2, 8, 0)
    assert set(med["conditions"]) == {"base", "full", "task_subspace", "complement", "random_subspace"}
    assert med["n_classes"] == 3 and med["rank"] == 2
    assert med["subspace_ranks"] == {"task_subspace": 2, "complement": 30, "random_subspace": 2}
    for name, c in med["conditions"].items():
        assert all(np.isfinite(v) for v in c.values()) and 0 <= c["accuracy"] <= 1, name
    assert med["conditions"]["base"]["mean_ld_change"] == 0.0
    assert abs(med["conditions"]["full"]["mean_ld_change"]) > 1e-4
    samples = make_dataset("shell_game", n_pairs=18, n_distractors=2, seed=0)
    other = pair_partner_labels(samples)
    for i, s in enumerate(samples):
        (o,) = [t for t in samples if t.pair_id == s.pair_id and t is not s]
        assert other[i] == o.label != s.label


def test_probe_subspace_spans_the_class_weights():
    import numpy as np

    from analysis.recirculation.mediation import probe_subspace
    from stats.linear import LinearProbe

    rng = np.random.default_rng(0)
    for K in (2, 3, 4):
        y = np.repeat(np.arange(K), 20)
        X = rng.normal(size=(len(y), 16)) + 2.0 * np.eye(16)[y]
        probe = LinearProbe().fit(X, y, np.arange(len(y)) // 2)
        U = probe_subspace(probe).double().numpy()
        assert U.shape == (16, 1 if K == 2 else K - 1)
        assert np.allclose(U.T @ U, np.eye(U.shape[1]), atol=1e-5)
        if K == 2:
            assert np.allclose(U[:, 0], probe.direction, atol=1e-6)
        else:
            W = probe.clf_.coef_ / probe.scaler_.scale_
            W = W - W.mean(0)
            assert np.abs(W - W @ U @ U.T).max() <= 1e-5 * np.abs(W).max()
