"""Tests written while hand-mutation testing analysis/recirculation/ (perplexity, dose, mediation, targeted) and
models/loading.py, tasks/tokenizer.py: each pins a number a user reads against a hand-written reference or an
invariant of the documented definition."""
from __future__ import annotations

import math
import types

import pytest
import torch

from common.errors import UserError

# ----- perplexity.Evaluator: NLL, temperatures, KL(base || run), token count, pct -------------------------------


@pytest.fixture(scope="module")
def gpt2_tiny():
    """perplexity.load's tiny GPT-2 with larger weights: peaked next-token distributions that recirculation moves."""
    from models.configs import gpt2_config
    from models.full_bandwidth import FullBandwidthLM

    cfg = gpt2_config(64, n_layers=4, d_model=32, n_heads=2, initializer_range=0.5)
    return FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval()


def _hand_lp(model, row, rlm=None, t=1.0):
    """log-probs [T - 1, V] (float64) of one unbatched row's next tokens, at temperature t."""
    x = row[None]
    m = torch.ones_like(x)
    with torch.no_grad():
        lg = model(x, m).logits if rlm is None else rlm.prefill(x, m, method="sequential", passes=2).logits
    return torch.log_softmax(lg[0, :-1].double() / t, -1)


def test_evaluator_numbers_against_a_per_row_hand_computation(gpt2_tiny):
    """3 chunks in batches of 2 (one short batch): the mean next-token NLL over every (row, position) pair, the NLL
    at each temperature, KL(base || recirculated) averaged per token, tokens = rows x (T - 1), ppl = exp(nll),
    pct = 100 (ppl / base ppl - 1); the base model run again has KL 0."""
    from analysis.recirculation.perplexity import Evaluator, pct
    from engine.recirculation import RecircSpec, RecirculatedLM

    model = gpt2_tiny
    data = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    temps = [0.5, 2.0]
    E = Evaluator(model, data, 2, temps)
    n = 3 * 9
    assert E.base.tokens == n and E.base.kl is None

    lp = {(k, t): [_hand_lp(model, r, rlm, t) for r in data]
          for k, rlm in (("base", None), ("rec", RecirculatedLM(model, RecircSpec(3, 1, 0.7, "convex"))))
          for t in [1.0] + ([] if k == "rec" else temps)}

    def nll(k="base", t=1.0):
        return sum(-float(x.gather(-1, r[1:, None]).sum()) for x, r in zip(lp[k, t], data)) / n

    assert E.base.nll == pytest.approx(nll(), rel=1e-5)
    for t in temps:
        assert E.base.nll_t[t] == pytest.approx(nll("base", t), rel=1e-5), t
    assert E.base.ppl == pytest.approx(math.exp(nll()), rel=1e-5)

    rlm = RecirculatedLM(model, RecircSpec(3, 1, 0.7, "convex"))
    e = E.run(rlm)
    assert e.tokens == n
    assert e.nll == pytest.approx(nll("rec"), rel=1e-5)
    kl = sum(float((b.exp() * (b - r)).sum()) for b, r in zip(lp["base", 1.0], lp["rec", 1.0])) / n
    assert kl > 1e-4 and e.kl == pytest.approx(kl, rel=1e-3, abs=1e-8)
    assert pct(e, E.base) == pytest.approx(100.0 * (math.exp(nll("rec")) / math.exp(nll()) - 1.0), rel=1e-4)
    again = E.run(None)  # the base model once more: KL(base || base) = 0, the cached log-probs are not replaced
    assert again.kl is not None and abs(again.kl) < 1e-9
    assert E.run(rlm).kl == pytest.approx(e.kl, rel=1e-6)


def test_evaluator_refuses_log_probs_over_a_quarter_of_the_machine(gpt2_tiny, monkeypatch):
    """The base log-probs kept for the KL (chunks x (T - 1) x vocab x 4 bytes) are refused above a quarter of the
    machine's memory, and not below it."""
    import os

    from analysis.recirculation.perplexity import Evaluator

    data = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    need = 2 * 7 * 64 * 4
    real = os.sysconf

    def machine(total):
        return lambda name: 1 if name == "SC_PAGE_SIZE" else total if name == "SC_PHYS_PAGES" else real(name)

    monkeypatch.setattr(os, "sysconf", machine(3 * need))  # a third: refused
    with pytest.raises(UserError, match="more than a quarter"):
        Evaluator(gpt2_tiny, data, 2, [1.0])
    monkeypatch.setattr(os, "sysconf", machine(5 * need))  # a fifth: runs
    Evaluator(gpt2_tiny, data, 2, [1.0])


