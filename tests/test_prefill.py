"""The prefill engine against naive, hand-written references (no KV cache, full recomputation).

Reference conventions: one unpadded prompt `ids` [T]; depth d < L of the residual stream is HF's
hidden_states[d]; the engine's depth L is the raw last-block output, whose final norm is HF's hidden_states[L].
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM, decoder_layers
from engine.prefill import generate, pad_left, prefill_many

TOL = 1e-5
PROMPT = [7, 3, 41, 12, 5, 29, 33, 8]  # T = 8
POSITIONS = (-1, -2, -4)


@dataclass
class Ref:
    logits: torch.Tensor  # [T, V]
    top: torch.Tensor  # [T, D]
    hidden: torch.Tensor  # [T, L+1, D]  HF hidden_states (depth L after the final norm)


def final_norm(model):
    base = model.lm.base_model
    return base.norm if hasattr(base, "norm") else base.ln_f


def ref_fusion(model, state, emb):
    f = model.fusion
    v = state @ f.up.weight.T
    u = v * torch.sigmoid(emb @ f.gate.weight.T)
    return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + f.norm.eps) * f.norm.weight


@torch.no_grad()
def ref_forward(model, ids, state=None, fuse=None) -> Ref:
    """Full forward of one unpadded sequence from a hand-built inputs_embeds; state[t] is fed at position t."""
    ids = torch.as_tensor(ids)[None]
    emb = model.lm.get_input_embeddings()(ids)
    x = emb
    if state is not None:
        x = torch.where(torch.as_tensor(fuse)[None, :, None], ref_fusion(model, state[None], emb), emb)
    out = model.lm.base_model(inputs_embeds=x, output_hidden_states=True)
    top = out.last_hidden_state[0]
    logits = top @ model.lm.get_input_embeddings().weight.T  # tied LM head
    return Ref(logits, top, torch.stack(out.hidden_states, dim=2)[0])


def shifted(tops: torch.Tensor, t: int) -> torch.Tensor:
    """States for positions 0..t: state[p] = tops[p-1], state[0] = 0."""
    s = torch.zeros(t + 1, tops.shape[-1])
    s[1:] = tops[:t]
    return s


@torch.no_grad()
def naive_recurrent(model, ids, k=None) -> Ref:
    """Standard for positions < T-k, then each later position by recomputing the whole prefix from scratch,
    with every fused position fed the previously computed top state of the position before it."""
    T = len(ids)
    first = 1 if k is None else max(T - k, 1)  # first fused position
    std = ref_forward(model, ids)
    logits, top, hidden = std.logits.clone(), std.top.clone(), std.hidden.clone()
    for t in range(first, T):
        fuse = torch.tensor([p >= first for p in range(t + 1)])
        r = ref_forward(model, ids[:t + 1], shifted(top, t), fuse)
        logits[t], top[t], hidden[t] = r.logits[-1], r.top[-1], r.hidden[-1]
    return Ref(logits, top, hidden)


@torch.no_grad()
def naive_fused(model, ids, n) -> Ref:
    """n parallel feedback passes over the whole prompt, each on the previous pass's shifted top states."""
    T = len(ids)
    r = ref_forward(model, ids)
    fuse = torch.arange(T) > 0
    for _ in range(n):
        r = ref_forward(model, ids, shifted(r.top, T - 1), fuse)
    return r


def assert_matches(model, res, ref: Ref, positions, row=0, tol=TOL):
    """PrefillResult row `row` vs a reference at the given negative positions, at every depth."""
    T = ref.logits.shape[0]
    cols = [T + p for p in positions]
    assert (res.logits[row] - ref.logits[cols]).abs().max() <= tol
    assert (res.top[row] - ref.top[cols]).abs().max() <= tol
    resid = res.resid[row]  # [n_pos, L+1, D]
    L = resid.shape[1] - 1
    assert (resid[:, :L] - ref.hidden[cols, :L]).abs().max() <= tol
    with torch.no_grad():
        assert (final_norm(model)(resid[:, L]) - ref.hidden[cols, L]).abs().max() <= tol


