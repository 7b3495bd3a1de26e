"""Tests written while hand-mutation testing tasks/ and analysis/: each pins a number a user reads against a
hand-written reference or an invariant of the documented definition, and names the mutant it kills."""
from __future__ import annotations

import json
import math

import pytest
import torch

from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM
from tasks import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _model(tok, seed):
    return FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                                                    initializer_range=0.1), seed=seed).eval()


@pytest.fixture(scope="module")
def two_ckpts(tmp_path_factory, tok):
    out = []
    for seed in (0, 1):
        d = tmp_path_factory.mktemp("m") / f"fbt{seed}"
        _model(tok, seed).save_pretrained(d, tokenizer=tok)
        out.append(d)
    return out


# ----- analysis.stability --------------------------------------------------------------------------------------
def test_stability_curve_numbers_by_hand_on_a_padded_batch(tok):
    """analysis.stability.stability_curve against its module doc on a left-padded batch of unequal prompts:
    val_loss = mean next-token NLL over the positions whose token and next token are both real; state_change =
    mean over real positions of ||h^(k) - h^(k-1)|| (k - 1 the previous PASS, even when it is not kept);
    state_norm = mean over real positions of ||h^(k)||; label_accuracy = argmax at the final prompt token.
    Kills: valid mask without the mask[:, :-1] factor; nll.mean() over pad positions; (top + prev); the norms'
    mean over pad positions; `prev = out.top` only on kept passes; logits[:, -1] for the label."""
    from analysis.stability import stability_curve, task_ids
    from engine.prefill import iter_fused

    torch.manual_seed(0)
    model = _model(tok, 0)
    with torch.no_grad():  # the top state is RMS-normed: unequal norm weights make its norm vary by position
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.uniform_(0.5, 1.5)
    ids, mask = task_ids(tok, "multi_register", 2, 3)  # writes 2, 4, 8: three prompt lengths
    assert len(set(mask.sum(1).tolist())) == 3 and (mask[:, 0] == 0).any()  # really padded
    rows = stability_curve(model, ids, mask, "multi_register", 2, 3, keep={0, 1, 3})
    assert [r["passes"] for r in rows] == [0, 1, 3]
    with torch.no_grad():
        outs = {k: (o.logits.float().clone(), o.top.float().clone()) for k, o in iter_fused(model, ids, mask, 3)}
    B, T = ids.shape
    for r in rows:
        k = r["passes"]
        logits, top = outs[k]
        nll = [float(-torch.log_softmax(logits[b, p], -1)[ids[b, p + 1]])
               for b in range(B) for p in range(T - 1) if mask[b, p] and mask[b, p + 1]]
        assert r["val_loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
        real = [(b, p) for b in range(B) for p in range(T) if mask[b, p]]
        norm = sum(float(top[b, p].norm()) for b, p in real) / len(real)
        assert float(top.norm(dim=-1).mean()) != pytest.approx(norm, rel=1e-4)  # the pads' would change it
        assert r["state_norm"] == pytest.approx(norm, rel=1e-5)
        if k == 0:
            assert r["state_change"] is None
        else:
            prev = outs[k - 1][1]  # the pass before, kept or not
            change = sum(float((top[b, p] - prev[b, p]).norm()) for b, p in real) / len(real)
            assert r["state_change"] == pytest.approx(change, rel=1e-4)
        acc = sum(int(logits[b, T - 2].argmax()) == int(ids[b, T - 1]) for b in range(B)) / B
        assert r["label_accuracy"] == pytest.approx(acc)


def test_gate_digit_difference_is_the_mean_absolute_difference(tok):
    """analysis.stability.gate_token_dependence: digits_01_abs_diff = mean |gate("0") - gate("1")| over units and
    token_std = std over the vocabulary per unit, averaged over units (docstring), checked by hand on a gate whose
    weights are set. Kills: mean of the signed difference then abs; std over units (dim 1) instead of tokens."""
    from analysis.stability import gate_token_dependence

    model = _model(tok, 0)
    emb = model.embed(torch.arange(len(tok))[None])[0].detach()
    with torch.no_grad():
        g = torch.sigmoid(model.fusion.gate(emb))
    i0, i1 = tok.convert_tokens_to_ids("0"), tok.convert_tokens_to_ids("1")
    d = (g[i0] - g[i1]).tolist()
    assert any(x > 0 for x in d) and any(x < 0 for x in d)  # signed differences cancel in a wrong formula
    out = gate_token_dependence(model, tok)
    assert out["digits_01_abs_diff"] == pytest.approx(sum(abs(x) for x in d) / len(d), rel=1e-5)
    n = g.shape[0]
    stds = []
    for u in range(g.shape[1]):
        col = g[:, u].double()
        m = float(col.mean())
        stds.append(math.sqrt(float(((col - m) ** 2).sum()) / (n - 1)))
    assert out["token_std"] == pytest.approx(sum(stds) / len(stds), rel=1e-4)


# ----- analysis.gains ------------------------------------------------------------------------------------------
def test_gains_arms_are_the_documented_model_and_mode(two_ckpts, tmp_path, tok):
    """analysis.gains with two DIFFERENT checkpoints: each arm's row is the documented (model, mode) evaluated
    alone (baseline = the standard model, std; fbt/std, fbt/soft, fbt/fused = the fbt model in that mode), and
    rows are sorted by task, then N ascending, then arm. Kills: baseline read from the fbt model; soft and fused
    arms swapped; the std model evaluated in another mode; the N order reversed."""
    from analysis import gains
    from analysis.evaluate import evaluate

    fbt_dir, std_dir = two_ckpts
    gains.main(["--fbt", str(fbt_dir), "--std", str(std_dir), "--tasks", "memory", "--distractors", "0,2",
                "--n-pairs", "4", "--out", str(tmp_path / "g"), "--no-progress"])
    rows = json.loads((tmp_path / "g" / "gains.json").read_text())["results"]
    assert [(r["n_distractors"], r["arm"]) for r in rows] == \
        [(n, a) for n in (0, 2) for a in ("baseline", "fbt/std", "fbt/soft", "fbt/fused")]
    fbt, std = FullBandwidthLM.from_pretrained(fbt_dir).eval(), FullBandwidthLM.from_pretrained(std_dir).eval()
    ref = {}
    for which, m, modes in (("std", std, ["std", "soft"]), ("fbt", fbt, ["std", "soft", "fused"])):
        for r in evaluate(m, tok, ["memory"], [0, 2], modes, 0, 4, progress=False):
            ref[(which, r["mode"], r["n_distractors"])] = (r["accuracy"], r["label_loss"])
    arm_src = {"baseline": ("std", "std"), "fbt/std": ("fbt", "std"), "fbt/soft": ("fbt", "soft"),
               "fbt/fused": ("fbt", "fused")}
    for r in rows:
        acc, loss = ref[(*arm_src[r["arm"]], r["n_distractors"])]
        assert r["accuracy"] == acc and r["label_loss"] == pytest.approx(loss, rel=1e-5), r
    # the arms are distinguishable here, so the check above can tell them apart
    assert ref[("std", "std", 2)][1] != pytest.approx(ref[("fbt", "std", 2)][1], rel=1e-4)
    assert ref[("fbt", "soft", 2)][1] != pytest.approx(ref[("fbt", "fused", 2)][1], rel=1e-4)
    assert ref[("std", "std", 2)][1] != pytest.approx(ref[("std", "soft", 2)][1], rel=1e-4)


# ----- analysis.evaluate ---------------------------------------------------------------------------------------
def test_fused_sweep_rows_equal_the_single_fused_modes(tok):
    """analysis.evaluate: `fused-1..K` 'evaluates every fused-k for k = 1..K in one Jacobi run and reports each k'
    (module doc): each sweep row equals the same fused-k evaluated as a single mode (accuracy, CI, label loss).
    Kills: sweep_correct / sweep_nll indexed k - 1 (pass k - 1 reported as fused-k); the sweep's labels out of
    sample order (y[None].flip(-1))."""
    from analysis.evaluate import evaluate

    from tasks import label_token_ids

    model = _model(tok, 0)
    with torch.no_grad():  # the label words' rows scaled up: the full-vocabulary argmax lands on them, both ways
        model.lm.model.embed_tokens.weight[label_token_ids(tok, "shell_game")] *= 4
    single = evaluate(model, tok, ["shell_game"], [3], ["fused-1", "fused-2", "fused-3"], 0, 6, progress=False)
    swept = evaluate(model, tok, ["shell_game"], [3], ["std"], 3, 6, progress=False)
    key = lambda rows: {r["mode"]: r for r in rows}  # noqa: E731
    s, w = key(single), key(swept)
    for k in (1, 2, 3):
        a, b = s[f"fused-{k}"], w[f"fused-{k}"]
        assert (a["accuracy"], a["ci_low"], a["ci_high"]) == pytest.approx((b["accuracy"], b["ci_low"], b["ci_high"]))
        assert a["label_loss"] == pytest.approx(b["label_loss"], rel=1e-4)
    # pass k and pass k - 1 differ here, so an off-by-one in the sweep's index would show
    assert w["std"]["label_loss"] != pytest.approx(w["fused-1"]["label_loss"], rel=1e-4)
    assert w["fused-1"]["label_loss"] != pytest.approx(w["fused-2"]["label_loss"], rel=1e-4)
    assert w["std"]["accuracy"] != w["fused-1"]["accuracy"] and 0 < w["fused-3"]["accuracy"] < 1


def test_table_last_column_is_the_minimum_over_the_sweep():
    """analysis.evaluate.table: the column 'min fused-1..K' is the minimum accuracy over fused-1..K (its name).
    Kills: max instead of min."""
    from analysis.evaluate import table

    base = {"task": "memory", "n_distractors": 8}
    rows = [{**base, "mode": "std", "accuracy": 0.9}] + \
        [{**base, "mode": f"fused-{k}", "accuracy": a} for k, a in ((1, 0.75), (2, 0.25), (3, 0.5))]
    text = table(rows, 3)
    assert text.splitlines()[0].split()[-1] == "fused-1..3"
    assert text.splitlines()[1].split()[-1] == "0.250"


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (7, 20), (20, 20), (1, 1), (5, 13), (9, 10), (0, 1)])
def test_wilson_interval_matches_the_closed_form(k, n):
    """analysis.evaluate.wilson_interval against the Wilson score interval written out here, z = 1.959964
    (95%): centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n); exact 0 and 1
    at k = 0 and k = n only. Kills: a changed term of the formula; an exact 1 given at k = n - 1."""
    from analysis.evaluate import wilson_interval

    z = 1.959963984540054
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(max(0.0, centre - half), abs=1e-12)
    assert hi == pytest.approx(min(1.0, centre + half), abs=1e-12)
    assert (hi == 1.0) == (k == n) and (lo == 0.0) == (k == 0)