# ----- dose: heatmap / dose-response / temperature choices on a stand-in study --------------------------------


def _study(tune, test, alphas=(0.0, 0.25, 0.5, 1.0), temps=(0.8, 1.0, 1.2), fail=2.0):
    """A Study stand-in: st.spec gives (mode, s, d, alpha), st.rlm the spec itself, each evaluator's run looks the
    spec up in its table of Evals."""
    def ev(table, base):
        return types.SimpleNamespace(base=base, run=lambda key: table[key])

    return types.SimpleNamespace(
        a=types.SimpleNamespace(alpha=0.5, fail=fail, ramp=0), pairs=[(3, 1), (2, 0)], alphas=list(alphas),
        temps=list(temps), res={}, spec=lambda s, d, al, mode, **kw: _Key((mode, s, d, float(al))), rlm=lambda sp: sp,
        E_tune=ev(*tune), E_test=ev(*test))


class _Key(tuple):
    @property
    def name(self):
        return ":".join(map(str, self))


def _eval(nll, nll_t=None, kl=0.0):
    from analysis.recirculation.perplexity import Eval

    return Eval(nll, nll_t or {}, kl, 0.0, 10)


def _chg(nll, base):
    return 100.0 * (math.exp(nll - base) - 1.0)


def test_heatmap_runs_every_pair_in_both_modes_and_returns_the_lowest_cell():
    from analysis.recirculation.dose import heatmap

    nlls = {("convex", 3, 1, 0.5): 2.2, ("convex", 2, 0, 0.5): 2.05, ("residual", 3, 1, 0.5): 1.95,
            ("residual", 2, 0, 0.5): 2.5}
    st = _study(({k: _eval(v) for k, v in nlls.items()}, _eval(2.0)), ({}, _eval(2.0)))
    assert heatmap(st) == ("residual", 3, 1)
    cells = {(c["mode"], c["source"], c["target"]): c["ppl_change_pct"] for c in st.res["heatmap"]["cells"]}
    assert cells == pytest.approx({k[:3]: _chg(v, 2.0) for k, v in nlls.items()})


def test_dose_response_tunes_a_positive_alpha_and_finds_the_first_failing_one():
    """alpha 0 (tune change 0 by definition) is never the tuned alpha, even when every alpha > 0 hurts; the
    failure point is the first alpha whose held-out change is above --fail; the best point is the tuned alpha's
    held-out Eval."""
    from analysis.recirculation.dose import dose_response

    key = lambda al: ("convex", 3, 1, al)  # noqa: E731
    tune = {key(0.25): _eval(2.03), key(0.5): _eval(2.01), key(1.0): _eval(2.2)}
    test = {key(0.25): _eval(3.005, kl=0.1), key(0.5): _eval(3.04, kl=0.2), key(1.0): _eval(3.3, kl=0.3)}
    st = _study((tune, _eval(2.0)), (test, _eval(3.0)))
    best = dose_response(st, "convex", 3, 1)
    assert st.res["best"]["alpha"] == 0.5 and best["alpha"] == 0.5
    assert st.res["best"]["test_ppl"] == pytest.approx(math.exp(3.04))
    assert st.res["best"]["test_ppl_change_pct"] == pytest.approx(_chg(3.04, 3.0))
    assert st.res["best"]["tune_ppl_change_pct"] == pytest.approx(_chg(2.01, 2.0))
    assert st.res["best"]["test_kl"] == 0.2
    assert st.res["dose"]["failure_alpha"] == 0.5  # +4.1% > 2%; alpha 0.25: +0.5%
    pts = st.res["dose"]["points"]
    assert [p["alpha"] for p in pts] == [0.0, 0.25, 0.5, 1.0] and pts[0]["test_kl"] == 0.0
    assert pts[0]["test_ppl_change_pct"] == 0.0 and pts[0]["tune_ppl_change_pct"] == 0.0


