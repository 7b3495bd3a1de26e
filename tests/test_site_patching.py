"""Patching any site under recurrent-full and recirculation, against hand-written forwards.

The references below recompute every prefix from scratch with plain HF forwards and hooks written here (no KV
cache, no engine code): the recurrence feeds each column the fusion of the previous column's top state; the
recirculation runs every earlier column as its recirculation branch (z' mixed in at depth d) and the current one
as the normal branch. A patch at column c then propagates through every later column by construction.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.errors import UserError
from engine.mixing import RecircSpec
from interventions.batch import Batch, Patch
from interventions.core import CausalContext
from models.families import family_of
from models.full_bandwidth import FullBandwidthLM

B, T, L, D, H = 4, 7, 3, 32, 4
DH = D // H


def _lm(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=D, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=H, max_position_embeddings=64, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 40, (B, T), generator=g)
    return Batch(ids, torch.ones(B, T, dtype=torch.long), torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]),
                 np.array([0, 0, 1, 1]), (3, 4))


def _block_hooks(lm, patches, col_in_forward):
    """Hand-written hooks: for each (site, layer, head, col, value), replace that column's value in this forward
    where col_in_forward(p) says it is present (returns the column index in the forward, or None)."""
    handles = []
    fam = family_of(lm)  # Llama: model.layers[i].self_attn.o_proj / .mlp; GPT-J: transformer.h[i].attn.out_proj ...
    for p in patches:
        c = col_in_forward(p)
        if c is None:
            continue
        blk = fam.layers(lm)[p.layer] if p.layer is not None else None
        if p.site == "head":
            def pre(mod, args, p=p, c=c):
                x = args[0].clone()
                x[:, c, p.head * DH:(p.head + 1) * DH] = p.value
                return (x,)
            handles.append(fam.attn_out(blk).register_forward_pre_hook(pre))
        elif p.site == "mlp_out":
            def post(mod, args, out, p=p, c=c):
                rows = out.clone().view(B, -1, out.shape[-1])  # OPT's fc2 runs on [B * cols, D]
                rows[:, c] = p.value
                return rows.view(out.shape)
            handles.append(fam.mlp(blk).register_forward_hook(post))
        elif p.site in ("resid", "rresid"):
            def post(mod, args, out, p=p, c=c):
                h = (out[0] if isinstance(out, tuple) else out).clone()
                h[:, c] = p.value
                return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
            assert p.depth >= 1
            handles.append(fam.layers(lm)[p.depth - 1].register_forward_hook(post))
    return handles


def _ref_recurrent_full(model: FullBandwidthLM, ids, patches=()):
    """Logits at T of recurrent-full: column 0 on its embedding, column u >= 1 on fusion(h_{u-1}, e_u), each
    column computed once in a forward over columns 0..u (recomputed from scratch)."""
    lm = model.lm
    e = family_of(lm).embedding(lm)(ids)
    tops = []
    for t in range(T):
        x = [e[:, 0]] + [model.fusion(tops[u - 1][:, None], e[:, u:u + 1])[:, 0] for u in range(1, t + 1)]
        hs = _block_hooks(lm, patches, lambda p: (T + p.pos) if T + p.pos <= t else None)
        try:
            out = lm.base_model(inputs_embeds=torch.stack(x, 1))
        finally:
            for h in hs:
                h.remove()
        tops.append(out.last_hidden_state[:, t])
    return lm.lm_head(tops[-1])


def _mix(zd, zs, a):
    return a * (zd.norm(dim=-1, keepdim=True) / zs.norm(dim=-1, keepdim=True)) * zs + (1 - a) * zd


def _ref_recirc(lm, ids, s, d, a, patches=(), state=None):
    """Logits at T under recirculation s -> d, alpha a (convex), from scratch: forward t runs columns 0..t-1 as
    the recirculation branch (z'_{u,d} = mix(z_{u,d}, z_{u,s})) and column t as the normal branch, whose z_{t,s}
    is kept. `state`: {c: value} replaces z_{c-1,s} (the state fed to column c). Residual / block patches at
    column c hit the normal branch of c and, at depth <= d (blocks whose output depth <= d), its r-branch too."""
    zs = {}
    layers = family_of(lm).layers(lm)
    for t in range(T):
        def inject(mod, args, out):
            h = (out[0] if isinstance(out, tuple) else out).clone()
            for u in range(t):
                z = zs[u] if state is None or (u + 1) not in state else state[u + 1]
                h[:, u] = _mix(h[:, u], z, a)
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

        def keep(mod, args, out):
            zs[t] = (out[0] if isinstance(out, tuple) else out)[:, t].detach()

        def where(p):
            c = T + p.pos
            if p.site == "rresid":  # the recirculation branch of c: column c in every later forward
                return c if c < t else None
            limit = p.depth if p.site == "resid" else p.layer + 1
            return c if c == t or (c < t and limit <= d) else None

        hs = _block_hooks(lm, patches, where)  # registered first: they run before the mixing and the record
        hs += [layers[d - 1].register_forward_hook(inject), layers[s - 1].register_forward_hook(keep)]
        try:
            out = lm(input_ids=ids[:, :t + 1])
        finally:
            for h in hs:
                h.remove()
    return out.logits[:, t]


@pytest.fixture(scope="module")
def fbt():
    torch.manual_seed(3)
    m = FullBandwidthLM(_lm(), fusion=True).eval()
    with torch.no_grad():  # a fusion that matters: random, not the identity-like init
        m.fusion.up.weight.normal_(0, 0.3)
        m.fusion.gate.weight.normal_(0, 0.3)
    return m


def test_recurrent_full_head_and_mlp_patch_match_hand_written(fbt):
    batch = _batch()
    ctx = CausalContext(fbt, batch, modes=["recurrent-full"])
    g = torch.Generator().manual_seed(5)
    head = Patch("head", torch.randn(B, DH, generator=g), pos=-5, layer=1, head=2)
    mlp = Patch("mlp_out", torch.randn(B, D, generator=g), pos=-4, layer=0)
    with torch.no_grad():
        ref_clean = _ref_recurrent_full(fbt, batch.input_ids)
        for patches in ([head], [mlp], [head, mlp]):
            got = ctx.run("recurrent-full", patches).logits
            ref = _ref_recurrent_full(fbt, batch.input_ids, patches)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            assert (got - ref_clean).abs().max() > 1e-3  # it propagated to T, three columns later
    torch.testing.assert_close(ctx.clean["recurrent-full"].logits, ref_clean, atol=1e-4, rtol=1e-4)
    assert not got.is_inference()  # the steps run in inference mode; what the patcher returns is an ordinary tensor


@pytest.mark.parametrize("s,d", [(3, 1), (2, 1), (3, 2)])
def test_recirculation_patches_match_hand_written(s, d):
    lm = _lm(7)
    model = FullBandwidthLM(lm, fusion=False).eval()
    batch = _batch(2)
    mode = f"recirc-{s}:{d}:0.4:convex"
    ctx = CausalContext(model, batch, modes=[mode])
    g = torch.Generator().manual_seed(9)
    head = Patch("head", torch.randn(B, DH, generator=g), pos=-5, layer=0, head=1)
    # block s-1 writes z_s itself: a normal-branch patch there reaches later tokens through the fed state only
    mlp = Patch("mlp_out", torch.randn(B, D, generator=g), pos=-4, layer=s - 1)
    resid = Patch("resid", torch.randn(B, D, generator=g), depth=1, pos=-6)
    state_v = torch.randn(B, D, generator=g)
    with torch.no_grad():
        ref_clean = _ref_recirc(lm, batch.input_ids, s, d, 0.4)
        torch.testing.assert_close(ctx.clean[mode].logits, ref_clean, atol=1e-4, rtol=1e-4)
        for patches in ([head], [mlp], [resid], [head, mlp]):
            got = ctx.run(mode, patches).logits
            ref = _ref_recirc(lm, batch.input_ids, s, d, 0.4, patches)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            assert (got - ref_clean).abs().max() > 1e-4
        # above s, a column before T is read by no later token (they read its recirculation branch)
        late = Patch("mlp_out", torch.randn(B, D, generator=g), pos=-4, layer=L - 1)
        if s < L:
            assert torch.equal(ctx.run(mode, [late]).logits, ctx.run(mode, [late]).logits)
            torch.testing.assert_close(ctx.run(mode, [late]).logits, ref_clean, atol=1e-5, rtol=1e-5)
        got = ctx.run(mode, [Patch("state", state_v, pos=-3)]).logits
        ref = _ref_recirc(lm, batch.input_ids, s, d, 0.4, state={T - 3: state_v})
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert (got - ref_clean).abs().max() > 1e-4


def test_own_clean_value_changes_nothing_at_every_site():
    """Patching any site with its own clean value gives the clean logits: the state and fused sites bit for bit (the
    identity short-circuit); a residual patch to float rounding (the blocks above it are recomputed on the patched
    positions alone, other shapes than the clean run's: 2-8e-7 in float32)."""
    model = FullBandwidthLM(_lm(11), fusion=False).eval()
    batch = _batch(4)
    mode = "recirc-3:1:0.3:convex"
    ctx = CausalContext(model, batch, modes=["standard", mode])
    for pos in (-1, -3, 1 - T):
        for name in ("state", "fused"):
            r = ctx.runners[mode]
            v = r.state(pos) if name == "state" else r.mixed[:, T + pos - 1]
            assert torch.equal(ctx.run(mode, [Patch(name, v, pos=pos)]).logits, ctx.clean[mode].logits)
        for depth in (0, 1, 2, 3):
            got = ctx.patch_resid(mode, depth, pos, torch.arange(B))
            torch.testing.assert_close(got, ctx.clean[mode].logits, atol=1e-5, rtol=1e-5)


def test_alpha_zero_recirculation_interventions_have_no_effect():
    model = FullBandwidthLM(_lm(12), fusion=False).eval()
    batch = _batch(5)
    ctx = CausalContext(model, batch, modes=["standard", "recirc-3:1:0"])
    mode = "recirc-3:1:0:convex"
    clean = ctx.clean[mode].logits
    assert torch.equal(clean, ctx.clean["standard"].logits)  # the identity short-circuit: the base model
    for pos in (-1, -2, 1 - T):
        assert torch.equal(ctx.swap_state(batch.pair, mode, pos), clean)
        assert torch.equal(ctx.patch_state(torch.zeros(B, D), mode, pos), clean)
        assert torch.equal(ctx.gate_bypass(mode, pos), clean)
    assert torch.equal(ctx.gate_bypass(mode, "all"), clean)


def test_edit_objects_against_hand_written_formulas():
    from engine.edits import (Add, KeepSubspace, Lambda, Mean, ProjectOut, Replace, Scale, SubspaceInterchange,
                              Zero)

    g = torch.Generator().manual_seed(0)
    base, src = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    U = torch.linalg.qr(torch.randn(D, 3, generator=g))[0]
    v = torch.randn(D, generator=g)
    P = U @ U.T
    cases = [(Replace(src), src), (Zero(), torch.zeros(B, D)), (Mean(v), v.expand(B, D)), (Add(v), base + v),
             (Scale(0.5), 0.5 * base), (KeepSubspace(U), base @ P), (ProjectOut(U), base - base @ P),
             (SubspaceInterchange(src, U), base - base @ P + src @ P), (Lambda(torch.tanh), torch.tanh(base))]
    for edit, want in cases:
        torch.testing.assert_close(edit(base), want, atol=1e-5, rtol=1e-5)
    assert Replace(src)(base.double()).dtype == torch.float64  # the base's dtype
    # a basis that is not orthonormal would make x U U^T no projection: refused, for each subspace edit
    for make in (KeepSubspace, ProjectOut, lambda W: SubspaceInterchange(src, W)):
        with pytest.raises(UserError, match="orthonormal columns"):
            make(2.0 * U)
        with pytest.raises(UserError, match=r"\[width, k\]"):
            make(U[:, 0])
        make(U).to(dtype=torch.bfloat16)  # a cast of a checked basis is taken as it is
        make(U[:, :0])  # the empty subspace: keep nothing, project out nothing


@pytest.mark.parametrize("mode", ["recurrent-full", "recirc-3:1:0.4:convex"])
def test_edits_through_the_patcher_equal_their_values(fbt, mode):
    """An edit is applied to the run's own value at the site: Add(v) at one site = Replace(clean + v) there;
    Scale(1) and KeepSubspace(identity basis) change nothing."""
    from engine.edits import Add, KeepSubspace, Scale

    model = fbt if mode == "recurrent-full" else FullBandwidthLM(fbt.lm, fusion=False).eval()
    batch = _batch(6)
    ctx = CausalContext(model, batch, modes=[mode])
    v = torch.randn(D, generator=torch.Generator().manual_seed(1))
    clean_resid = ctx.resid(mode)[:, T - 3, 2]
    for site_kw in (dict(site="resid", depth=2), dict(site="mlp_out", layer=1)):
        got = ctx.run(mode, [Patch(value=Add(v), pos=-3, **site_kw)]).logits
        if site_kw["site"] == "resid":
            want = ctx.run(mode, [Patch("resid", clean_resid + v, depth=2, pos=-3)]).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert (got - ctx.clean[mode].logits).abs().max() > 1e-4
        same = ctx.run(mode, [Patch(value=Scale(1.0), pos=-3, **site_kw)]).logits
        torch.testing.assert_close(same, ctx.clean[mode].logits, atol=1e-5, rtol=1e-5)
    keep = ctx.run(mode, [Patch("state", KeepSubspace(torch.eye(D)), pos=-2)]).logits
    torch.testing.assert_close(keep, ctx.clean[mode].logits, atol=1e-5, rtol=1e-5)


def test_alpha_zero_residual_patches_are_the_base_models():
    """At alpha = 0 the branches are one stream where a patch can reach T: a residual patch at depth <= d, or at
    T itself, is the standard patch; above d at an earlier column it reaches no later token."""
    model = FullBandwidthLM(_lm(13), fusion=False).eval()
    batch = _batch(7)
    mode = "recirc-3:1:0:convex"
    ctx = CausalContext(model, batch, modes=["standard", mode])
    for depth, pos in ((1, -4), (0, -6), (3, -1), (2, -1)):
        torch.testing.assert_close(ctx.patch_resid(mode, depth, pos, batch.pair),
                                   ctx.patch_resid("standard", depth, pos, batch.pair), atol=1e-5, rtol=1e-5)
    assert torch.equal(ctx.patch_resid(mode, 2, -3, batch.pair), ctx.clean[mode].logits)


@pytest.mark.parametrize("alpha", [0.4, 0.0])
def test_recirculation_branch_residual_site(alpha):
    """rresid: the recirculation branch's own residual above d, read by every later token: against the
    hand-written forward; its own clean value changes nothing; at alpha = 0 it is the standard patch."""
    s, d = 3, 1
    lm = _lm(21)
    model = FullBandwidthLM(lm, fusion=False).eval()
    batch = _batch(8)
    mode = f"recirc-{s}:{d}:{alpha:g}:convex"
    ctx = CausalContext(model, batch, modes=["standard", mode])
    r = ctx.runners[mode]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for depth, pos in ((2, -3), (2, -5)):
            v = torch.randn(B, D, generator=g)
            got = ctx.run(mode, [Patch("rresid", v, depth=depth, pos=pos)]).logits
            ref = _ref_recirc(lm, batch.input_ids, s, d, alpha, [Patch("rresid", v, depth=depth, pos=pos)])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            assert (got - ctx.clean[mode].logits).abs().max() > 1e-4
            own = r.rresid()[:, T + pos, depth]
            torch.testing.assert_close(ctx.run(mode, [Patch("rresid", own, depth=depth, pos=pos)]).logits,
                                       ctx.clean[mode].logits, atol=1e-5, rtol=1e-5)
        # the branch's output at depth L feeds no block: no later token reads it
        top = ctx.run(mode, [Patch("rresid", torch.randn(B, D, generator=g), depth=L, pos=-4)]).logits
        torch.testing.assert_close(top, ctx.clean[mode].logits, atol=1e-5, rtol=1e-5)
        if alpha == 0:
            torch.testing.assert_close(r.rresid()[:, :-1], ctx.resid("standard")[:, :-1], atol=0, rtol=0)
    with pytest.raises(Exception, match="rresid"):
        ctx.run(mode, [Patch("rresid", torch.zeros(B, D), depth=1, pos=-3)])  # at d: that is `resid`
    with pytest.raises(Exception, match="rresid"):
        ctx.run("standard", [Patch("rresid", torch.zeros(B, D), depth=2, pos=-3)])


@pytest.mark.parametrize("mode", ["recurrent-full", "recirc-3:1:0.4:convex"])
@pytest.mark.parametrize("site", ["state", "fused"])
def test_two_patches_at_one_fed_site_compose(fbt, mode, site):
    """Edits at one site apply in order, each to what the previous left: Add(v) then Add(w) = Add(v + w).
    Under recirculation the second state / fused patch at a position replaced the first (off by up to 3 logits)."""
    from engine.edits import Add

    model = fbt if mode == "recurrent-full" else FullBandwidthLM(fbt.lm, fusion=False).eval()
    ctx = CausalContext(model, _batch(6), modes=[mode])
    g = torch.Generator().manual_seed(3)
    v, w = 5 * torch.randn(D, generator=g), torch.randn(D, generator=g)
    two = ctx.run(mode, [Patch(site, Add(v), pos=-2), Patch(site, Add(w), pos=-2)]).logits
    one = ctx.run(mode, [Patch(site, Add(v + w), pos=-2)]).logits
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)
    w_only = ctx.run(mode, [Patch(site, Add(w), pos=-2)]).logits
    assert not torch.allclose(two, w_only, atol=1e-6, rtol=0)  # the first patch is not dropped


def test_an_edit_that_does_not_fit_its_site_is_one_line(fbt):
    """A basis of another width, a source of another batch, a function returning None or another shape, a flat
    [batch * width] steering vector: one UserError naming the shapes (they were torch errors deep in a hook, or,
    for the flat vector, one steering vector per row without a word)."""
    from common.errors import UserError
    from engine.edits import Add, KeepSubspace, Lambda, Mean, Replace

    mode = "recurrent-full"
    batch = _batch(6)
    ctx = CausalContext(fbt, batch, modes=[mode])
    B = batch.size
    bad = [KeepSubspace(torch.linalg.qr(torch.randn(D + 1, 2)).Q), Replace(torch.zeros(B + 1, D)),
           Lambda(lambda x: None), Lambda(lambda x: x[:, : D // 2]), Add(torch.zeros(B * D)), Mean(torch.zeros(2, D)),
           Lambda(lambda x: x.gather(1, torch.zeros(x.shape[0], dtype=torch.long)))]  # another number of dimensions
    for edit in bad:
        for site_kw in (dict(site="resid", depth=2), dict(site="state")):
            with pytest.raises(UserError) as e:
                ctx.run(mode, [Patch(value=edit, pos=-2, **site_kw)])
            assert "\n" not in str(e.value) and type(edit).__name__ in str(e.value), (edit, str(e.value))
    def oom(x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    # out of memory, or a dtype error in an edit's own maths, is not a misfit of shapes: it stays what it is
    with pytest.raises(torch.OutOfMemoryError):
        ctx.run(mode, [Patch("resid", Lambda(oom), depth=2, pos=-2)])
    with pytest.raises(RuntimeError, match="dtype") as e:
        ctx.run(mode, [Patch("resid", Lambda(lambda x: x @ torch.eye(D, dtype=torch.float64)), depth=2, pos=-2)])
    assert not isinstance(e.value, UserError)
    ok = ctx.run(mode, [Patch("resid", Add(torch.zeros(B, D)), depth=2, pos=-2)]).logits  # one vector per row
    torch.testing.assert_close(ok, ctx.clean[mode].logits, atol=1e-5, rtol=1e-5)


def test_a_patcher_that_checks_less_still_refuses_a_fed_site_its_run_never_reaches(fbt):
    """A new mechanism's patcher that leaves out its own position check (check_site) must not return the clean
    logits as a patch's effect at a column it never fuses: Patcher.check refuses every fed site outside
    fused_positions() (found by adding a mechanism from docs/design.md alone: the patch was dropped silently)."""
    from common.errors import UserError
    from engine.modes import parse_mode
    from engine.patching import Patcher, RecurrentPatcher

    class Lax(RecurrentPatcher):
        def check_site(self, p):
            Patcher.check_site(self, p)  # none of recurrent-k's own checks

    batch = _batch()
    lax = Lax(fbt, batch.input_ids, batch.attention_mask, parse_mode("recurrent-3"))
    assert lax.fused_positions() == [-3, -2, -1]
    lax.check(Patch("state", torch.zeros(B, D), pos=-3))
    for site in ("state", "fused"):
        with pytest.raises(UserError, match="takes no fed state at T-3"):
            lax.check(Patch(site, torch.zeros(B, D), pos=-4))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "gptj", "gpt2", "gpt_neox", "opt", "gpt_neo"])
def test_other_layouts_patches_match_hand_written(model_type):
    """Other blocks than Llama's: a sparse MoE block is the MLP site like any other (Qwen2-MoE's with its gated
    shared expert), GPT-J and GPT-NeoX add attention and MLP in parallel, GPT-2's heads enter a Conv1D, OPT's MLP is
    its fc2 (no module of its own). A head and an
    MLP-output patch under recurrent-full and under recirculation equal the hand-written forwards, and propagate.
    An MoE routes each token alone, so the cached steps compute what the from-scratch recompute does. In float64 (the
    experts' eager loop: torch's grouped_mm takes no float64), where only the router's float32 softmax and the
    float32 logits round (~1e-6): in float32 rounding alone reaches 1e-4 on these logits."""
    from test_families import tiny_lm

    depth = dict(n_layer=L) if model_type in ("gptj", "gpt2") else dict(num_hidden_layers=L)
    if model_type == "gpt_neo":  # two local layers (window 3 < T) around a global one
        depth = dict(num_layers=L, attention_types=[[["local", "global", "local"], 1]])
    heads = dict(num_key_value_heads=H, head_dim=DH) if model_type in ("mixtral", "qwen2_moe") else {}
    moe = dict(experts_implementation="eager") if model_type in ("mixtral", "qwen2_moe") else {}
    lm = tiny_lm(model_type, vocab=40, seed=13, attn_implementation="eager", **depth, **heads, **moe)
    assert len(family_of(lm).layers(lm)) == L
    torch.manual_seed(3)
    fbt = FullBandwidthLM(lm, fusion=True).eval()
    with torch.no_grad():
        fbt.fusion.up.weight.normal_(0, 0.3)
        fbt.fusion.gate.weight.normal_(0, 0.3)
    fbt, lm = fbt.double(), lm.double()

    def close(got, want):  # the engine returns float32 logits: its rounding and the router's, ~1e-6
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    batch = _batch(8)
    g = torch.Generator().manual_seed(5)
    head = Patch("head", torch.randn(B, DH, generator=g), pos=-5, layer=1, head=2)
    mlp = Patch("mlp_out", torch.randn(B, D, generator=g), pos=-4, layer=0)
    ctx = CausalContext(fbt, batch, modes=["recurrent-full"])
    with torch.no_grad():
        ref_clean = _ref_recurrent_full(fbt, batch.input_ids)
        close(ctx.clean["recurrent-full"].logits, ref_clean)
        for patches in ([head], [mlp], [head, mlp]):
            got = ctx.run("recurrent-full", patches).logits
            close(got, _ref_recurrent_full(fbt, batch.input_ids, patches))
            assert (got - ref_clean).abs().max() > 1e-3
    model = FullBandwidthLM(lm, fusion=False).eval()
    mode = "recirc-3:1:0.4:convex"
    ctx = CausalContext(model, batch, modes=[mode])
    with torch.no_grad():
        ref_clean = _ref_recirc(lm, batch.input_ids, 3, 1, 0.4)
        close(ctx.clean[mode].logits, ref_clean)
        for patches in ([head], [mlp], [head, mlp]):
            got = ctx.run(mode, patches).logits
            close(got, _ref_recirc(lm, batch.input_ids, 3, 1, 0.4, patches))
            assert (got - ref_clean).abs().max() > 1e-4