# ----- tasks.generators ----------------------------------------------------------------------------------------
def test_multi_register_reads_are_all_there_and_answered_with_the_latest_write():
    """tasks.generators._with_reads: `reads` answered queries of registers written so far, each answered with the
    register's latest value (docstring). With N = 0 (no nop) every slot follows a write, so each prompt holds
    exactly `reads` reads plus the final query, and the label is the queried register's latest write.
    Kills: read slots drawn from 0.. (a slot before any write is dropped); the first write kept as the answer."""
    from tasks import make_dataset

    reads = 12
    for s in make_dataset("multi_register", 30, 0, seed=3, writes=2, reads=reads):
        lines = s.text.split("\n")
        assert sum(ln.startswith("get ") for ln in lines) == reads + 1
        latest = {}
        for i, ln in enumerate(lines[:-2]):
            if ln.startswith("get "):
                reg = ln[4:]
                assert reg in latest and lines[i + 1] == f"value: {latest[reg]}", (i, s.text)
            elif " = " in ln:
                reg, v = ln.split(" = ")
                latest[reg] = int(v)
        assert lines[-2].startswith("get ") and latest[lines[-2][4:]] == s.label


# ----- analysis.fixed_point ------------------------------------------------------------------------------------
def test_fixed_point_errors_are_the_relative_errors_of_fused_k(tok, capsys):
    """analysis.fixed_point.errors prints, per task, relative error = ||h - h_std||^2 / ||h_std||^2 of the top state
    averaged over REAL positions, for fused-k from the standard states, k = 1..8 (module doc); the reference here is
    the engine's own fused-k (engine.prefill.iter_fused), and multi_register's prompts are padded. Kills: a
    denominator without the square; the mean over pad positions too."""
    from analysis import fixed_point
    from engine.prefill import iter_fused

    model = _model(tok, 0)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.uniform_(0.5, 1.5)
    batches = fixed_point._checked_batches(model, tok, 2, False)
    fixed_point.errors(model, tok, 2, batches)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "fused-k from std" in ln]
    assert len(lines) == 3
    for task, ln in zip(fixed_point.ERROR_TASKS, lines):
        _, ids, mask = batches[task]
        with torch.no_grad():
            tops = [o.top.float().clone() for _, o in iter_fused(model, ids, mask, 8)]
        real = mask.bool()
        ref = [float(((t - tops[0]).pow(2).sum(-1) / tops[0].pow(2).sum(-1))[real].mean()) for t in tops[1:]]
        got = [float(v) for v in ln.split("k = 1..8:")[1].split("|")[0].split()]
        assert got == pytest.approx(ref, abs=1.5e-3), (task, got, ref)
        assert max(ref) > 0.01  # not trivially 0


