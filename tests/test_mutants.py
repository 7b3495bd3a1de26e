"""Tests written against mutants of the code that computes numbers users read, each of which the rest of the
suite let through (a hand mutation-testing review): every test here fails on its mutant (named in its docstring)
and checks behaviour against a hand-written reference or an invariant, never against the code's own output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from interventions.core import CausalContext
from tests.test_interventions_modes import _batch, _naive_recurrence


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----- the recurrence ------------------------------------------------------------------------------------------
def test_recurrent_start_is_column_one_once_k_reaches_t_minus_1():
    """recurrent-k with k >= T-1 recomputes every column after the first, as recurrent-full does (mutant: the
    first recomputed column clamped with T-2, so k >= T-1 started at column 2)."""
    from engine.prefill import recurrent_start

    T = 7
    assert [recurrent_start(T, k) for k in (1, 3, 5, 6, 7, 100)] == [6, 4, 2, 1, 1, 1]
    assert recurrent_start(T, None) == 1
    assert recurrent_start(1, None) == recurrent_start(1, 4) == 1


def test_a_patch_under_recurrent_k_with_k_at_least_t_minus_1_matches_the_naive_recurrence(tiny_model):
    """The patcher of recurrent-k, k >= T-1, fuses every column from 1 on, as its clean run does: a residual patch
    at column 0 then propagates through a fused column 1 (mutant: recurrent_start clamped with T-2, so the
    patcher reran column 1 unfused and gave the wrong logits)."""
    batch = _batch(tiny_model, pad=False)
    T = batch.input_ids.shape[1]
    mode = f"recurrent-{T - 1}"
    ctx = CausalContext(tiny_model, batch, modes=("standard", mode))
    assert ctx.fused_positions(mode) == list(range(1 - T, 0))
    ids, mask = batch.input_ids, batch.attention_mask
    for depth in (0, tiny_model.n_layers):
        value = ctx.resid(mode)[:, 0, depth][batch.pair]
        got = ctx.patch_resid(mode, depth, -T, batch.pair)
        ref = _naive_recurrence(tiny_model, ids, mask, resid_patch=(depth, 0, value))
        assert torch.allclose(got, ref, atol=1e-5), depth


# ----- looped models: the adaptive exit --------------------------------------------------------------------------
def test_exit_iterations_divides_by_the_new_state():
    """|s_i - s_(i-1)| / |s_i| (mutant: divided by |s_(i-1)|). Hand values: s = 1, 2, 4 on one axis: each change is
    1/2 of the new state (but 1 of the old), so a tolerance of 0.6 exits at i = 1."""
    from engine.loops import exit_iterations

    states = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [4.0, 0.0]],
                           [[0.0, 3.0], [0.0, 4.0], [0.0, 4.0]]])  # change 1/4 (of 4) or 1/3 (of 3), then 0
    assert exit_iterations(states, 0.6).tolist() == [1, 1]
    assert exit_iterations(states, 0.3).tolist() == [2, 1]
    assert exit_iterations(states, 0.2).tolist() == [2, 2]


def test_adaptive_exit_reads_the_loop_states_the_hand_written_loop_computes():
    """loop-R:TOL exits each prompt at the first i whose loop state s_i at T moved by less than TOL of its norm,
    with s_i taken from the hand-written loop (mutant: the states read one depth too shallow)."""
    from engine.prefill import prefill_many
    from tests.test_looped import hand_loop, ids_of, make

    model = make()
    ids, mask = ids_of(B=6, T=9, seed=3)
    R = 6
    with torch.no_grad():
        _, states = hand_loop(model, ids, R)
    s = torch.stack([x[:, -1] for x in states], 1).double()  # [B, R+1, D]
    change = ((s[:, 1:] - s[:, :-1]).norm(dim=-1) / s[:, 1:].norm(dim=-1)).numpy()  # [B, R]
    exits = set()
    for q in (0.2, 0.4, 0.5, 0.6, 0.8):  # tolerances between the changes: rows exit at different iterations
        tol = float(np.quantile(change, q))
        hand = [next((i + 1 for i in range(R) if change[b, i] < tol), R) for b in range(len(change))]
        exits |= set(hand)
        got = prefill_many(model, ids, mask, [f"loop-{R}:{tol!r}"])[f"loop-{R}:{tol!r}"].iterations
        assert got.tolist() == hand, q
    assert len(exits) > 2


# ----- recirculation's mix ----------------------------------------------------------------------------------------
def test_mix_applies_the_transform_as_zs_times_its_transpose():
    """RecircSpec.transform T is applied as z_s @ T.T (a row vector times T^T, i.e. T z_s), before the norm match
    (mutant: z_s @ T). T a cyclic shift, (T z)_i = z_(i+1): by hand, z_d = (0, 0, 5), z_s = (1, 2, 2) (norm 3),
    T z_s = (2, 2, 1), residual alpha 0.6: 0.6 * 5/3 * (2, 2, 1) + z_d = (2, 2, 6)."""
    from engine.mixing import RecircSpec, mix

    P = torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]])  # P @ z = (z_1, z_2, z_0)
    zd, zs = torch.tensor([[0.0, 0.0, 5.0]]), torch.tensor([[1.0, 2.0, 2.0]])
    got = mix(zd, zs, RecircSpec(2, 0, 0.6, "residual", transform=P))
    assert torch.allclose(got, torch.tensor([[2.0, 2.0, 6.0]]), atol=1e-6)


@pytest.mark.parametrize("spec", ["3:1:0.5:residual:ramp6", "3:0:0.4:convex:ramp4"])
def test_recirculated_generation_logits_equal_the_exact_prefill_with_a_ramp(spec):
    """Each generated token's logits are the exact sequential prefill's at that column, ramped alpha included
    (r_(t-1) is mixed with alpha at t-1's position; mutant: with n_t's, one position later). The logits of every
    step are compared, not only their argmax (a small model's argmax rarely moves)."""
    from engine.mixing import parse_recirculate
    from engine.recirculation import RecirculatedLM
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM

    cfg = qwen3_config(50, n_layers=3, d_model=32, initializer_range=0.1)
    base = FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().float()
    r = RecirculatedLM(base, parse_recirculate(spec, 3))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 50, (2, 3), generator=g)
    mask = torch.ones_like(ids)
    seen = []
    head = r._head
    r._head = lambda top: seen.append(head(top)) or seen[-1]  # every logits the generation computes, in order
    new = r.generate(ids, mask, 5)
    r._head = head
    full = torch.cat([ids, new[:, :-1]], 1)
    ref = r.prefill(full, torch.ones_like(full)).logits  # [B, 3 + 4, V]
    steps = torch.stack([s.reshape(2, -1) for s in seen[-4:]], 1)  # the 4 one-token steps after the prefill
    assert torch.allclose(steps, ref[:, 3:], atol=1e-5)
    assert torch.equal(ref[:, 2:].argmax(-1), new)


def test_mix_subspace_keeps_the_projection_of_the_change_by_hand():
    """With a subspace U only the projection of the change z' - z_d onto span(U) is applied (its complement: the
    rest of the change), not the projection of z' itself (mutant). By hand, D = 2, U = e_0: z_d = (3, 4),
    z_s = (0, 10), convex alpha 0.2: z' = 0.2 * 5/10 * (0, 10) + 0.8 * (3, 4) = (2.4, 4.2), change (-0.6, 0.2);
    subspace: (3 - 0.6, 4) = (2.4, 4); complement: (3, 4 + 0.2) = (3, 4.2)."""
    from engine.mixing import RecircSpec, mix

    zd, zs, U = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 10.0]]), torch.tensor([[1.0], [0.0]])
    assert torch.allclose(mix(zd, zs, RecircSpec(2, 0, 0.2)), torch.tensor([[2.4, 4.2]]))
    assert torch.allclose(mix(zd, zs, RecircSpec(2, 0, 0.2, subspace=U)), torch.tensor([[2.4, 4.0]]))
    assert torch.allclose(mix(zd, zs, RecircSpec(2, 0, 0.2, subspace=U, subspace_complement=True)),
                          torch.tensor([[3.0, 4.2]]))
