"""Mutation-testing gaps in the engine's core: engine.modes (the mode parser and what each mode claims), engine.mixing
(the recirculation spec and its mix), engine.inputs (padding and input checks), engine.decode, engine.loops and
engine.hooks. Every expectation is written by hand from the module docs, not copied from the code's output."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from common.errors import UserError
from engine.mixing import RecircSpec, exact_g, mix, parse_recirculate
from engine.modes import Mode, canonical_modes, parse_mode


# ----- engine.modes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fused-1000", "recurrent-100000", "loop-1", "loop-256", "loop-3:0.5"])
def test_the_largest_and_smallest_values_a_mode_allows_parse(name):
    assert parse_mode(name).name == name


@pytest.mark.parametrize("name", ["fused-1001", "recurrent-100001", "loop-0", "loop-257", "loop-3:0", "loop-3:1",
                                  "loop-3:nan", "loop-3:-0.1"])
def test_values_past_the_bounds_are_one_user_error(name):
    with pytest.raises(UserError, match="mode"):
        parse_mode(name)


@pytest.mark.parametrize("spelling, name", [(" std ", "standard"), ("soft", "recurrent-1"), ("fused", "fused-1"),
                                            ("recurrent-0", "standard"), ("fused-0", "standard"),
                                            (" soft", "recurrent-1")])
def test_aliases_and_zero_counts(spelling, name):
    assert parse_mode(spelling).name == name


def test_fed_top_source_is_the_previous_pass_or_the_run_itself():
    assert parse_mode("fused-1").fed_top_source == "standard"
    assert parse_mode("fused-3").fed_top_source == "fused-2"
    assert parse_mode("recurrent-2").fed_top_source == "recurrent-2"
    assert parse_mode("recurrent-full").fed_top_source == "recurrent-full"
    for name in ("standard", "loop-4", "recirc-2:0:0.5"):
        assert parse_mode(name).fed_top_source is None


def test_fed_positions_by_hand():
    T = 5
    assert parse_mode("standard").fed_positions(T) == []
    assert parse_mode("loop-3").fed_positions(T) == []
    assert parse_mode("loop-3:0.1").fed_positions(T) == []
    assert parse_mode("recurrent-2").fed_positions(T) == [-2, -1]
    assert parse_mode("recurrent-4").fed_positions(T) == [-4, -3, -2, -1]  # k = T - 1: every column after the 1st
    assert parse_mode("recurrent-9").fed_positions(T) == [-4, -3, -2, -1]  # cropped to the prompt
    assert parse_mode("recurrent-full").fed_positions(T) == [-4, -3, -2, -1]
    assert parse_mode("fused-2").fed_positions(T) == [-4, -3, -2, -1]
    assert parse_mode("recirc-2:0:0.5").fed_positions(T) == [-4, -3, -2, -1]
    assert parse_mode("fused-2").fed_positions(1) == []  # a one-token prompt has nothing to feed


def test_what_each_kind_of_mode_claims():
    rows = {  # name: (has_feedback, feeds_state, has_gradient, attributable, loop_iterations, adaptive_exit)
        "standard": (False, False, True, True, None, None),
        "recurrent-2": (True, True, True, True, None, None),
        "recurrent-full": (True, True, True, True, None, None),
        "fused-3": (True, True, True, False, None, None),
        "loop-4": (False, False, True, True, 4, None),
        "loop-4:0.25": (False, False, True, False, None, (4, 0.25)),
        "recirc-2:0:0.5": (False, True, False, False, None, None),
    }
    for name, want in rows.items():
        m = parse_mode(name)
        got = (m.has_feedback, m.feeds_state, m.has_gradient, m.attributable, m.loop_iterations, m.adaptive_exit)
        assert got == want, name


def test_an_adaptive_exit_name_keeps_its_threshold_exactly():
    m = parse_mode("loop-4:0.1000004")
    assert m.tol == 0.1000004
    assert m.name == "loop-4:0.1000004"
    assert parse_mode(m.name) == m and parse_mode(m.name).tol == m.tol
    assert parse_mode("loop-4:0.1000004") != parse_mode("loop-4:0.1")


def test_a_parsed_recirc_mode_is_checked_again_against_a_model():
    m = parse_mode("recirc-3:0:0.5")
    assert parse_mode(m) is m
    assert parse_mode(m, n_layers=3) is m
    with pytest.raises(UserError, match="source depth 3 out of range"):
        parse_mode(m, n_layers=2)


def test_canonical_modes_deduplicates_aliases():
    assert canonical_modes("std, standard,fused-0,soft,recurrent-1,fused") == ["standard", "recurrent-1", "fused-1"]
    with pytest.raises(UserError, match="no modes"):
        canonical_modes(" , ")


# ----- engine.mixing: the spec -----------------------------------------------------------------------------
def test_exact_g_writes_the_short_form_only_where_it_reads_back():
    assert exact_g(0.1) == "0.1" and exact_g(1) == "1" and exact_g(1e-5) == "1e-05"
    for x in (0.1000004, 1 / 3, 0.123456789):
        assert float(exact_g(x)) == x
    assert exact_g(0.1000004) != exact_g(0.1)


def test_spec_bounds_by_hand():
    RecircSpec(1, 0, 0.0)  # target 0 (the embedding), alpha 0 and 1: allowed
    RecircSpec(1, 0, 1.0)
    RecircSpec(1, 0, 1)
    for args in ((2, 2, 0.5), (1, 2, 0.5), (2, -1, 0.5), (2, 0, 1.5), (2, 0, -0.1)):
        with pytest.raises(UserError):
            RecircSpec(*args)
    assert RecircSpec(4, 1, 0.5).validate(4).source == 4  # the top depth L is a source
    with pytest.raises(UserError, match="out of range"):
        RecircSpec(5, 1, 0.5).validate(4)


def test_beta_identity_and_same_run():
    assert RecircSpec(2, 0, 0.25).beta == 0.75
    assert RecircSpec(2, 0, 0.25, "residual").beta == 1.0
    assert RecircSpec(2, 0, 0.0).is_identity and RecircSpec(2, 0, 0.0, "residual").is_identity
    assert not RecircSpec(2, 0, 0.0, transform=torch.eye(4)).is_identity
    assert not RecircSpec(2, 0, 0.0, subspace=torch.eye(4)[:, :2]).is_identity
    U = torch.eye(4)[:, :2]
    a = RecircSpec(2, 0, 0.5, subspace=U)
    assert a.same_run(RecircSpec(2, 0, 0.5, subspace=U.clone()))
    assert not a.same_run(RecircSpec(2, 0, 0.5, subspace=U, subspace_complement=True))
    assert not a.same_run(RecircSpec(2, 0, 0.5))


@pytest.mark.parametrize("value, want", [
    ("3:1:0.5", "recirc-3:1:0.5:convex"), ("3:1:0.5:residual", "recirc-3:1:0.5:residual"),
    ("3:1:0.5:ramp4", "recirc-3:1:0.5:convex:ramp4"), ("3:1:0.5:convex:RAMP4", "recirc-3:1:0.5:convex:ramp4"),
    ("3:1:0.5:residual:ramp2", "recirc-3:1:0.5:residual:ramp2"), ("3 : 1 : 0.5 : Residual", "recirc-3:1:0.5:residual")])
def test_spec_parser_by_hand(value, want):
    spec = parse_recirculate(value)
    assert spec.name == want
    assert parse_recirculate(want[len("recirc-"):]).name == want


@pytest.mark.parametrize("value, msg", [("3:1:nan", "alpha must be in"), ("3:1:inf", "alpha must be in"),
                                        ("3:1:0.5:ramp2:ramp3", "one ramp at most"), ("3:1:x", "not a number")])
def test_bad_specs_name_the_spec(value, msg):
    with pytest.raises(UserError, match=msg) as e:
        parse_recirculate(value)
    assert "bad recirculation spec" in str(e.value)


# ----- engine.mixing: the mix ------------------------------------------------------------------------------
def _mix_by_hand(zd, zs, alpha, convex=True):
    """z' = alpha * (|zd| / |zs|) zs + beta zd, row by row in float64 (beta = 1 - alpha convex, 1 residual)."""
    zd, zs = zd.double(), zs.double()
    out = torch.empty_like(zd)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in zd.shape[:-1]]).reshape(-1, zd.ndim - 1):
        i = tuple(idx.tolist())
        a = float(alpha[i]) if torch.is_tensor(alpha) else alpha
        b = 1 - a if convex else 1.0
        out[i] = a * (zd[i].norm() / zs[i].norm()) * zs[i] + b * zd[i]
    return out