def test_parse_modes_keeps_the_longest_sweep():
    """analysis.evaluate.parse_modes: 'Several sweeps: the longest (it reports every shorter one)' (docstring),
    whatever their order. Kills: the last sweep given wins."""
    from analysis.evaluate import parse_modes

    assert parse_modes("std,fused-1..4,fused-1..2") == (["std"], 4)
    assert parse_modes("fused-1..2,fused-1..5,std") == (["std"], 5)


def test_evaluate_mean_tokens_is_the_mean_prompt_length(tok):
    """analysis.evaluate: a row's mean_tokens is the mean token count of the cell's prompts, counted here by hand
    on multi_register (writes 2, 4, 8: three prompt lengths). Kills: the longest prompt's length reported."""
    from analysis.evaluate import EVAL_SEED, evaluate
    from tasks import make_dataset, tokenize_samples

    model = _model(tok, 0)
    row, = evaluate(model, tok, ["multi_register"], [2], ["std"], 0, 3, progress=False)
    seqs, _ = tokenize_samples(make_dataset("multi_register", 3, 2, seed=EVAL_SEED), tok)
    lengths = [len(s) for s in seqs]
    assert len(set(lengths)) == 3
    assert row["mean_tokens"] == pytest.approx(sum(lengths) / len(lengths))


