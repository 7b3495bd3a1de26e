"""The gated state fusion and its place in FullBandwidthLM, checked against hand-written references."""
from __future__ import annotations

import nnsight
import torch
from nnsight import NNsight

from models.fusion import Fusion


def ref_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_fusion(fusion: Fusion, state: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """rms_norm((h @ W_U.T) * sigmoid(e @ W_G.T)) * weight, written out by hand."""
    value = state @ fusion.up.weight.T
    gate = 1.0 / (1.0 + torch.exp(-(embed @ fusion.gate.weight.T)))
    return ref_rms_norm(value * gate, fusion.norm.eps) * fusion.norm.weight


def _inputs(model, batch=2, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (batch, T), generator=g)
    mask = torch.ones_like(ids)
    state = torch.randn(batch, T, model.d_model, generator=g)
    fuse = torch.rand(batch, T, generator=g) < 0.5
    fuse[:, 0] = False
    fuse[:, 1] = True  # at least one fused position per row
    return ids, mask, state, fuse


@torch.no_grad()
def test_fusion_matches_hand_written_formula():
    torch.manual_seed(0)
    fusion = Fusion(32).eval()
    fusion.norm.weight.copy_(torch.randn(32))  # a non-trivial norm weight
    state, embed = torch.randn(3, 5, 32), torch.randn(3, 5, 32)
    out = fusion(state, embed)
    assert out.shape == (3, 5, 32)
    assert torch.allclose(out, ref_fusion(fusion, state, embed), atol=1e-6, rtol=0)


@torch.no_grad()
def test_fusion_is_multiplicative_in_the_state():
    """The state is on the value path: a zero state gives a zero fused input (no additive token path)."""
    torch.manual_seed(0)
    fusion = Fusion(32).eval()
    out = fusion(torch.zeros(1, 3, 32), torch.randn(1, 3, 32))
    assert torch.count_nonzero(out) == 0


@torch.no_grad()
def test_forward_fuses_exactly_where_fuse_mask_is_true(tiny_model):
    model = tiny_model
    ids, mask, state, fuse = _inputs(model)
    emb = model.lm.get_input_embeddings()(ids)
    fused = ref_fusion(model.fusion, state, emb)
    x = torch.where(fuse[..., None], fused, emb)
    hand = model.lm.base_model(inputs_embeds=x, attention_mask=mask)
    hand_top = hand.last_hidden_state
    hand_logits = hand_top @ model.lm.get_input_embeddings().weight.T  # tied LM head

    out = model(ids, mask, state, fuse)
    assert (out.top - hand_top).abs().max() <= 1e-5
    assert (out.logits - hand_logits).abs().max() <= 1e-5

    # fuse_mask=None fuses every position; an all-False mask is the plain model.
    x_all = model.lm.base_model(inputs_embeds=fused, attention_mask=mask).last_hidden_state
    assert (model(ids, mask, state).top - x_all).abs().max() <= 1e-5
    plain = model(ids, mask)
    none_fused = model(ids, mask, state, torch.zeros_like(fuse))
    assert torch.equal(none_fused.logits, plain.logits)
    # ... and the plain model is the wrapped HF model.
    assert (plain.logits - model.lm(ids, attention_mask=mask).logits).abs().max() <= 1e-5
    # The state matters only where fused: perturbing it at unfused positions changes nothing.
    state2 = state.clone()
    state2[~fuse] += 10.0
    assert torch.equal(model(ids, mask, state2, fuse).logits, out.logits)


def test_fusion_is_a_named_submodule(tiny_model):
    names = dict(tiny_model.named_modules())
    for n in ("fusion", "fusion.up", "fusion.gate", "fusion.norm"):
        assert n in names
    assert isinstance(names["fusion"], Fusion)
    params = dict(tiny_model.named_parameters())
    d = tiny_model.d_model
    assert params["fusion.up.weight"].shape == (d, d)
    assert params["fusion.gate.weight"].shape == (d, d)
    assert params["fusion.norm.weight"].shape == (d,)


def test_nnsight_reads_the_fusion(tiny_model):
    model = tiny_model
    ids, mask, state, fuse = _inputs(model)
    nm = NNsight(model)
    with nm.trace(ids, mask, state, fuse):
        up = nnsight.save(nm.fusion.up.output)  # modules must be read in execution order
        out = nnsight.save(nm.fusion.output)
        logits = nnsight.save(nm.output.logits)
    with torch.no_grad():
        emb = model.embed(ids)
        assert torch.equal(out, model.fusion(state, emb))
        assert torch.equal(up, model.fusion.up(state))
        assert torch.equal(logits, model(ids, mask, state, fuse).logits)


def test_nnsight_patches_the_fusion(tiny_model):
    model = tiny_model
    ids, mask, state, fuse = _inputs(model)
    with torch.no_grad():
        emb = model.embed(ids)
        plain = model(ids, mask).logits
        fused = model(ids, mask, state, fuse).logits
    assert (plain - fused).abs().max() > 1e-3
    nm = NNsight(model)
    # Replacing the fusion's output by the token embeddings gives the unfused model.
    with nm.trace(ids, mask, state, fuse):
        nm.fusion.output = emb
        patched = nnsight.save(nm.output.logits)
    assert (patched - plain).abs().max() <= 1e-6
    # The patch does not leak into later, unpatched traces.
    with nm.trace(ids, mask, state, fuse):
        again = nnsight.save(nm.output.logits)
    assert (again - fused).abs().max() <= 1e-6


def test_a_padded_float64_batch_is_finite_and_equals_each_row_alone(tiny_model):
    """float64 takes SDPA on a padded batch: HF's eager attention makes NaN of a fully masked padding query there,
    and the next layer would carry it into the real rows."""
    import copy

    from engine.inputs import pad_left

    model = copy.deepcopy(tiny_model).double()
    rows = [[5, 9, 2, 7, 3], [6, 1, 12]]
    ids, mask = pad_left(rows)
    with torch.no_grad():
        out = model(ids, mask)
        for r, row in enumerate(rows):
            alone = model(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))
            assert torch.isfinite(out.logits[r, -len(row):]).all()
            torch.testing.assert_close(out.logits[r, -1], alone.logits[0, -1], atol=1e-9, rtol=1e-9)