@pytest.fixture
def model(tiny_model):
    return tiny_model


def run(model, ids, modes, positions=POSITIONS):
    ids_t = torch.tensor([ids])
    return prefill_many(model, ids_t, torch.ones_like(ids_t), modes, positions=positions)


# ----- recurrent ------------------------------------------------------------------------------------------
def test_recurrent_full_equals_naive_full_prefix_recompute(model):
    res = run(model, PROMPT, ["recurrent-full"], positions=(-1, -2, -3, -5, -8))["recurrent-full"]
    assert_matches(model, res, naive_recurrent(model, PROMPT), (-1, -2, -3, -5, -8))
    # The feedback actually changes something (the test is not vacuous).
    std = ref_forward(model, PROMPT)
    assert (res.logits[0, 0] - std.logits[-1]).abs().max() > 1e-3


def test_recurrent_1_equals_recurrent_full_on_two_tokens(model):
    res = run(model, PROMPT[:2], ["recurrent-1", "recurrent-full"], positions=(-1, -2))
    a, b = res["recurrent-1"], res["recurrent-full"]
    for x, y in ((a.logits, b.logits), (a.top, b.top), (a.resid, b.resid)):
        assert (x - y).abs().max() <= TOL


@pytest.mark.parametrize("k", [1, 2, 4])
def test_recurrent_k_equals_naive(model, k):
    res = run(model, PROMPT, [f"recurrent-{k}"])[f"recurrent-{k}"]
    assert_matches(model, res, naive_recurrent(model, PROMPT, k), POSITIONS)


def test_recurrent_k_past_the_prompt_is_recurrent_full(model):
    res = run(model, PROMPT[:4], ["recurrent-9", "recurrent-full"], positions=(-1, -2, -3, -4))
    assert (res["recurrent-9"].resid - res["recurrent-full"].resid).abs().max() <= TOL


def test_logits_false_runs_no_head_and_changes_nothing_else(model, head_calls):
    """prefill_many(logits=False) (the collector's, the lens's): no LM head in the standard, recurrent and fused
    modes, every result's logits None, and the top states and residuals bit for bit those of the run with logits;
    recirc (whose head runs at the read columns only) returns None as well."""
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    modes = ["standard", "recurrent-1", "recurrent-3", "recurrent-full", "fused-2", "recirc-2:1:0.5"]
    with_logits = prefill_many(model, ids, mask, modes, positions=(-1, -3))
    with head_calls(model) as calls:
        bare = {m: prefill_many(model, ids, mask, [m], positions=(-1, -3), logits=False)[m] for m in modes[:-1]}
    assert calls == []
    bare.update(prefill_many(model, ids, mask, modes, positions=(-1, -3), logits=False))
    for m in modes:
        assert bare[m].logits is None and with_logits[m].logits is not None, m
        assert torch.equal(bare[m].top, with_logits[m].top) and torch.equal(bare[m].resid, with_logits[m].resid), m


def test_fused_n_runs_the_head_on_its_last_pass_alone(model, head_calls):
    """A Jacobi pass feeds the next its top states, not its logits: fused-n runs the head once, on pass n."""
    from engine.prefill import iter_fused

    ids = torch.tensor([PROMPT])
    mask = torch.ones_like(ids)
    with head_calls(model) as calls:
        res = prefill_many(model, ids, mask, ["fused-3"], positions=(-1, -2))["fused-3"]
    assert calls == [len(PROMPT)]  # one call, over the last pass's columns
    with torch.no_grad():
        every = list(iter_fused(model, ids, mask, 3))  # heads="all": the trajectory's logits at every pass
    assert all(out.logits is not None for _, out in every)
    assert torch.equal(res.logits, every[-1][1].logits[:, [-1, -2]])
    with pytest.raises(ValueError, match="heads"):
        next(iter_fused(model, ids, mask, 1, heads="first"))