def test_temperature_tunes_each_temperature_on_its_own_run():
    from analysis.recirculation.dose import temperature

    tune = {"spec": _eval(2.0, {0.8: 2.7, 1.0: 2.8, 1.2: 2.9})}
    test_base = _eval(3.0, {0.8: 3.2, 1.0: 3.0, 1.2: 3.1})
    st = _study((tune, _eval(2.0, {0.8: 3.0, 1.0: 2.9, 1.2: 2.95})), ({}, test_base))
    rec_test = _eval(2.95, {0.8: 2.9, 1.0: 2.95, 1.2: 3.05})
    temperature(st, "spec", {"test_eval": rec_test})
    t = st.res["temperature"]
    assert t["t_temperature_only"] == 1.0 and t["t_both"] == 0.8
    assert t["temperature_only_pct"] == pytest.approx(_chg(3.0, 3.0))
    assert t["recirculation_only_pct"] == pytest.approx(_chg(2.95, 3.0))
    assert t["both_pct"] == pytest.approx(_chg(2.9, 3.0))
    assert t["sum_of_parts_pct"] == pytest.approx(_chg(3.0, 3.0) + _chg(2.95, 3.0))


# ----- mediation (f), binary: LD_true = logit(true) - logit(other label), on the held-out groups ---------------


@pytest.fixture(scope="module")
def task_model():
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, initializer_range=0.1)
    return FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().float(), tok


def _held_out_subset(per_group, n_test_groups, n_test, mean, acc):
    """The n_test_groups groups (None: none) that hold n_test samples whose LD_true mean and accuracy (LD > 0, a tie
    1/2) are the reported ones: the held-out split is half the groups, drawn by the seed."""
    import itertools

    import numpy as np

    for gs in itertools.combinations(sorted(per_group), n_test_groups):
        ld = np.concatenate([per_group[g] for g in gs])
        if len(ld) == n_test and abs(ld.mean() - mean) < 1e-4 and \
                abs(np.mean((ld > 0) + 0.5 * (ld == 0)) - acc) < 1e-9:
            return set(gs)
    return None


def test_binary_mediation_reads_the_true_label_minus_the_other(task_model):
    """parity (K = 2): the base and full conditions' mean LD_true and accuracy are those of a hand-written
    per-prompt computation (logit of the true label word minus the other's) over half of the groups; the task
    subspace, its complement and the random subspace are three different runs."""
    import numpy as np

    from analysis.recirculation.mediation import mediation, mediation_inputs
    from engine.recirculation import RecircSpec, RecirculatedLM

    model, tok = task_model
    spec = RecircSpec(3, 1, 0.8, "residual")
    med = mediation(model, tok, [spec], "parity", 10, 4, 8, 0)
    _, samples, ids, lab = mediation_inputs(tok, "parity", 10, 4, 0)
    assert med["n_classes"] == 2 and med["rank"] == 1 and med["n_test"] + med["n_train"] == len(samples)
    c = med["conditions"]
    held_out = {}
    for name, rlm in (("base", None), ("full", RecirculatedLM(model, spec, bypass_identity=False))):
        per_group: dict = {}
        for s, row in zip(samples, ids):
            x = torch.tensor([row])
            with torch.no_grad():
                lg = model(x, torch.ones_like(x)).logits if rlm is None else \
                    rlm.prefill(x, torch.ones_like(x), cols=torch.tensor([len(row) - 1])).logits
            z = lg[0, -1, lab].double()
            per_group.setdefault(s.group_id, []).append(float(z[s.label] - z[1 - s.label]))
        per_group = {g: np.array(v) for g, v in per_group.items()}
        held_out[name] = _held_out_subset(per_group, med["n_test_groups"], med["n_test"], c[name]["mean_ld"],
                                          c[name]["accuracy"])
        assert held_out[name] is not None, name
    # the probe is fitted on the training groups' residuals at the source depth of the prompt's LAST token
    from engine.prefill import prefill
    from stats.linear import LinearProbe

    X = []
    for row in ids:
        x = torch.tensor([row])
        X.append(prefill(model, x, torch.ones_like(x), "standard", collect=True).resid[0, -1, spec.source].double())
    X = torch.stack(X).numpy()
    y = np.array([s.label for s in samples])
    te = np.array([s.group_id in held_out["base"] for s in samples])
    probe = LinearProbe().fit(X[~te], y[~te], np.array([s.group_id for s in samples])[~te])
    assert abs(med["probe_train_accuracy"] - probe.score(X[~te], y[~te])) < 1e-9
    assert abs(med["probe_test_accuracy"] - probe.score(X[te], y[te])) < 1e-9
    # ... and the task subspace condition recirculates along that probe's direction (by hand, per prompt)
    import dataclasses

    from analysis.recirculation.mediation import probe_subspace
    from interventions.subspace import orthonormal

    rlm = RecirculatedLM(model, dataclasses.replace(spec, subspace=orthonormal(probe_subspace(probe))),
                         bypass_identity=False)
    lds = []
    for s, row in zip(samples, ids):
        if s.group_id in held_out["base"]:
            x = torch.tensor([row])
            with torch.no_grad():
                z = rlm.prefill(x, torch.ones_like(x), cols=torch.tensor([len(row) - 1])).logits[0, -1, lab].double()
            lds.append(float(z[s.label] - z[1 - s.label]))
    assert abs(np.mean(lds) - c["task_subspace"]["mean_ld"]) < 1e-4
    assert abs(c["full"]["mean_ld_change"] - (c["full"]["mean_ld"] - c["base"]["mean_ld"])) < 1e-6
    lds = [c[k]["mean_ld"] for k in ("task_subspace", "complement", "random_subspace")]
    assert len({round(v, 6) for v in lds}) == 3, lds


