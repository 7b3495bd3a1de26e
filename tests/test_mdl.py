"""Online-code MDL (probes.mdl) on synthetic data whose answer is known, the grouped block plan, the code by hand,
and the depth-curve page's lens / MDL rows."""
from __future__ import annotations

import numpy as np
import pytest

from stats.linear import ProbeConfig
from probes.mdl import _neg_log2_prob, block_plan, online_code


def paired(n_pairs=96, d=16, shift=3.0, k=2, seed=0):
    rng = np.random.default_rng(seed)
    y = np.concatenate([[i % k, (i + 1) % k] for i in range(n_pairs)])
    groups = np.repeat(np.arange(n_pairs), 2)
    X = rng.normal(size=(len(y), d))
    X[np.arange(len(y)), y] += shift
    return X, y, groups, rng


@pytest.mark.parametrize("k", [2, 3])
def test_separable_compresses_and_shuffled_does_not(k):
    X, y, groups, rng = paired(k=k)
    good = online_code(X, y, groups)
    y_shuf = y[rng.permutation(len(y))]
    bad = online_code(X, y_shuf, groups)
    assert good.compression > 3.0  # a few examples suffice: most samples cost a fraction of a bit
    assert bad.compression < 1.15  # nothing to learn: no better than the uniform code (up to what a probe overfits)
    assert good.online_bits < bad.online_bits
    assert good.uniform_bits == bad.uniform_bits == pytest.approx(len(y) * np.log2(k))


def test_constant_features_cost_exactly_the_uniform_code():
    _, y, groups, _ = paired()
    s = online_code(np.zeros((len(y), 4)), y, groups)
    assert s.compression == pytest.approx(1.0, abs=1e-9)


def test_block_plan_keeps_groups_whole_and_doubles():
    X, y, groups, _ = paired(n_pairs=80, k=3)
    plan = block_plan(y, groups, ProbeConfig(random_state=5))
    assert sorted(plan.order.tolist()) == list(range(len(y)))
    ends = plan.ends
    assert ends[-1] == len(y) and all(a < b for a, b in zip(ends, ends[1:]))
    starts = (0,) + ends[:-1]
    seen = set()
    for a, b in zip(starts, ends):  # no group is split between two blocks
        g = set(groups[plan.order[a:b]].tolist())
        assert not g & seen
        seen |= g
    first = plan.order[:ends[0]]
    for c in range(3):  # the first probe sees every class in >= 2 groups
        assert len(set(groups[first][y[first] == c].tolist())) >= 2
    with pytest.raises(Exception, match="at least 2 groups"):
        block_plan(y[:2], groups[:2])


def test_code_length_by_hand():
    s = np.array([2.0, -1.0, 0.0])
    got = _neg_log2_prob(s, np.array([0, 1]), np.array([1, 1, 0]))
    sig = 1 / (1 + np.exp(-s))
    assert np.allclose(got, -np.log2([sig[0], sig[1], 1 - sig[2]]))
    S = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    got = _neg_log2_prob(S, np.array([0, 1, 2]), np.array([2, 0]))
    p = np.exp(S) / np.exp(S).sum(1, keepdims=True)
    assert np.allclose(got, -np.log2([p[0, 2], p[1, 0]]))
    X, y, groups, _ = paired(n_pairs=40)
    res = online_code(X, y, groups)
    assert res.block_bits[0] == pytest.approx(res.block_ends[0] * 1.0)  # first block: 1 bit per binary label
    assert res.online_bits == pytest.approx(sum(res.block_bits))


def test_depth_curve_page_has_lens_and_mdl_rows():
    from probes.depth_curves import depth_curve_figure

    rows = []
    for m in ("standard", "recurrent-1"):
        for d in range(3):
            rows.append(dict(task="completion", model="tiny", mode=m, n_distractors=8, writes=None, depth=d,
                             accuracy=0.8, accuracy_std=0.01, ci_low=0.7, ci_high=0.9, control_accuracy=0.5,
                             selectivity=0.3, n_samples=40, n_groups=20, fold_accuracies=[0.8] * 5,
                             logit_lens_ld=float(d), logit_lens_ld_ci=[d - 0.1, d + 0.1], logit_lens_rank=2.0,
                             logit_lens_accuracy=0.7, mdl_online_bits=10.0, mdl_uniform_bits=40.0,
                             mdl_compression=4.0))
    fed = [dict(task="completion", model="tiny", mode="recurrent-1", n_distractors=8, writes=None, state="h_{T-1}",
                n_samples=40, logit_lens_ld=-2.5, logit_lens_ld_ci=[-3, -2], logit_lens_rank=3.0,
                logit_lens_accuracy=0.2)]
    fig = depth_curve_figure({"meta": {"model": {"name": "tiny"}}, "results": rows, "fed_state_lens": fed})
    names = [t.name for t in fig.data if t.name]
    assert names.count("N=8 (lens)") == 2 and names.count("N=8 (MDL)") == 2
    point = next(t for t in fig.data if t.name == "N=8 (fed state lens)")
    assert list(point.x) == [-1] and list(point.y) == [-2.5]
    assert fig.layout.yaxis3.title.text == "logit lens: label LD" and fig.layout.yaxis5.title.text == "MDL compression"
    lo, hi = fig.layout.yaxis3.range
    assert lo < -2.5 and hi > 2.0  # the fed-state point and every depth are inside the lens row's range