def _pair(shape=(2, 3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), 3 * torch.randn(*shape, generator=g)


@pytest.mark.parametrize("convex", [True, False])
def test_mix_with_a_per_position_alpha_by_hand(convex):
    zd, zs = _pair()
    alpha = torch.tensor([[0.0, 0.5, 1.0], [0.25, 0.75, 0.1]])  # [batch, cols]: alpha_t (the ramp's form)
    spec = RecircSpec(2, 0, 0.5, "convex" if convex else "residual")
    out = mix(zd, zs, spec, alpha)
    assert torch.allclose(out.double(), _mix_by_hand(zd, zs, alpha, convex), atol=1e-5)
    assert torch.allclose(mix(zd, zs, spec).double(), _mix_by_hand(zd, zs, 0.5, convex), atol=1e-5)
    per_col = torch.tensor([0.0, 0.5, 1.0])  # [cols]: one alpha a column, every row
    assert torch.allclose(mix(zd, zs, spec, per_col).double(),
                          _mix_by_hand(zd, zs, per_col.expand(2, 3), convex), atol=1e-5)


def test_mix_norm_matches_the_transformed_source():
    zd, zs = _pair()
    W = torch.diag(torch.tensor([2.0, 0.5, 3.0, 1.0]))
    spec = RecircSpec(2, 0, 0.5, "residual", transform=W)
    assert torch.allclose(mix(zd, zs, spec).double(), _mix_by_hand(zd, zs @ W.T, 0.5, convex=False), atol=1e-5)


def test_mix_in_the_complement_of_a_subspace_by_hand():
    zd, zs = _pair()
    U = torch.eye(4)[:, :2]  # the first two coordinates
    full = _mix_by_hand(zd, zs, 0.5)
    inside = mix(zd, zs, RecircSpec(2, 0, 0.5, subspace=U)).double()
    outside = mix(zd, zs, RecircSpec(2, 0, 0.5, subspace=U, subspace_complement=True)).double()
    assert torch.allclose(inside[..., :2], full[..., :2], atol=1e-5)
    assert torch.equal(inside[..., 2:], zd[..., 2:].double())
    assert torch.equal(outside[..., :2], zd[..., :2].double())
    assert torch.allclose(outside[..., 2:], full[..., 2:], atol=1e-5)


def test_mix_of_a_float64_state_is_float64_exact():
    zd, zs = _pair()
    zd, zs = zd.double() * 1e-3, zs.double()
    out = mix(zd, zs, RecircSpec(2, 0, 1e-9))
    assert out.dtype == torch.float64
    assert torch.allclose(out, _mix_by_hand(zd, zs, 1e-9), rtol=1e-13, atol=0)
    assert not torch.equal(out, zd)


# ----- engine.inputs ---------------------------------------------------------------------------------------
from engine.inputs import check_inputs, check_stepwise, context_length, eval_mode, pad_left  # noqa: E402


def _fake_model(vocab=10, **config):
    """What check_inputs / check_generation read of a model: its input embedding, its config, no family."""
    config.setdefault("max_position_embeddings", 8)
    emb = torch.nn.Embedding(vocab, 2)
    return SimpleNamespace(lm=SimpleNamespace(get_input_embeddings=lambda: emb), config=SimpleNamespace(**config),
                           family=None)


def test_pad_left_by_hand():
    ids, mask = pad_left([[5, 6, 7], [8]], pad_id=3)
    assert ids.tolist() == [[5, 6, 7], [3, 3, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, _ = pad_left([[5, 6], [8]], pad_id=None)
    assert ids.tolist() == [[5, 6], [0, 8]]


def test_check_inputs_bounds_by_hand():
    model = _fake_model()
    ok = torch.ones(1, 8, dtype=torch.long)
    check_inputs(model, torch.full((1, 8), 9), ok, positions=(-1, -8))  # the context, the last id, column -T
    with pytest.raises(UserError, match="outside the model's vocabulary 0..9"):
        check_inputs(model, torch.full((1, 8), 10), ok)
    with pytest.raises(UserError, match="longer than the model's context"):
        check_inputs(model, torch.ones(1, 9, dtype=torch.long), torch.ones(1, 9, dtype=torch.long))
    for p in (-9, 0):
        with pytest.raises(UserError, match="out of range"):
            check_inputs(model, torch.ones(1, 8, dtype=torch.long), ok, positions=(p,))


def test_check_inputs_wants_left_padding_without_holes():
    model = _fake_model()
    ids = torch.ones(2, 3, dtype=torch.long)
    check_inputs(model, ids, torch.tensor([[0, 1, 1], [1, 1, 1]]))  # left padding is fine
    with pytest.raises(UserError, match="last column"):
        check_inputs(model, ids, torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(UserError, match="row 1 has a padding column"):
        check_inputs(model, ids, torch.tensor([[1, 1, 1], [1, 0, 1]]))


def _longrope(original=6, **kw):
    return _fake_model(max_position_embeddings=32, model_type="llama",
                       rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": original}, **kw)


def test_a_longrope_batch_must_not_straddle_its_original_context():
    model = _longrope(6)
    ids = torch.ones(2, 8, dtype=torch.long)
    check_inputs(model, ids, torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8]))  # 7 and 8: both past it
    with pytest.raises(UserError, match="prompts of 6 to 8 tokens"):
        check_inputs(model, ids, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]))  # 6 within, 8 past


def test_check_stepwise_first_call_by_hand():
    # the first call is the prompt's first longest - steps + 1 columns; a later column past the original context
    mask = torch.ones(1, 8, dtype=torch.long)
    check_stepwise(_longrope(5), mask, "x", steps=3)  # first call 6 columns, already past 5
    with pytest.raises(UserError, match="first call covers 6 of 8"):
        check_stepwise(_longrope(6), mask, "x", steps=3)
    with pytest.raises(UserError, match="first call covers 1 of 8"):
        check_stepwise(_longrope(6), mask, "x")  # steps None: every column after the first a step
    six = torch.ones(1, 6, dtype=torch.long)
    check_stepwise(_longrope(6), six, "x", steps=0)  # the whole prompt within it, nothing after
    with pytest.raises(UserError, match="first call covers 6 of 8"):
        check_stepwise(_longrope(6), six, "x", steps=0, new_tokens=2)  # generated tokens go past it


def test_context_length_of_windowed_models_by_hand():
    def cfg(**kw):
        return SimpleNamespace(model_type="llama", max_position_embeddings=16, **kw)

    assert context_length(cfg(), [4, 4]) is None  # every layer windowed, default rotary: relative positions
    assert context_length(cfg(), [4, None]) == 16  # a full-attention layer keeps the limit
    assert context_length(cfg(), None) == 16
    assert context_length(cfg(rope_scaling={"type": "linear", "factor": 2.0}), [4, 4]) is None
    assert context_length(cfg(rope_scaling={"type": "dynamic", "factor": 2.0}), [4, 4]) == 16  # older "type" key
    gpt2 = SimpleNamespace(model_type="gpt2", n_positions=12)
    assert context_length(gpt2, [4, 4]) == 12  # a learned position table keeps it


def test_eval_mode_puts_every_module_back():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model.train()
    model[0].eval()
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, False, True]