# ----- models/loading.py and tasks/tokenizer.py ----------------------------------------------------------------


def test_an_existing_folder_named_like_the_study_model_is_read_as_a_folder(tmp_path, monkeypatch):
    """`smollm2-135m` names the study's SmolLM2 only where no such folder exists (as a preset name does)."""
    from pathlib import Path

    from models.loading import model_dir

    monkeypatch.chdir(tmp_path)
    assert model_dir("smollm2-135m") is None
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    assert model_dir("smollm2-135m") == Path("smollm2-135m")


def test_a_pad_that_is_the_bos_or_the_eos_is_no_dedicated_pad():
    from tasks.tokenizer import dedicated_pad_id

    tok = types.SimpleNamespace
    assert dedicated_pad_id(tok(pad_token_id=5, eos_token_id=2, bos_token_id=1)) == 5
    assert dedicated_pad_id(tok(pad_token_id=2, eos_token_id=2, bos_token_id=1)) is None
    assert dedicated_pad_id(tok(pad_token_id=1, eos_token_id=2, bos_token_id=1)) is None
    assert dedicated_pad_id(tok(pad_token_id=None, eos_token_id=2, bos_token_id=1)) is None


def test_targeted_failure_alpha_is_the_first_drop_beyond_five_points():
    """targeted.failure_alphas: the first alpha whose accuracy falls MORE than 0.05 below base; a drop of exactly
    one row in 20 (0.05, as a mean of 0/1 rows computes it) is no failure; a gain is none; per condition."""
    import numpy as np

    from analysis.recirculation.targeted import failure_alphas

    def change(k_wrong, n=20):  # the mean accuracy change when k of n rows flip from right to wrong
        return float(np.mean(np.r_[np.zeros(n - k_wrong), -np.ones(k_wrong)]))

    points = [{"alpha": 0.1, "uniform": {"accuracy_change": change(1)}, "targeted": {"accuracy_change": 0.1}},
              {"alpha": 0.2, "uniform": {"accuracy_change": change(2)}, "targeted": {"accuracy_change": change(1)}},
              {"alpha": 0.4, "uniform": {"accuracy_change": change(1)}, "targeted": {"accuracy_change": change(3)}}]
    assert failure_alphas(points) == {"uniform": 0.2, "targeted": 0.4}
    assert failure_alphas(points[:1]) == {"uniform": None, "targeted": None}