@pytest.mark.parametrize("mode", ["recurrent-1", "recurrent-3", "recurrent-full"])
def test_recurrent_k_read_at_recomputed_columns_runs_no_head_over_the_prefill(model, mode, head_calls):
    """The prefill's logits serve the standard result and the columns the recurrence keeps, a step's the column it
    computes. Read at recomputed columns only, recurrent-k runs the LM head on the read columns' steps alone, and
    every returned value is the same, bit for bit, as in the run that also reads column 0 (whose prefill does run
    the head)."""
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a padded row
    read = (-1,) if mode == "recurrent-1" else (-1, -2)  # recomputed columns
    with head_calls(model) as lean_widths:
        lean = prefill_many(model, ids, mask, [mode], positions=read)[mode]
    with head_calls(model) as widths:
        ref = prefill_many(model, ids, mask, [mode], positions=read + (-len(PROMPT),))[mode]
    assert lean_widths == [1] * len(read)  # the heads of the read columns' steps, one column each, and no other
    assert len(widths) == len(read) + 1  # and the prefill's, when it keeps a read column
    n = len(read)
    for a, b in ((lean.logits, ref.logits[:, :n]), (lean.top, ref.top[:, :n]), (lean.resid, ref.resid[:, :n])):
        assert torch.equal(a, b) and not a.is_inference()
    lean.logits.add_(0)  # an ordinary tensor, editable outside the steps' inference mode


# ----- fused ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_fused_n_equals_hand_written_passes(model, n):
    res = run(model, PROMPT, [f"fused-{n}"])[f"fused-{n}"]
    assert_matches(model, res, naive_fused(model, PROMPT, n), POSITIONS)


def test_fused_n_past_the_prompt_is_the_jacobi_fixed_point(model):
    T = len(PROMPT)
    positions = tuple(range(-T, 0))
    res = run(model, PROMPT, ["recurrent-full", f"fused-{T - 1}", f"fused-{T + 2}", f"fused-{T - 3}"], positions)
    full = res["recurrent-full"]
    for n in (T - 1, T + 2):
        assert (res[f"fused-{n}"].logits - full.logits).abs().max() <= TOL
        assert (res[f"fused-{n}"].resid - full.resid).abs().max() <= TOL
    # After n passes exactly the first n+1 positions have converged.
    short = res[f"fused-{T - 3}"]
    assert (short.logits[0, :T - 2] - full.logits[0, :T - 2]).abs().max() <= TOL
    assert (short.logits[0, -1] - full.logits[0, -1]).abs().max() > 1e-4


def zero_attention_output(model: FullBandwidthLM) -> FullBandwidthLM:
    """Cut every cross-position path except the fed-back state."""
    with torch.no_grad():
        for layer in decoder_layers(model.lm):
            if hasattr(layer, "self_attn"):
                layer.self_attn.o_proj.weight.zero_()
                if layer.self_attn.o_proj.bias is not None:
                    layer.self_attn.o_proj.bias.zero_()
            else:
                layer.attn.c_proj.weight.zero_()
                layer.attn.c_proj.bias.zero_()
    return model


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fused_n_has_an_n_step_horizon(model, n):
    model = zero_attention_output(model)
    T = len(PROMPT)

    def last_logits(ids, mode):
        return run(model, ids, [mode], positions=(-1,))[mode].logits[0, 0]

    def changed(at):  # token `at` positions before T (T itself is 0 before)
        ids = list(PROMPT)
        ids[T - 1 - at] = (ids[T - 1 - at] + 11) % model.config.vocab_size
        return ids

    for mode in (f"fused-{n}", "recurrent-full"):
        base = last_logits(PROMPT, mode)
        near, far = last_logits(changed(n), mode), last_logits(changed(n + 1), mode)
        assert (near - base).abs().max() > 1e-4, (mode, "a token inside the horizon must matter")
        if mode == "recurrent-full":
            assert (far - base).abs().max() > 1e-4, "recurrent-full sees the whole prefix"
        else:
            assert (far - base).abs().max() <= 1e-6, (mode, "a token beyond the horizon must not matter")
    # Without feedback the zeroed model is position-local.
    assert (last_logits(changed(1), "standard") - last_logits(PROMPT, "standard")).abs().max() <= 1e-6