# ----- engine.decode ---------------------------------------------------------------------------------------
from engine.decode import check_finite_steps, check_generation, greedy_steps  # noqa: E402


def test_check_generation_counts_the_last_token_as_never_fed_back():
    model = _fake_model()  # context 8
    ids, mask = torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)
    check_generation(model, ids, mask, 4)  # 5 + 4 new: the 4th is never fed back in, 8 columns at most
    with pytest.raises(UserError, match="exceed the model's context"):
        check_generation(model, ids, mask, 5)
    check_generation(model, ids, mask, 0)
    with pytest.raises(UserError, match="max_new_tokens"):
        check_generation(model, ids, mask, -1)
    # a longrope model: 5 prompt columns, then 1 step (the 2nd new token is never fed in): within its 6
    check_generation(_longrope(6), ids, mask, 2)
    with pytest.raises(UserError, match="first call covers 5 of 7"):
        check_generation(_longrope(6), ids, mask, 3)


def test_check_finite_steps_counts_the_bad_rows():
    check_finite_steps(torch.tensor([True, True]), torch.float32)
    with pytest.raises(UserError, match="NaN or inf in 2 of 3 rows"):
        check_finite_steps(torch.tensor([True, False, False]), torch.float32)


class _Scripted:
    """A model whose calls answer scripted logits (one row, vocab 3) and a top state that counts the calls; it
    records the state it is fed."""

    def __init__(self, logits):
        self.logits, self.fed, self.calls = logits, [], 0

    def out(self):
        top = torch.full((1, 1, 2), float(self.calls))
        return SimpleNamespace(logits=torch.tensor(self.logits[self.calls]).reshape(1, 1, 3), top=top)

    def __call__(self, tok, mask, state=None, cache=None, use_cache=False):
        self.fed.append(state)
        self.calls += 1
        return self.out()