def test_evaluate_refuses_a_prompt_one_token_past_the_context_before_any_forward(tok, monkeypatch):
    """analysis.evaluate.evaluate refuses a prompt longer than the model's context (max_position_embeddings) before
    the first forward (of any N), and runs one that fits exactly. Kills: the early refusal only from context + 2
    tokens on (the engine then refuses later, after the shorter N's forwards ran)."""
    import analysis.evaluate as ev
    from common.errors import UserError
    from tasks import make_dataset, tokenize_samples

    seqs, _ = tokenize_samples(make_dataset("memory", 2, 2, seed=ev.EVAL_SEED), tok)
    longest = max(map(len, seqs))
    real_prefill = ev.prefill_many
    for ctx, refused in ((longest - 1, True), (longest, False)):
        model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=1, d_model=16, n_heads=2, n_kv_heads=1,
                                                         max_len=ctx), seed=0).eval()
        if refused:
            def no_forward(*a, **k):
                raise AssertionError("a forward ran before the refusal")
            monkeypatch.setattr(ev, "prefill_many", no_forward)
            with pytest.raises(UserError, match="longer than the model's context"):
                ev.evaluate(model, tok, ["memory"], [0, 2], ["std"], 0, 2, progress=False)
        else:
            monkeypatch.setattr(ev, "prefill_many", real_prefill)
            assert [r["n_samples"] for r in ev.evaluate(model, tok, ["memory"], [0, 2], ["std"], 0, 2,
                                                        progress=False)] == [4, 4]


