"""Mutation-testing gaps in models/ helpers (tokenizers, checkpoints, fingerprint, configs) and the recirculation
study's basis, cost and text: each test checks a documented invariant or a hand-written reference."""
from __future__ import annotations

import hashlib
import json
import math
import types

import pytest
import torch

from common.errors import UserError
from test_mutants_engine_core import _fake_model as fake_model  # an embedding of `vocab` rows


# ---------------------------------------------------------------- models.tokenizers

def test_has_tokenizer_files_accepts_exactly_the_documented_layouts(tmp_path):
    from models.tokenizers import has_tokenizer_files

    def folder(name, *files):
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).write_text("{}")
        return d

    assert has_tokenizer_files(folder("fast", "tokenizer.json"))
    assert has_tokenizer_files(folder("slow", "tokenizer_config.json", "vocab.txt"))
    assert not has_tokenizer_files(folder("cfg_only", "tokenizer_config.json"))
    assert not has_tokenizer_files(folder("vocab_only", "vocab.json", "merges.txt"))
    assert not has_tokenizer_files(folder("empty"))



def test_a_tokenizer_with_an_empty_vocabulary_is_refused_in_one_line(tmp_path):
    from tokenizers import Tokenizer, models

    from models.tokenizers import load_tokenizer_dir

    Tokenizer(models.WordLevel({}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="its vocabulary is empty"):
        load_tokenizer_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt tokenizer"):
        load_tokenizer_dir(tmp_path)


def _fake_tok(ids):
    return types.SimpleNamespace(get_vocab=lambda: {f"w{i}": i for i in ids})


def test_check_fits_accepts_the_last_row_and_refuses_one_past_it():
    from models.tokenizers import check_fits

    check_fits(_fake_tok([0, 3, 9]), fake_model(10), "t")  # ids 0..9 on a 10-row embedding: fits
    with pytest.raises(UserError, match="token ids up to 10, the model's embedding has 10 rows"):
        check_fits(_fake_tok([0, 10]), fake_model(10), "t")
    with pytest.raises(UserError, match="up to 12"):
        check_fits(_fake_tok([12, 0, 5]), fake_model(10), "t")  # the largest id decides, wherever it is


def test_tokenizer_source_refusals_and_presets(tmp_path, monkeypatch):
    import models.checkpoints as ck
    from models.tokenizers import tokenizer_source

    f = tmp_path / "file.json"
    f.write_text("{}")
    with pytest.raises(UserError, match="not a folder"):
        tokenizer_source(str(f))
    assert tokenizer_source(str(tmp_path)) == (tmp_path, str(tmp_path))
    with pytest.raises(UserError, match="neither an existing folder nor a preset") as e:
        tokenizer_source(str(tmp_path / "nope"))
    listed = str(e.value).split("(", 1)[1]
    assert "tiny-fbt" in listed and "smoke" not in listed  # the smoke preset is not offered
    monkeypatch.setattr(ck, "checkpoint_dir", lambda name: tmp_path / "ck" / name)
    with pytest.raises(UserError, match="has no checkpoint"):
        tokenizer_source("tiny-std")
    (tmp_path / "ck" / "tiny-std").mkdir(parents=True)
    assert tokenizer_source("tiny-std")[0] == tmp_path / "ck" / "tiny-std"


def test_resolve_tokenizer_returns_the_named_one_over_the_models_own(tiny_ckpt):
    from models.tokenizers import load_tokenizer_dir, resolve_tokenizer

    named = load_tokenizer_dir(tiny_ckpt)
    rows = len(named.get_vocab())
    own = _fake_tok([0])
    got = resolve_tokenizer(fake_model(rows), own, "m", str(tiny_ckpt))
    assert got is not own and got.get_vocab() == named.get_vocab()
    assert resolve_tokenizer(fake_model(rows), own, "m") is own
    with pytest.raises(UserError, match="does not fit"):
        resolve_tokenizer(fake_model(rows - 1), own, "m", str(tiny_ckpt))


# ---------------------------------------------------------------- models.checkpoints

def _ckpt(path, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "train_log.json").write_text(json.dumps({"config": config}))
    return path


def test_fusion_trained_reads_the_recipe(tmp_path, monkeypatch):
    from models.checkpoints import fusion_trained

    assert fusion_trained(_ckpt(tmp_path / "one", schedule="1")) is False  # no objective: multipass, one pass
    assert fusion_trained(_ckpt(tmp_path / "two", schedule="1/0.5")) is True  # a second pass drawn
    assert fusion_trained(_ckpt(tmp_path / "zero", schedule="1/0")) is False  # weight 0: never drawn
    assert fusion_trained(_ckpt(tmp_path / "rec", schedule="1", objective="recurrent")) is True
    assert fusion_trained(tmp_path / "none") is None
    # a base, by a path relative to the working folder, whose own training ran the fusion
    monkeypatch.chdir(tmp_path)
    assert fusion_trained(_ckpt(tmp_path / "cont", schedule="1", base="two")) is True
    # a base that names itself: no answer, never a RecursionError
    assert fusion_trained(_ckpt(tmp_path / "loop", schedule="1", base=str(tmp_path / "loop"))) is None
    assert fusion_trained(_ckpt(tmp_path / "gone", schedule="1", base=str(tmp_path / "missing"))) is None


def test_checkpoint_dir_search_path_and_fallback(tmp_path, monkeypatch):
    from common.paths import CHECKPOINTS_ENV, PACKAGE_CHECKPOINTS
    from models.checkpoints import checkpoint_dir

    (tmp_path / "a" / "x").mkdir(parents=True)
    (tmp_path / "b" / "x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CHECKPOINTS_ENV, f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert checkpoint_dir("x") == tmp_path / "a" / "x"  # the first root that holds it
    assert checkpoint_dir("no-such-ckpt-zz") == PACKAGE_CHECKPOINTS / "no-such-ckpt-zz"
    monkeypatch.setenv(CHECKPOINTS_ENV, str(PACKAGE_CHECKPOINTS))  # the package's folder first: still the fallback
    assert checkpoint_dir("no-such-ckpt-zz") == PACKAGE_CHECKPOINTS / "no-such-ckpt-zz"


# ---------------------------------------------------------------- models.fingerprint

class _Bufs(torch.nn.Module):
    def __init__(self, items):
        super().__init__()
        for name, t in items:
            self.register_buffer(name, t)


def test_weights_hash_tells_shape_and_dtype_apart_and_ignores_registration_order():
    from models.fingerprint import weights_hash

    t = torch.arange(6, dtype=torch.float32)
    base = weights_hash(_Bufs([("w", t.reshape(2, 3))]))
    assert weights_hash(_Bufs([("w", t.reshape(3, 2))])) != base  # same bytes, another shape
    assert weights_hash(_Bufs([("w", t.reshape(2, 3).view(torch.int32))])) != base  # same bytes, another dtype
    a, b = torch.ones(2), torch.zeros(3)
    assert weights_hash(_Bufs([("a", a), ("b", b)])) == weights_hash(_Bufs([("b", b), ("a", a)]))


def test_config_hash_of_a_bare_config_is_sorted_json_without_the_saving_entries(tiny_config):
    from models.fingerprint import config_hash

    d = {"rope_theta": 1e4, "vocab_size": 7, "_name_or_path": "/x", "transformers_version": "9", "use_cache": True}
    ref = hashlib.sha256(json.dumps({"rope_theta": 1e4, "vocab_size": 7}, sort_keys=True).encode()).hexdigest()
    assert config_hash(d) == ref
    assert config_hash(dict(reversed(list(d.items())))) == ref
    assert config_hash({**d, "_name_or_path": "/elsewhere"}) == ref
    assert config_hash({**d, "rope_theta": 2e4}) != ref


# ---------------------------------------------------------------- models.configs

def test_qwen3_config_sizes_and_window():
    from models.configs import gpt2_config, qwen3_config

    c = qwen3_config(50, n_layers=3, d_model=64, n_heads=8, n_kv_heads=2)
    assert c.head_dim == 8 and c.num_key_value_heads == 2 and c.tie_word_embeddings
    assert "sliding_attention" not in (getattr(c, "layer_types", None) or ())
    w = qwen3_config(50, n_layers=3, d_model=64, n_heads=8, n_kv_heads=2, attn_window=4)
    assert list(w.layer_types) == ["sliding_attention"] * 3 and w.sliding_window == 4
    assert gpt2_config(50, max_len=77).n_positions == 77


def test_check_config_boundaries():
    from models.configs import check_config, qwen3_config

    def cfg(**kw):
        return qwen3_config(50, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, **kw)

    check_config(cfg(), "x")
    for build, field, value, message in [
            ({}, "vocab_size", 0, "vocab_size must be a positive integer"),
            ({}, "rms_norm_eps", 0.0, "rms_norm_eps must be a finite number > 0"),
            ({"attn_window": 4}, "sliding_window", 0, "sliding_window must be an integer >= 1"),
            ({}, "num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 4")]:
        c = cfg(**build)
        setattr(c, field, value)
        with pytest.raises(UserError, match=message):
            check_config(c, "x")
    ok = types.SimpleNamespace(model_type="nope", hidden_size=32, num_attention_heads=4)
    check_config(ok, "x")  # 4 heads split 32
    bad = types.SimpleNamespace(model_type="nope", hidden_size=30, num_attention_heads=4)
    with pytest.raises(UserError, match="does not divide hidden_size 30"):
        check_config(bad, "x")
    moe = types.SimpleNamespace(model_type="nope", num_experts=4, num_experts_per_tok=4)
    check_config(moe, "x")  # every expert per token: allowed
    with pytest.raises(UserError, match="num_experts_per_tok"):
        check_config(types.SimpleNamespace(model_type="nope", num_experts=4, num_experts_per_tok=5), "x")
    scaled = types.SimpleNamespace(model_type="nope", rope_scaling={"factor": 0.0, "rope_type": "linear"})
    with pytest.raises(UserError, match="rope_scaling.factor must be a finite number > 0"):
        check_config(scaled, "x")
    odd = types.SimpleNamespace(model_type="nope", rope_theta=1e4, head_dim=5)
    with pytest.raises(UserError, match="head dimension 5 is odd"):
        check_config(odd, "x")
    check_config(types.SimpleNamespace(model_type="nope", rope_theta=1e4, head_dim=5, partial_rotary_factor=0.4),
                 "x")


# ---------------------------------------------------------------- analysis.recirculation.basis

def test_random_rotation_is_orthogonal_and_small_turns_by_about_the_angle():
    from analysis.recirculation.basis import random_rotation

    d = 64
    for R in (random_rotation(d, seed=3), random_rotation(d, angle=0.2, seed=3)):
        assert torch.allclose(R.double() @ R.double().T, torch.eye(d, dtype=torch.float64), atol=1e-5)
    R = random_rotation(d, angle=0.2, seed=3).double()
    x = torch.randn(256, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    turned = torch.arccos(torch.nn.functional.cosine_similarity(x, x @ R.T).clamp(-1, 1)).mean()
    assert 0.16 < float(turned) < 0.24  # about `angle` radians (sqrt(2) more with a mis-scaled skew matrix)


def _fake_study(tmp_spec=None, seq_len=4, n_chunks=3, cost_block=0, passes=(1, 2)):
    evals = {}

    def ev(nll, kl=0.0):
        return types.SimpleNamespace(nll=nll, ppl=math.exp(nll), kl=kl)

    base = ev(1.0)
    runs = []

    class E:
        data = [None] * n_chunks

        def run(self, r, method="sequential", **kw):
            runs.append((r, method, kw))
            if r is None:
                return base
            if isinstance(r, dict):  # basis: the transform decides
                return evals[id(r["transform"])] if id(r["transform"]) in evals else ev(1.1, 0.5)
            return ev(1.2 if method == "sequential" else 1.2 + 0.1 * kw.get("passes", 0), 0.1)

    E_test = E()
    E_test.base = base
    st = types.SimpleNamespace(
        a=types.SimpleNamespace(seq_len=seq_len, cost_block=cost_block, seed=0, small_angle=0.2),
        E_test=E_test, passes_list=list(passes), res={}, model=types.SimpleNamespace(d_model=16),
        rlm=lambda spec: spec, spec=lambda s, t, al, m, transform=None: {"transform": transform})
    return st, runs, ev


def test_cost_rows_against_a_hand_computed_table(monkeypatch):
    import analysis.recirculation.cost as cost_mod

    st, runs, _ = _fake_study(seq_len=4, n_chunks=3)
    monkeypatch.setattr(cost_mod, "_prefill_cost", lambda E, r, method, kw: (2.0, 5.0, 1))
    cost_mod.cost(st, types.SimpleNamespace(name="cfg"))
    rows = {c["method"]: c for c in st.res["cost"]["rows"]}
    assert list(rows) == ["standard (no recirculation)", "sequential (exact)", "blockwise 1 pass",
                          "blockwise 2 passes"]
    assert all(c["tokens_per_s"] == pytest.approx(12 / 2.0) for c in rows.values())  # 3 chunks of 4, in 2 s
    assert rows["sequential (exact)"]["ppl_gap_vs_sequential_pct"] == pytest.approx(0.0)
    assert rows["standard (no recirculation)"]["ppl_gap_vs_sequential_pct"] == pytest.approx(
        100 * (math.exp(1.0 - 1.2) - 1))
    assert rows["blockwise 2 passes"]["ppl_change_pct"] == pytest.approx(100 * (math.exp(1.4 - 1.0) - 1))
    assert st.res["cost"]["block"] == 4  # no --cost-block: one block of the whole chunk



def test_prefill_cost_runs_only_the_exact_sequential_engine_at_sequential_threads(monkeypatch):
    import analysis.recirculation.cost as cost_mod
    import common.cpus

    monkeypatch.setattr(common.cpus, "sequential_thread_count", lambda: 7)

    class R:
        def prefill(self, ids, mask, method, **kw):
            return None

    E = types.SimpleNamespace(model=lambda ids, mask: None, _batches=lambda: iter([(0, torch.ones(1, 3, dtype=torch.long))]))
    assert cost_mod._prefill_cost(E, R(), "sequential", {})[2] == 7
    assert cost_mod._prefill_cost(E, R(), "blockwise", {"passes": 2})[2] == torch.get_num_threads()
    assert cost_mod._prefill_cost(E, None, None, {})[2] == torch.get_num_threads()


def test_basis_test_records_each_transform_and_the_small_rotations_cosine():
    from analysis.recirculation.basis import basis_test

    st, runs, ev = _fake_study()
    spec = types.SimpleNamespace(source=1, target=0, alpha=1.0, mode="add")
    basis_test(st, spec, {"test_ppl_change_pct": 0.5, "test_kl": 0.01})
    res = st.res["basis"]
    assert res["ppl_change_pct"]["identity"] == 0.5
    assert res["ppl_change_pct"]["small_rotation"] == pytest.approx(100 * (math.exp(0.1) - 1))  # worse than base: +
    assert 0.95 < res["small_rotation_mean_cos"] < 0.995  # cos(0.2) ~ 0.98, not a random matrix's ~0
    small, haar = (r["transform"] for r, _, _ in runs)
    assert not torch.allclose(small, haar, atol=0.3)


# ---------------------------------------------------------------- analysis.recirculation.text

class _CharTok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_make_splits_chunks_and_halves_by_hand():
    from analysis.recirculation.text import make_splits

    # one document of exactly 4 chunks of 3: two tune, two held out, the last full chunk included
    tune, test = make_splits([("d", "abcdefghijkl")], _CharTok(), 3, 2, 2)
    assert sorted(map(tuple, tune.tolist() + test.tolist())) == [tuple(map(ord, s)) for s in ("abc", "def", "ghi",
                                                                                              "jkl")]
    assert {tuple(c) for c in tune.tolist()} == {tuple(map(ord, s)) for s in ("abc", "def")}
    # two documents: tune and held-out chunks come from different documents; n_test, not n_tune, held out
    tune, test = make_splits([("a", "a" * 30), ("b", "b" * 30)], _CharTok(), 3, 3, 1)
    assert len(tune) == 3 and len(test) == 1
    assert len({int(x) for x in tune.flatten()}) == 1 and int(test[0, 0]) != int(tune[0, 0])
    with pytest.raises(UserError, match="not enough text"):
        make_splits([("a", "a" * 30), ("b", "b" * 3)], _CharTok(), 3, 2, 2)  # enough to tune, too little held out


def test_byte_tokenizer_ids_fit_the_vocabulary_and_file_documents_refuse_blank_text(tmp_path):
    from analysis.recirculation.text import ByteTokenizer, file_documents

    ids = ByteTokenizer(10)(bytes(range(256)).decode("latin-1"))["input_ids"]
    assert max(ids) < 10 and min(ids) >= 2  # 0 and 1 kept out; every id a row of the model's embedding
    f = tmp_path / "blank.txt"
    f.write_text("  \n\t\n")
    with pytest.raises(UserError, match="is empty"):
        file_documents([str(f)])


def test_weights_hash_takes_a_zero_dim_parameter_and_hashes_its_bytes():
    """A scalar parameter or buffer (a learned temperature, a step counter) is hashed like any tensor: name, dtype,
    shape and bytes, by hand with hashlib; changing the scalar changes the hash (it used to raise a RuntimeError)."""
    import hashlib

    from torch import nn

    from models.fingerprint import weights_hash

    m = nn.Module()
    m.scale = nn.Parameter(torch.tensor(2.5))
    m.register_buffer("steps", torch.tensor(7, dtype=torch.int64))
    m.w = nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    h = hashlib.sha256()
    for name, t in sorted(m.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().numpy().tobytes())
    assert weights_hash(m) == h.hexdigest()
    before = weights_hash(m)
    with torch.no_grad():
        m.scale.fill_(2.75)
    assert weights_hash(m) != before