def test_a_nan_step_between_finite_ones_is_refused():
    model = _Scripted([[0.0, 1.0, 0.0], [math.nan, 0.0, 0.0], [0.0, 0.0, 1.0]])
    with pytest.raises(UserError, match="NaN or inf in 1 of 1 rows"):
        greedy_steps(model, model.out(), None, torch.ones(1, 2, dtype=torch.long),
                     torch.ones(1, 2, dtype=torch.long), 3, fed=False)


def test_greedy_steps_feed_the_previous_top_state_when_fed():
    for fed in (True, False):
        model = _Scripted([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
        new = greedy_steps(model, model.out(), None, torch.ones(1, 2, dtype=torch.long),
                           torch.ones(1, 2, dtype=torch.long), 3, fed=fed)
        assert new.tolist() == [[1, 2, 0]]
        assert len(model.fed) == 2  # the last new token is never fed back in
        if fed:  # call i is fed the top state of the call before it (top i-1 = i - 1)
            assert [s.tolist() for s in model.fed] == [[[[0.0, 0.0]]], [[[1.0, 1.0]]]]
        else:
            assert model.fed == [None, None]


# ----- engine.loops ----------------------------------------------------------------------------------------
from engine.loops import exit_iterations  # noqa: E402


def test_exit_iterations_by_hand():
    states = torch.tensor([[1.0, 2.0, 2.1, 2.1],   # changes 1/2, 0.1/2.1, 0: first below 0.1 is i = 2
                           [1.0, 2.0, 4.0, 8.0],   # 1/2 every time: never below, R = 3
                           [1.0, 1.5, 3.0, 6.0]])[..., None]  # 0.5/1.5 = 1/3 (over the new state), then 1/2
    assert exit_iterations(states, 0.1).tolist() == [2, 3, 3]
    assert exit_iterations(states, 0.4).tolist() == [2, 3, 1]
    assert exit_iterations(states, 0.5).tolist() == [2, 3, 1]  # a change of exactly TOL is not below it
    assert exit_iterations(states, 0.6).tolist() == [1, 1, 1]


# ----- engine.hooks ----------------------------------------------------------------------------------------
from engine.hooks import ResidualRecorder, blocks_addressable, on_depth, put_columns  # noqa: E402


def test_put_columns_leaves_its_input_alone():
    h = torch.zeros(2, 3, 4)
    out = put_columns(h, [(1, torch.ones(2, 4)), (-1, lambda x: x + 2)])
    assert torch.equal(h, torch.zeros(2, 3, 4))
    assert out[:, 0].eq(0).all() and out[:, 1].eq(1).all() and out[:, 2].eq(2).all()


def test_blocks_of_a_looped_model_are_not_addressable():
    assert not blocks_addressable(SimpleNamespace(iterations=3))
    assert blocks_addressable(SimpleNamespace())


def test_recorded_needs_every_depth():
    rec = ResidualRecorder.__new__(ResidualRecorder)
    rec.buf = [torch.zeros(1), None]
    assert not rec.recorded
    rec.buf = [torch.zeros(1), torch.zeros(1)]
    assert rec.recorded


class _TwoArgs(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def test_a_depth_0_rewrite_keeps_the_blocks_other_arguments():
    layers = torch.nn.ModuleList([_TwoArgs()])
    x, y = torch.ones(2), torch.full((2,), 10.0)
    with torch.no_grad():
        handle = on_depth(layers, 0, lambda h: 2 * h)
        assert layers[0](x, y).tolist() == [12.0, 12.0]
        assert layers[0](x, y=y).tolist() == [12.0, 12.0]
        handle.remove()


# ----- models.lean_step: where it must not run --------------------------------------------------------------
def test_a_bias_that_is_a_buffer_takes_hf_path():
    from test_lean_step import plan_of, tiny_model

    model = tiny_model("qwen2")  # q / k / v projections with biases
    lin = model.lm.model.layers[1].self_attn.q_proj
    b = lin.bias.detach().clone()
    del lin.bias
    lin.register_buffer("bias", b)
    assert plan_of(model) == "a weight or bias that is not a parameter"


def test_a_module_in_training_mode_inside_an_eval_model_takes_hf_path():
    from test_lean_step import plan_of, tiny_model
    from models.lean_step import StepPlan

    model = tiny_model("llama", attention_dropout=0.5)  # HF's attention drops out in training mode
    model.lm.model.layers[1].self_attn.train()
    assert not model.lm.training
    assert isinstance(plan_of(model), str)
    model.lm.model.layers[1].self_attn.eval()
    assert isinstance(plan_of(model), StepPlan)


def test_an_output_capture_running_takes_hf_path():
    """HF's capturing hooks are inert only while no capture runs: during one they record, so HF's path."""
    from transformers.utils.output_capturing import _active_collector
    from test_lean_step import ids_for, plan_of, tiny_model
    from models.lean_step import StepPlan

    model = tiny_model("qwen3")
    ids = ids_for()
    with torch.no_grad():
        model(ids, torch.ones_like(ids), hidden_states=True)  # leaves HF's capturing hooks on the blocks
    assert isinstance(plan_of(model), StepPlan)
    token = _active_collector.set({})
    try:
        assert isinstance(plan_of(model), str)
    finally:
        _active_collector.reset(token)
    assert isinstance(plan_of(model), StepPlan)