# ----- standard -------------------------------------------------------------------------------------------
def test_standard_depths_equal_hf_hidden_states(model):
    ids = torch.tensor([PROMPT])
    T = len(PROMPT)
    positions = tuple(range(-T, 0))
    res = prefill_many(model, ids, torch.ones_like(ids), ["standard"], positions=positions)["standard"]
    with torch.no_grad():
        hf = model.lm(ids, output_hidden_states=True)
    L = model.n_layers
    assert len(hf.hidden_states) == L + 1
    for d in range(L):
        assert (res.resid[0, :, d] - hf.hidden_states[d][0]).abs().max() <= TOL
    assert (final_norm(model)(res.resid[0, :, L]) - hf.hidden_states[L][0]).abs().max() <= TOL
    assert (res.logits[0] - hf.logits[0]).abs().max() <= TOL
    assert (res.top[0] - hf.hidden_states[L][0]).abs().max() <= TOL


def test_mode_aliases_of_standard_keep_their_names(model):
    res = run(model, PROMPT, ["fused-0", "recurrent-0", "standard"])
    assert set(res) == {"fused-0", "recurrent-0", "standard"}
    for name in ("fused-0", "recurrent-0"):
        assert torch.equal(res[name].logits, res["standard"].logits)


# ----- batching -------------------------------------------------------------------------------------------
BATCH = [PROMPT, [4, 9, 22], [17], [30, 2, 2, 45, 6, 1]]
MODES = ["standard", "recurrent-1", "recurrent-2", "recurrent-full", "fused-2"]


def test_padded_batch_equals_unbatched(model):
    ids, mask = pad_left(BATCH)
    assert ids.shape == (4, 8) and mask.sum(1).tolist() == [8, 3, 1, 6]
    batched = prefill_many(model, ids, mask, MODES, positions=(-1, -2, -3))
    for name, res in batched.items():
        for t in (res.logits, res.top, res.resid):
            assert not torch.isnan(t).any(), name
    for i, seq in enumerate(BATCH):
        positions = tuple(p for p in (-1, -2, -3) if -p <= len(seq))
        single = run(model, seq, MODES, positions=positions)
        for name in MODES:
            n = len(positions)
            b, s = batched[name], single[name]
            assert (b.logits[i, :n] - s.logits[0]).abs().max() <= TOL, (name, i)
            assert (b.top[i, :n] - s.top[0]).abs().max() <= TOL, (name, i)
            assert (b.resid[i, :n] - s.resid[0]).abs().max() <= TOL, (name, i)


def test_one_token_prompt_every_mode_is_standard(model):
    res = run(model, [5], MODES, positions=(-1,))
    for name in MODES:
        assert (res[name].logits - res["standard"].logits).abs().max() <= TOL


# ----- generation -----------------------------------------------------------------------------------------
@torch.no_grad()
def naive_std_generate(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(ref_forward(model, seq).logits[-1].argmax()))
    return seq[len(ids):]


def gen(model, ids, n, decoding):
    ids_t = torch.tensor([ids])
    return generate(model, ids_t, torch.ones_like(ids_t), n, decoding)[0].tolist()


def test_generate_std_equals_repeated_full_forwards(model):
    assert gen(model, PROMPT, 5, "std") == naive_std_generate(model, PROMPT, 5)