def test_adaptive_loop_rows_report_the_mean_and_max_iterations(tok):
    """analysis.evaluate with loop-R:TOL (adaptive exit, iterations vary per prompt): mean_iterations and
    max_iterations are the mean and the maximum of the per-prompt iterations, taken here from the engine
    (engine.prefill.prefill_many) prompt by prompt. Kills: min reported as max_iterations."""
    from transformers import AutoModelForCausalLM

    from analysis.evaluate import EVAL_SEED, evaluate
    from engine.prefill import pad_left, prefill_many
    from models.looped import LoopedLM, LoopSpec
    from tasks import make_dataset, tokenize_samples

    torch.manual_seed(0)
    cfg = qwen3_config(len(tok.get_vocab()), n_layers=4, d_model=32, n_heads=2, n_kv_heads=1)
    model = LoopedLM(AutoModelForCausalLM.from_config(cfg), LoopSpec(1, 2, 1, 3)).eval()
    row, = evaluate(model, tok, ["multi_register"], [2], ["loop-8:0.5"], 0, 4, batch_size=3, progress=False)
    seqs, _ = tokenize_samples(make_dataset("multi_register", 4, 2, seed=EVAL_SEED), tok)
    its = []
    for s in seqs:  # one prompt at a time
        ids, mask = pad_left([s], tok.pad_token_id)
        with torch.no_grad():
            its += prefill_many(model, ids, mask, ["loop-8:0.5"], collect=False)["loop-8:0.5"].iterations.tolist()
    assert min(its) != max(its)
    assert row["max_iterations"] == max(its)
    assert row["mean_iterations"] == pytest.approx(sum(its) / len(its))


def test_language_tasks_take_both_ends_of_their_n_range():
    """tasks.generators.make_dataset: a language task takes N in LANGUAGE_N_RANGE[task] = lo..hi, both ends
    included (its docstring: 'within LANGUAGE_N_RANGE'; ioi and binding N = 0 are default N values), and refuses
    lo - 1 and hi + 1. Kills: the lower bound made exclusive."""
    from common.errors import UserError
    from tasks import make_dataset
    from tasks.language import LANGUAGE_DISTRACTORS, LANGUAGE_N_RANGE

    assert 0 in LANGUAGE_DISTRACTORS["ioi"] and LANGUAGE_N_RANGE["ioi"][0] == 0
    for task, (lo, hi) in LANGUAGE_N_RANGE.items():
        for n in (lo, hi):
            samples = make_dataset(task, 2, n, seed=0)
            assert len(samples) == 4 and all(s.n_distractors == n for s in samples)
        for n in (lo - 1, hi + 1):
            if n >= 0:
                with pytest.raises(UserError):
                    make_dataset(task, 2, n, seed=0)


# ----- analysis.length_curves ----------------------------------------------------------------------------------
def test_length_figure_error_bars_and_chance_lines_follow_the_rows():
    """analysis.length_curves.length_figure: an N = 0 point's error bar runs from ci_low up to ci_high (an
    asymmetric Wilson interval here: up = ci_high - accuracy, down = accuracy - ci_low), and each panel's dotted
    chance line sits at 1/K of its task (shell_game 1/3, parity 1/2). Kills: the two arms of the error bar swapped;
    the chance line drawn at 0.5 whatever the task."""
    from analysis.length_curves import length_figure

    rows = [{"task": "shell_game", "n_distractors": 0, "mode": "std", "accuracy": 0.9, "n_samples": 20,
             "ci_low": 0.7, "ci_high": 0.97},
            {"task": "shell_game", "n_distractors": 8, "mode": "std", "accuracy": 0.5, "n_samples": 20,
             "ci_low": 0.3, "ci_high": 0.7},
            {"task": "parity", "n_distractors": 8, "mode": "std", "accuracy": 0.6, "n_samples": 20,
             "ci_low": 0.4, "ci_high": 0.8}]
    fig = length_figure([("m", rows)], modes=("std",))
    zero, = [t for t in fig.data if t.mode == "markers"]
    assert list(zero.y) == [0.9]
    assert list(zero.error_y.array) == pytest.approx([0.07]) and list(zero.error_y.arrayminus) == pytest.approx([0.2])
    chance = {}
    for sh in fig.layout.shapes:
        if sh.y0 == sh.y1:  # the horizontal chance lines
            chance[sh.xref.split()[0]] = sh.y0  # "x domain": panel 1 (shell_game), "x2 domain": panel 2
    assert sorted(chance.values()) == pytest.approx([1 / 3, 1 / 2])
    assert chance["x"] == pytest.approx(1 / 3) and chance["x2"] == pytest.approx(1 / 2)


