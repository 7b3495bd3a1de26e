"""Mutation-testing gaps in probes/{mdl,lens,methods}.py and models/families.py: each test checks behaviour against a
hand-written reference or an invariant taken from the documented definitions (docstrings, docs/), and names in its
docstring the mutant it was written to kill (a one-line change of the code that the rest of the suite let pass)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import UserError
from test_mdl import paired as _mdl_paired


def paired(n_pairs=60, d=8, shift=3.0, k=3, seed=0):
    """tests/test_mdl.py's planted pairs (one group each), at this file's defaults; without the generator."""
    return _mdl_paired(n_pairs=n_pairs, d=d, shift=shift, k=k, seed=seed)[:3]


# ---------------------------------------------------------------------------------------------------------- mdl

def test_block_ends_are_the_doubling_chunk_counts_of_the_requested_chunks():
    """probes/mdl.py module doc: the groups are dealt into `n_chunks` chunks, each a test fold of
    StratifiedGroupKFold(n_chunks, shuffle=True, random_state) in order; blocks end at chunk counts c0, 2 c0, 4 c0, ...,
    n_chunks, c0 the fewest leading chunks holding every class in >= 2 groups. Reference rebuilt here by hand.
    Mutants killed: `k = min(int(n_chunks) - 1, per_class)` (n_chunks not honoured), `c *= 2` -> `c += 1` (no
    doubling), `sizes[c - 1]` -> `sizes[c]` (block ends one chunk late)."""
    from sklearn.model_selection import StratifiedGroupKFold

    from probes.mdl import block_plan
    from stats.linear import ProbeConfig

    _, y, groups = paired()
    n_chunks = 16
    plan = block_plan(y, groups, ProbeConfig(random_state=3), n_chunks=n_chunks)
    assert plan.n_chunks == n_chunks
    cv = StratifiedGroupKFold(n_splits=n_chunks, shuffle=True, random_state=3)
    chunks = [te for _, te in cv.split(np.zeros(len(y)), y, groups)]
    assert np.array_equal(plan.order, np.concatenate(chunks))
    sizes = np.cumsum([len(c) for c in chunks])
    order = np.concatenate(chunks)
    c0 = next(i for i in range(1, n_chunks + 1)
              if all(len(set(groups[order[:sizes[i - 1]]][y[order[:sizes[i - 1]]] == c])) >= 2 for c in range(3)))
    want, c = [], c0
    while c < n_chunks:
        want.append(int(sizes[c - 1]))
        c *= 2
    want.append(len(y))
    assert len(want) >= 3  # the case exercises at least two doublings
    assert list(plan.ends) == want


def test_a_first_block_that_needs_every_chunk_is_refused():
    """Each class in exactly two groups: the two chunks each hold one group per class, so the first block would need
    both chunks (every group) and nothing would be left to encode online: UserError (block_plan). Mutant killed:
    `if c0 is None or c0 == k` -> `if c0 is None` (an "online" code that is the uniform code, silently)."""
    from probes.mdl import block_plan

    y = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    with pytest.raises(UserError, match="too few groups"):
        block_plan(y, groups)


def test_an_unseen_class_costs_the_escape_charge():
    """_neg_log2_prob(missing_ok=True): a row whose class the probe never saw costs log2(number of known classes + 1)
    bits (docstring); the seen rows keep their -log2 sigmoid cost. Mutant killed: `len(classes) + 1` -> `len(classes)`."""
    from probes.mdl import _neg_log2_prob

    s = np.array([0.5, 2.0, -1.0])
    got = _neg_log2_prob(s, np.array([0, 1]), np.array([2, 1, 0]), missing_ok=True)
    assert got[0] == pytest.approx(np.log2(3.0))
    assert got[1] == pytest.approx(-np.log2(1 / (1 + np.exp(-2.0))))
    assert got[2] == pytest.approx(-np.log2(1 - 1 / (1 + np.exp(1.0))))
    S = np.zeros((2, 3))
    got = _neg_log2_prob(S, np.array([0, 1, 2]), np.array([5, 1]), missing_ok=True)
    assert got.tolist() == pytest.approx([np.log2(4.0), np.log2(3.0)])
    with pytest.raises(UserError):
        _neg_log2_prob(S, np.array([0, 1, 2]), np.array([5, 1]))


@pytest.mark.parametrize("y, groups, seed", [([0, 1, 1, 0], [3, 0, 3, 1], 51),
                                              ([1, 0, 1, 1, 1, 0, 0, 0, 0], [1, 4, 1, 3, 2, 4, 2, 4, 4], 74)])
def test_c_search_leaves_out_inner_splits_whose_training_side_has_one_class(y, groups, seed):
    """StratifiedGroupKFold can put every group of a class in one test fold (these inputs do, found by search):
    such a split's training side has one class and nothing to fit; the C search drops it and still chooses a C."""
    import warnings

    from sklearn.model_selection import StratifiedGroupKFold

    from probes.mdl import _best_c, _c_splits
    from stats.linear import ProbeConfig

    y, groups = np.array(y), np.array(groups)
    config = ProbeConfig(random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        raw = list(StratifiedGroupKFold(n_splits=2, shuffle=True, random_state=seed).split(y[:, None], y, groups))
    assert any(len(set(y[tr])) == 1 for tr, _ in raw)  # the case under test occurs
    kept = _c_splits(y, groups, config)
    assert kept and len(kept) < len(raw)
    assert all(len(set(y[tr])) == 2 for tr, _ in kept)
    X = np.random.default_rng(0).normal(size=(len(y), 3)) + y[:, None]
    assert _best_c(X, y, groups, config) in config.Cs


def test_no_c_search_takes_the_middle_c():
    """_best_c: no search possible (splits None) -> the middle C of the sorted config.Cs (docstring). Mutant killed:
    `Cs[len(Cs) // 2]` -> `Cs[0]`."""
    from probes.mdl import _best_c
    from stats.linear import ProbeConfig

    X, y, groups = paired(n_pairs=6)
    assert _best_c(X, y, groups, ProbeConfig(Cs=(100.0, 0.01, 1.0)), splits=None) == 1.0
    assert _best_c(X, y, groups, ProbeConfig(Cs=(10.0, 0.1, 1.0, 0.01)), splits=None) == 1.0


# ---------------------------------------------------------------------------------------------------------- lens

def _rms_lens(model, x):
    """The lens by hand: the final norm (Qwen3 RMSNorm x / sqrt(mean(x^2) + eps) * w; GPT-2 LayerNorm
    (x - mean) / sqrt(var + eps) * w + b), then W_U."""
    from probes.lens import final_norm

    norm = final_norm(model.lm)
    if isinstance(norm, nn.LayerNorm):
        c = x - x.mean(-1, keepdim=True)
        h = c / torch.sqrt((c ** 2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias
    else:
        h = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * norm.weight
    return (h @ model.lm.get_output_embeddings().weight.T).detach()


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_the_lens_in_small_chunks_is_the_lens_by_hand(tiny_model, chunk):
    """lens_logits reads the rows `chunk` at a time (bounded memory); every row is the final norm and W_U by hand.
    Mutants killed: `flat[i:i + chunk]` -> `flat[i:i + chunk - 1]` and `range(0, len(flat), chunk)` ->
    `range(0, len(flat) - 1, chunk)` (rows lost between chunks)."""
    from probes.lens import lens_logits

    x = torch.randn(5, tiny_model.d_model, generator=torch.Generator().manual_seed(2)) * 2
    got = lens_logits(tiny_model, x, chunk=chunk)
    assert got.shape == (5, tiny_model.lm.get_output_embeddings().weight.shape[0])
    assert torch.allclose(got, _rms_lens(tiny_model, x), atol=1e-5)


def test_a_single_label_word_is_refused():
    """label_margin_and_rank needs >= 2 label words (its UserError): with one, "the max over the other label words" is
    over nothing (LD would be +inf). Mutant killed: `K < 2` -> `K < 1`."""
    from probes.lens import label_margin_and_rank

    with pytest.raises(UserError, match=">= 2 label words"):
        label_margin_and_rank(torch.zeros(2, 4), [0, 0], (1,))


def test_depth_lens_ci_uses_the_given_seed(tiny_model):
    """depth_lens' CI is the group bootstrap (seed `seed`) of the per-row LD, LD by hand from the lens by hand.
    Mutant killed: depth_lens passing seed 0 to lens_summary whatever `seed` is."""
    from probes.lens import depth_lens
    from stats.bootstrap import group_bootstrap_ci

    g = torch.Generator().manual_seed(4)
    n, L1 = 12, 2
    acts = torch.randn(n, L1, tiny_model.d_model, generator=g) * 2
    labels = np.array([0, 1] * (n // 2))
    groups = np.repeat(np.arange(n // 2), 2)
    ids = (3, 5)
    out7 = depth_lens(tiny_model, acts, labels, ids, groups, n_boot=64, seed=7)
    for d in range(L1):
        z = _rms_lens(tiny_model, acts[:, d]).double().numpy()
        own = z[np.arange(n), np.array(ids)[labels]]
        other = z[np.arange(n), np.array(ids)[1 - labels]]
        ld = own - other
        assert out7[d]["logit_lens_ld"] == pytest.approx(ld.mean(), abs=1e-5)
        want7, want0 = group_bootstrap_ci(ld, groups, 64, 7), group_bootstrap_ci(ld, groups, 64, 0)
        assert want7 != pytest.approx(want0)  # the case tells the seeds apart
        assert out7[d]["logit_lens_ld_ci"] == pytest.approx(want7, abs=1e-5)


def test_fed_states_keep_the_last_row_of_an_uneven_batching(tiny_model):
    """fed_states runs the rows batch_size at a time; the batching changes nothing, so 3 rows in batches of 2 are the
    rows in one batch, none left at zero. Mutant killed: `range(0, len(order), batch_size)` ->
    `range(0, len(order) - 1, batch_size)` (the last row never computed)."""
    from probes.lens import fed_states

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(2, tiny_model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 6, 7)]
    one = fed_states(tiny_model, seqs, "recurrent-1", batch_size=8)
    two = fed_states(tiny_model, seqs, "recurrent-1", batch_size=2)
    assert np.abs(one).sum(1).min() > 0
    assert np.allclose(two, one, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------- methods

def test_method_fields_put_each_depths_mdl_on_its_row_and_none_when_off():
    """MethodFields.add: row d gets depth d's mdl_* fields (constant features at depth 0 cost exactly the uniform code,
    compression 1; separable ones at depth 1 compress), all None with mdl off; no label ids: lens fields None.
    Mutants killed: `mdl[d]` -> `mdl[0]`, and computing the MDL fields when `mdl` is False."""
    from probes.lens import LENS_FIELDS
    from probes.mdl import MDL_FIELDS
    from probes.methods import MethodFields
    from stats.linear import ProbeConfig

    X, y, groups = paired(n_pairs=48, k=2)
    acts = np.stack([np.zeros_like(X), X], 1)  # [n, 2, d]
    config = ProbeConfig(n_boot=10)
    rows = MethodFields(None, None, config, mdl=True).add([{}, {}], acts, y, groups)
    assert rows[0]["mdl_compression"] == pytest.approx(1.0, abs=1e-9)
    assert rows[0]["mdl_uniform_bits"] == pytest.approx(len(y))
    assert rows[1]["mdl_compression"] > 2.0
    assert all(r[f] is None for r in rows for f in LENS_FIELDS)
    rows = MethodFields(None, None, config, mdl=False).add([{}, {}], acts, y, groups)
    assert all(r[f] is None for r in rows for f in MDL_FIELDS)


# ---------------------------------------------------------------------------------------------------------- families

def test_embed_scale_is_one_without_an_embed_scale_attribute():
    """Family.embed_scale: the embedding module's `embed_scale` (Gemma: sqrt(width)), else 1 (docstring). Mutant
    killed: the default 1.0 -> 0.0."""
    from models.families import family_of

    class Base(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.embed_tokens = emb

    class LM(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.model = Base(emb)

        @property
        def base_model(self):
            return self.model

    plain = nn.Embedding(4, 3)
    scaled = nn.Embedding(4, 3)
    scaled.embed_scale = torch.tensor(2.5)
    fam = family_of({"model_type": "llama"})
    assert fam.embed_scale(LM(plain)) == 1.0
    assert fam.embed_scale(LM(scaled)) == 2.5


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "olmo2"])
def test_sandwich_norm_sites_are_the_matching_post_norms(model_type):
    """residual_update: in a model type with sandwich norms, attn_out is the attention's post-norm
    (post_attention_layernorm) and mlp_out the MLP's (post_feedforward_layernorm) (models/families.py module doc);
    elsewhere the attention and the MLP themselves. Mutant killed: the two post-norms swapped."""
    from models.families import family_of

    block = nn.Module()
    for name in ("self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm"):
        setattr(block, name, nn.Identity())
    fam = family_of({"model_type": model_type})
    assert fam.residual_update(block, "attn_out", model_type) is block.post_attention_layernorm
    assert fam.residual_update(block, "mlp_out", model_type) is block.post_feedforward_layernorm
    plain = "gemma" if model_type.startswith("gemma") else "olmo"
    assert fam.residual_update(block, "attn_out", plain) is block.self_attn
    assert fam.residual_update(block, "mlp_out", plain) is block.mlp


def test_the_fed_state_row_reads_the_lens_without_a_second_norm(tiny_model):
    """MethodFields.fed_state: the fed state h_{T-1} is already post-final-norm, so its lens is W_U h_{T-1} without the
    norm (probes/lens.py module doc); LD by hand from W_U and the fed states. The final norm's weight is moved off 1 for
    the test (a unit-weight norm is nearly idempotent). Mutant killed: `normed=True` -> `normed=False`."""
    from probes.lens import fed_states, final_norm
    from probes.methods import MethodFields
    from stats.linear import ProbeConfig

    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(2, tiny_model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 6, 6, 7)]
    y, groups, ids = np.array([0, 1, 1, 0]), np.array([0, 0, 1, 1]), (3, 5)
    w = final_norm(tiny_model.lm).weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.copy_(torch.linspace(0.2, 3.0, len(w)))
        h = torch.as_tensor(fed_states(tiny_model, seqs, "recurrent-1", batch_size=4))
        z = (h @ tiny_model.lm.get_output_embeddings().weight.T).detach().double().numpy()
        ld = z[np.arange(4), np.array(ids)[y]] - z[np.arange(4), np.array(ids)[1 - y]]
        [row] = MethodFields(tiny_model, ids, ProbeConfig(n_boot=10), mdl=False).fed_state(
            "t", "m", "recurrent-1", 2, seqs, y, groups, pad_id=0, batch_size=4)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert row["state"] == "h_{T-1}" and row["n_samples"] == 4
    assert row["logit_lens_ld"] == pytest.approx(ld.mean(), abs=1e-4)


def test_method_fields_read_the_lens_against_the_answers_not_the_probe_labels(tiny_model):
    """MethodFields.add: `answers` (default `y`) are the label indices the lens reads as words; where the probes fit
    other labels (the pair role) the lens LD is still the own answer's word minus the other's, by hand from the
    final norm and W_U. Mutant killed: the lens reading `y` whatever `answers` is."""
    from probes.methods import MethodFields
    from stats.linear import ProbeConfig

    acts = torch.randn(6, 2, tiny_model.d_model, generator=torch.Generator().manual_seed(8)) * 2
    y, answers = np.array([0, 1, 0, 1, 0, 1]), np.array([0, 0, 1, 1, 1, 0])
    groups, ids = np.repeat(np.arange(3), 2), (3, 5)
    rows = MethodFields(tiny_model, ids, ProbeConfig(n_boot=10), mdl=False).add(
        [{}, {}], acts, y, groups, answers=answers)
    for d in range(2):
        z = _rms_lens(tiny_model, acts[:, d]).double().numpy()
        ld = z[np.arange(6), np.array(ids)[answers]] - z[np.arange(6), np.array(ids)[1 - answers]]
        assert rows[d]["logit_lens_ld"] == pytest.approx(ld.mean(), abs=1e-5)
        assert rows[d]["mdl_compression"] is None


def test_a_layer_types_rule_without_layer_types_is_full_attention():
    """Family.windows: Qwen2/3 window only the layers `layer_types` marks "sliding_attention" (module doc,
    `window_rules`); a config without layer_types has no sliding layer, whatever its sliding_window says.
    Mutant killed: dropping `and types` from the layer_types rule (a crash on a config without layer_types)."""
    from models.families import family_of

    for mt in ("qwen2", "qwen3"):
        cfg = {"model_type": mt, "num_hidden_layers": 3, "sliding_window": 4}
        assert family_of(cfg).windows(cfg) == [None, None, None]
        typed = {**cfg, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
        assert family_of(typed).windows(typed) == [4, None, 4]
    mistral = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 4}
    assert family_of(mistral).windows(mistral) == [4, 4]


def test_config_dicts_read_each_familys_own_field_names():
    """family_of takes a config dict too (module doc), whose keys are the config.json spellings with no HF
    attribute_map behind them: GPT-2 gives depth / width / heads / context as n_layer, n_embd, n_head, n_positions;
    GPT-Neo its depth and heads as num_layers, num_heads. Mutants killed: GPT-2's `context_field="n_positions"` and
    GPT-Neo's `heads_field="num_heads"` dropped (the defaults read None from a dict)."""
    from models.families import family_of

    gpt2 = {"model_type": "gpt2", "n_layer": 3, "n_embd": 48, "n_head": 4, "n_positions": 128, "head_dim": 7}
    f = family_of(gpt2)
    assert (f.depth(gpt2), f.width(gpt2), f.heads(gpt2), f.context(gpt2), f.head_dim(gpt2)) == (3, 48, 4, 128, 12)
    neo = {"model_type": "gpt_neo", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
           "max_position_embeddings": 64}
    f = family_of(neo)
    assert (f.depth(neo), f.width(neo), f.heads(neo), f.context(neo), f.head_dim(neo)) == (2, 32, 4, 64, 8)
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
             "head_dim": 16, "max_position_embeddings": 64}
    f = family_of(llama)
    assert (f.depth(llama), f.width(llama), f.heads(llama), f.context(llama), f.head_dim(llama)) == (2, 32, 4, 64, 16)