def test_generate_soft_and_fused_first_tokens(model):
    res = run(model, PROMPT, ["recurrent-1", "fused-1"], positions=(-1,))
    assert gen(model, PROMPT, 1, "soft")[0] == int(res["recurrent-1"].logits[0, 0].argmax())
    assert gen(model, PROMPT, 1, "fused")[0] == int(res["fused-1"].logits[0, 0].argmax())


def test_generate_soft_equals_naive_feedback(model):
    """Token i of soft decoding is the argmax of recurrent-(i+1) over prompt + the first i generated tokens."""
    out = gen(model, PROMPT, 4, "soft")
    for i in range(4):
        seq = PROMPT + out[:i]
        assert out[i] == int(naive_recurrent(model, seq, k=i + 1).logits[-1].argmax())


@pytest.mark.parametrize("decoding", ["std", "soft", "fused"])
def test_batched_generation_equals_unbatched(model, decoding):
    ids, mask = pad_left(BATCH)
    batched = generate(model, ids, mask, 4, decoding)
    assert batched.shape == (len(BATCH), 4)
    for i, seq in enumerate(BATCH):
        assert batched[i].tolist() == gen(model, seq, 4, decoding), (decoding, i)


@pytest.mark.parametrize("decoding", ["std", "soft", "fused"])
def test_generate_from_one_token_prompt(model, decoding):
    out = gen(model, [5], 3, decoding)
    assert len(out) == 3
    # On one token there is no previous state to feed: every decoding's first token is std's.
    assert out[0] == gen(model, [5], 1, "std")[0]


# ----- errors ---------------------------------------------------------------------------------------------
def test_unknown_mode_raises(model):
    ids, mask = pad_left([PROMPT])
    for bad in ("bogus", "recurrent-", "fused-x", "recurrent-full-2", "Standard"):
        with pytest.raises(UserError):
            prefill_many(model, ids, mask, [bad])
    with pytest.raises(UserError):
        generate(model, ids, mask, 2, "beam")


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_prompt_longer_than_context_raises(family, make_tiny_config):
    model = FullBandwidthLM.from_config(make_tiny_config(family, max_len=8), seed=0).eval()
    ids, mask = pad_left([list(range(1, 10))])
    with pytest.raises(UserError):
        prefill_many(model, ids, mask, ["standard"])
    with pytest.raises(UserError):
        generate(model, ids, mask, 1, "std")
    # Fits exactly: fine. Generating past the context is a user error too, not a crash.
    ids, mask = pad_left([list(range(1, 9))])
    prefill_many(model, ids, mask, ["recurrent-full"])
    assert generate(model, ids, mask, 1, "soft").shape == (1, 1)
    with pytest.raises(UserError):
        generate(model, ids, mask, 3, "std")


def test_empty_batch_raises(model):
    with pytest.raises(UserError):
        pad_left([])
    with pytest.raises(UserError):
        pad_left([[1, 2], []])
    empty = torch.zeros((0, 4), dtype=torch.long)
    with pytest.raises(UserError):
        prefill_many(model, empty, empty, ["standard"])
    with pytest.raises(UserError):
        generate(model, empty, empty, 2, "std")


def test_feedback_modes_need_a_fusion_module(tiny_config):
    model = FullBandwidthLM.from_config(tiny_config, fusion=False, seed=0).eval()
    assert not model.has_fusion and "fusion" not in dict(model.named_modules())
    ids, mask = pad_left([PROMPT])
    assert prefill_many(model, ids, mask, ["standard", "fused-0"])["standard"].logits.shape == (1, 1, 50)
    for mode in ("fused-1", "recurrent-1", "recurrent-full"):
        with pytest.raises(UserError):
            prefill_many(model, ids, mask, ["standard", mode])
    for decoding in ("soft", "fused"):
        with pytest.raises(UserError):
            generate(model, ids, mask, 2, decoding)
    with pytest.raises(UserError):
        model(ids, mask, state=torch.zeros(1, len(PROMPT), model.d_model))