# ----- analysis.where_state ------------------------------------------------------------------------------------
def test_where_state_lens_trace_is_the_rows_lens_accuracy(tmp_path):
    """analysis.where_state.where_figure: the 'logit lens on s_i' trace plots each iteration row's lens_accuracy
    (module doc: '... and the logit lens on s_i'), here different from every swap rate. Kills: the trace drawn
    from the swap-at-T rate."""
    from test_where_state import _docs

    from analysis.where_state import where_figure

    probes, loop, fb = (json.loads(open(p).read()) for p in _docs(tmp_path))
    for i, r in enumerate(loop["results"]["loop_iterations"]["rows"]):
        r["lens_accuracy"] = 0.95 - 0.15 * i
    fig = where_figure(probes, loop, [fb])
    lens, = [t for t in fig.data if t.name and "logit lens" in t.name]
    assert list(lens.x) == [0, 1, 2, 3, 4]
    assert list(lens.y) == pytest.approx([0.95, 0.8, 0.65, 0.5, 0.35])


# ----- tasks.custom --------------------------------------------------------------------------------------------
def test_validate_samples_refuses_a_running_value_equal_to_k():
    """tasks.custom.validate_samples: `running` holds labels in 0..K-1 (docstring); a value K (one past the last
    label word) is refused, and so is a diff_line = len(running). Kills: the running check accepting v <= K; the
    diff_line check accepting diff_line == len(running)."""
    from common.errors import UserError
    from tasks import Sample
    from tasks.custom import validate_samples

    ok = [Sample("t", "a b", 0, 0, 0, 1, running=(1, 0), diff_line=0),
          Sample("t", "a c", 1, 0, 0, 1, running=(0, 1), diff_line=0)]
    assert len(validate_samples(ok, ("x", "y"), "f")) == 2
    bad = [ok[0], Sample("t", "a c", 1, 0, 0, 1, running=(0, 2), diff_line=0)]
    with pytest.raises(UserError, match="running"):
        validate_samples(bad, ("x", "y"), "f")
    # diff_line indexes running (docstring): diff_line = len(running) is past its end
    bad = [ok[0], Sample("t", "a c", 1, 0, 0, 1, running=(0, 1), diff_line=2)]
    with pytest.raises(UserError, match="diff_line"):
        validate_samples(bad, ("x", "y"), "f")


def test_where_state_reads_an_unnamed_loops_r_from_its_deepest_causal_row():
    """analysis.where_state.probe_setting: where --causal's loop mode names no r (a mode this version cannot
    parse, no `iterations`), the loop's r is the deepest iteration its rows hold, and the probe grid drawn is the
    one with as many iterations. Mutant killed: the fallback r taken as the shallowest row (min), which picked no
    grid and refused a valid pair of files."""
    from analysis.where_state import probe_setting

    def core(mode, it):
        return {"mode": mode, "n_distractors": 8, "writes": None, "loop": {"part": "core", "iteration": it}}

    probes = {"results": [core("loop-2", i) for i in (1, 2)] + [core("loop-4", i) for i in (1, 2, 3, 4)]}
    rate = {"follows_donor_rate": 0.5, "follows_donor_rate_ci": None}
    causal = {"config": {"distractors": 8}, "results": {"loop_iterations": {
        "mode": "loop-from-the-future", "rows": [{"iteration": i, "swap_T": rate, "swap_all_positions": rate,
                                                  "lens_accuracy": 0.5} for i in (1, 2, 3, 4)]}}}
    assert probe_setting(probes, causal) == ("loop-4", 8)
    causal["results"]["loop_iterations"]["rows"] = causal["results"]["loop_iterations"]["rows"][:2]
    assert probe_setting(probes, causal) == ("loop-2", 8)
