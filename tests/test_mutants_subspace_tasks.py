"""Mutation-testing gaps in interventions/{subspace,batch,erasure}, tasks/{samples,custom} and training/card: each
test checks behaviour against a hand-written reference or an invariant taken from the documented definitions
(docstrings, docs/), and names in its docstring the mutant it was written to kill (a one-line change of the code
that the rest of the suite let pass)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.errors import UserError


# ---------------------------------------------------------------------------------------------------- training.card

def _row(mode, acc, task="memory", n=8, n_samples=200):
    return {"task": task, "n_distractors": n, "mode": mode, "accuracy": acc, "n_samples": n_samples}


_TC = {"steps": 60, "lr": 1e-3, "warmup": 1, "weight_decay": 0.0, "seed": 0, "tasks": ["memory"],
       "distractors": [8], "batch_tokens": 64, "schedule": "1", "targets": "labels", "depth_scale": False}


def _card_of(log, ev):
    """write_card's text for a training log and an eval.json (dicts), the checkpoint's readers stubbed."""
    import pathlib
    import tempfile
    from unittest import mock

    import training.card as card

    cfg = {"base_config": {"model_type": "qwen3"}, "format": "fbt", "format_version": 1,
           "fusion": {"enabled": True}}
    with tempfile.TemporaryDirectory() as d, \
            mock.patch.object(card.FullBandwidthLM, "read_config", return_value=cfg), \
            mock.patch.object(card, "read_log", return_value=log), \
            mock.patch.object(card, "read_eval", return_value=ev), \
            mock.patch.object(card, "_n_params", return_value=10):
        return card.write_card(pathlib.Path(d), "cmd")


def test_a_lone_fused_1_is_no_sweep():
    """fused_sweep gives [1..K] only for a sweep with K >= 2 (docstring): fused-1 alone is one mode, shown in its own
    column, with no "min fused-1..1" column. Mutant killed: `len(ks) >= 2` -> `len(ks) >= 1`."""
    from training.card import eval_table, fused_sweep

    rows = [_row("std", 1.0), _row("fused-1", 0.5)]
    assert fused_sweep(rows) == []
    assert "min fused" not in eval_table(rows, ["std", "fused-1"])


@pytest.mark.parametrize("sweep", [False, True])
def test_the_table_separator_has_one_cell_per_column(sweep):
    """eval_table is a markdown table: its separator row has as many cells as the header (task, N, each mode, and the
    min-over-the-sweep column where there is a sweep); a short separator breaks the table's rendering. Mutant killed:
    the separator's `+ bool(sweep)` dropped."""
    from training.card import eval_table

    rows = [_row("std", 1.0)] + ([_row(f"fused-{k}", 0.5) for k in (1, 2)] if sweep else [])
    lines = eval_table(rows, ["std", "fused-1"] if sweep else ["std"]).splitlines()
    n_cells = lambda line: line.strip().strip("|").count("|") + 1  # noqa: E731
    assert n_cells(lines[1]) == n_cells(lines[0]) == n_cells(lines[2]) == (5 if sweep else 3)
    assert set(lines[1]) == {"|", "-"}


def test_a_log_without_packing_is_read_as_packed():
    """A recipe's packing defaults to True (training.config.TrainConfig: --no-packing turns it off), so a logged
    recipe without the field trained on packed rows. Mutant killed: `tc.get("packing", True)` -> `False`."""
    from training.card import _layout

    assert _layout({"seq_len": 512}).startswith("packed rows of 512 tokens")
    assert _layout({"seq_len": 512, "packing": False}).startswith("one sample per row")


def test_sliding_attention_in_some_layers_is_counted():
    """_attention names "every layer" only where every layer is sliding, else "n of L layers". Mutant killed: "every
    layer" whenever any layer is sliding."""
    from training.card import _attention

    two_of_four = {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 16}
    assert _attention(two_of_four) == "; sliding-window attention (16 tokens) in 2 of 4 layers"
    every = {"layer_types": ["sliding_attention"] * 3, "sliding_window": 16}
    assert _attention(every) == "; sliding-window attention (16 tokens) in every layer"
    assert _attention({"layer_types": ["full_attention"] * 2}) == ""


def test_a_looped_cards_iteration_bound_is_twice_r():
    """A looped model draws each step's r as 1 + Poisson(r - 1), at most 2 r for r > 1 (training.config.
    most_loop_iterations; r = 1 in tests/test_looped.py). Mutant killed: the card printing r itself as the bound."""
    from training.card import _objective

    tc = dict(schedule="1", targets="labels", depth_scale=False, loop_iterations=4)
    text = " ".join(_objective(tc, {"core": 2}))
    assert "loop iterations per step 1 + Poisson(3), at most 8" in text


def test_the_final_loss_is_the_mean_of_the_last_50_steps():
    """The card's final training loss is the mean over the last 50 logged steps (the line says so). With 60 steps
    whose losses are 0..59 that mean is (10 + ... + 59) / 50 = 34.5. Mutant killed: `hist[-50:]` -> `hist[-49:]`."""
    hist = [{"loss": float(i)} for i in range(60)]
    last = hist[-50:]
    assert len(last) == 50 and sum(h["loss"] for h in last) / len(last) == 34.5  # the reference, by hand
    text = _card_of({"config": _TC, "history": hist}, None)
    assert "- final training loss (mean of last 50 steps): 34.5000" in text


def test_an_eval_with_no_rows_is_refused(tmp_path):
    """read_eval: results must be a NON-EMPTY list of rows (as analysis.evaluate writes them); an empty list gave a
    card whose accuracy table has a header and no row. Mutant killed: the `not rows` check dropped."""
    from training.card import read_eval

    (tmp_path / "eval.json").write_text(json.dumps({"results": [], "meta": {"seed": 1, "n_pairs": 10}}))
    with pytest.raises(UserError, match="results must be a non-empty list"):
        read_eval(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"results": [_row("std", 1.0)], "meta": {"seed": 1}}))
    assert read_eval(tmp_path)["results"][0]["mode"] == "std"


def test_cell_sizes_span_the_smallest_to_the_largest():
    """_cell_sizes: "100" where every cell has 100 samples, else "min-max" (docstring: "20-100" where they differ),
    whatever the sizes between. Mutant killed: the upper end taken as the second-smallest size."""
    from training.card import _cell_sizes

    assert _cell_sizes([_row("std", 1.0, n_samples=100)] * 2) == "100"
    rows = [_row("std", 1.0, n=n, n_samples=s) for n, s in ((0, 50), (8, 20), (32, 100))]
    assert _cell_sizes(rows) == "20-100"


def test_a_sweep_keeps_fused_1_and_folds_the_rest_into_their_minimum():
    """The card's table shows fused-1 in its own column ("fused = fused-1") and fused-2..K of a sweep only as the
    "min fused-1..K" column. Mutant killed: `if k > 1` -> `if k >= 1` (fused-1's column dropped too)."""
    rows = [_row("standard", 0.9), _row("fused-1", 0.8), _row("fused-2", 0.7), _row("fused-3", 0.75)]
    text = _card_of({}, {"results": rows, "meta": {"seed": 1, "n_pairs": 100}})
    assert "| task | N | standard | fused-1 | min fused-1..3 |" in text
    assert "| memory | 8 | 0.900 | 0.800 | 0.700 |" in text


def test_own_notes_stop_at_the_next_section(tmp_path):
    """own_notes returns the card's Notes section: the text after '## Notes' up to the next '## ' heading (a
    section added below it by hand is not part of the notes, which write_card would otherwise copy in). Mutant
    killed: the split at the next heading dropped."""
    from training.card import own_notes

    card = tmp_path / "MODEL_CARD.md"
    card.write_text("# m\n\n## Training\n\n- x\n\n## Notes\n\nkeep this\n\n## Later\n\nnot notes\n")
    assert own_notes(card) == "keep this"
    card.write_text("# m\n\n## Notes\n\nlast section\n")
    assert own_notes(card) == "last section"
    assert own_notes(tmp_path / "none.md") == ""


def test_dense_targets_name_every_column_only_under_dense_every():
    """Dense targets are the running value at the end of every update line, "and every column between" only under
    dense_every (training.config). Mutant killed: that clause keyed on dense_targets instead of dense_every."""
    from training.card import _objective

    tc = dict(schedule="1", objective="recurrent", depth_scale=False, dense_targets=True)
    assert "every column between" not in " ".join(_objective(tc, None))
    assert "every column between" in " ".join(_objective(dict(tc, dense_every=True), None))


def test_an_eval_row_without_its_sample_count_is_refused(tmp_path):
    """read_eval: every row needs task, n_distractors, mode, n_samples and accuracy (error text); a row without
    n_samples passed and the card then died with a KeyError traceback in _cell_sizes. Mutant killed: the n_samples
    check of _row_ok dropped."""
    from training.card import read_eval

    row = _row("std", 1.0)
    del row["n_samples"]
    (tmp_path / "eval.json").write_text(json.dumps({"results": [row], "meta": {"seed": 1}}))
    with pytest.raises(UserError, match="n_samples and accuracy"):
        read_eval(tmp_path)


@pytest.mark.parametrize("tasks, flag", [(("completion", "memory", "multi_register"), None),
                                         (("completion", "memory"), "--tasks completion,memory"),
                                         (("parity",), "--tasks parity")])
def test_the_cards_eval_command_names_tasks_only_off_the_default(tasks, flag):
    """The card's evaluate command adds --tasks only where the eval's tasks are not analysis.evaluate's default
    (completion, memory, multi_register). Mutant killed: the default compared as ["completion", "memory"]."""
    rows = [_row("standard", 1.0, task=t) for t in tasks]
    line = next(x for x in _card_of({}, {"results": rows, "meta": {"seed": 1, "n_pairs": 100}}).splitlines()
                if x.startswith("`python -m analysis.evaluate"))
    assert ("--tasks" not in line) if flag is None else (flag + " " in line)



# ---------------------------------------------------------------------------------------- interventions.subspace

def _planted(n_pairs=20, D=4, seed=0, scale=4.0):
    """Rows of two classes separated along axis 0 (unit noise elsewhere), one group per pair."""
    rng = np.random.default_rng(seed)
    y = np.tile([0, 1], n_pairs)
    groups = np.repeat(np.arange(n_pairs), 2)
    H = rng.normal(size=(2 * n_pairs, D))
    H[:, 0] += scale * (2 * y - 1)
    return torch.tensor(H, dtype=torch.float64), y, groups


def test_the_subspace_rank_may_be_the_whole_width():
    """fold_subspaces takes a rank in 1..D (its refusal says so): rank D is allowed (the whole state), 0 and D + 1
    are not. Mutant killed: the upper bound made exclusive (rank D refused)."""
    from interventions.subspace import fold_subspaces

    H, y, groups = _planted(D=3)
    assert all(f.U.shape[0] == 3 and 1 <= f.U.shape[1] <= 3 for f in fold_subspaces(H, y, groups, rank=3))
    for bad in (0, 4):
        with pytest.raises(UserError, match=r"subspace rank must be in 1\.\.3"):
            fold_subspaces(H, y, groups, rank=bad)


def test_fit_mask_rows_are_neither_fitted_nor_scored_but_still_patched():
    """fold_subspaces with fit_mask: the probe is fitted on the training rows where the mask holds and its accuracy
    is that on the masked-in test rows, so what the masked-out rows ("padding") hold changes neither the subspaces
    nor the accuracies; yet every row is still held out by exactly one fold (FoldSubspace.test: all of its held-out
    rows) and so gets patched. Two fills of the masked rows (a perfect label rule on an axis the real rows leave at
    0; the opposite of the real rule, large) must give the same folds. Mutants killed: the training rows not
    masked; the scored rows not masked; FoldSubspace.test set to the masked-in test rows only."""
    from interventions.subspace import fold_subspaces

    H, y, groups = _planted(n_pairs=30, D=3, scale=1.5)
    H[:, 2] = 0.0
    mask = np.ones(len(y), dtype=bool)
    mask[::3] = False  # one row in three is "padding"
    sign = torch.tensor(2.0 * y[~mask] - 1)
    runs = []
    for fill in (2, 0):  # the masked rows: +-5 along axis 2, or -50 x the real rule along axis 0
        Hm = H.clone()
        Hm[~mask] = 0.0
        Hm[~mask, fill] = 5.0 * sign if fill == 2 else -50.0 * sign
        runs.append(fold_subspaces(Hm, y, groups, rank=1, fit_mask=mask))
    for a, b in zip(*runs):
        assert np.array_equal(a.test, b.test) and a.probe_accuracy == b.probe_accuracy
        torch.testing.assert_close(a.U, b.U)
        assert float(a.U[2, 0]) == 0.0  # the axis only masked rows use carries nothing
    assert sorted(np.concatenate([f.test for f in runs[0]]).tolist()) == list(range(len(y)))


def test_probe_accuracy_is_the_first_probes():
    """FoldSubspace.probe_accuracy is the held-out accuracy of the FIRST probe on the fold: a rank-2 subspace has
    the same accuracy as the rank-1 one on the same folds (the second probe, fitted with the label direction
    projected out, is at chance here). Mutant killed: the accuracy taken from the last probe."""
    from interventions.subspace import fold_subspaces

    H, y, groups = _planted(n_pairs=30, D=4)
    one, two = fold_subspaces(H, y, groups, rank=1), fold_subspaces(H, y, groups, rank=2)
    assert [f.probe_accuracy for f in two] == [f.probe_accuracy for f in one]
    assert min(f.probe_accuracy for f in two) > 0.9


@pytest.mark.filterwarnings("ignore:The least populated class")  # the point: a class too small for the folds
def test_a_training_fold_with_one_class_is_refused():
    """A training fold that holds a single class has no probe to fit: one UserError line ("too few groups per
    label"), not a solver's ValueError. Label 1 lives in one group only, so the fold holding that group out trains
    on label 0 alone. Mutant killed: the single-class check `< 2` -> `< 1`."""
    from interventions.subspace import fold_subspaces

    y = np.array([0, 1] * 2 + [0, 0] * 10)
    groups = np.array([0, 0, 0, 0] + list(np.repeat(np.arange(1, 11), 2)))
    H = torch.tensor(np.random.default_rng(0).normal(size=(len(y), 3)))
    with pytest.raises(UserError, match="a training fold has a single class"):
        fold_subspaces(H, y, groups, rank=1)


def test_a_constant_multiclass_state_has_no_direction():
    """K > 2: the direction is the top singular vector of the class-centred weights; a state that is constant
    gives all-zero weights and so no direction: NoDirection (not an arbitrary unit vector from the SVD of zeros).
    Mutant killed: the all-zero-weights guard of _probe_direction dropped."""
    from interventions.subspace import NoDirection, fold_subspaces

    y = np.arange(60) % 3
    groups = np.arange(60) // 3
    H = torch.ones(60, 4, dtype=torch.float64)
    with pytest.raises(NoDirection):
        fold_subspaces(H, y, groups, rank=1)


def test_class_means_drop_a_degenerate_difference():
    """class_mean_subspaces: the span of the training rows' class-mean differences, orthonormalized, a degenerate
    difference dropped. Class means 0, v, 2 v (collinear) span ONE direction, v / |v|. Mutant killed: the
    degenerate QR column kept (a second column with no meaning)."""
    from interventions.subspace import FoldSubspace, class_mean_subspaces

    v = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64)
    y = np.arange(12) % 3
    H = torch.tensor(y, dtype=torch.float64)[:, None] * v
    (f,) = class_mean_subspaces(H, y, [FoldSubspace(np.array([0, 1, 2]), torch.zeros(3, 1), 1.0)])
    assert f.U.shape == (3, 1)
    torch.testing.assert_close(f.U[:, 0].abs(), v / 5)


def test_the_random_baseline_has_each_folds_rank():
    """per_fold_states with random_rank_seed: each fold gets a random subspace "of equal rank" (docstring). A fold of
    rank 2, three held-out rows with independent deltas: their steps span 2 dimensions (rank 1 would span one).
    Mutant killed: the random bases drawn at rank 1."""
    from interventions.subspace import FoldSubspace, per_fold_states

    g = torch.Generator().manual_seed(0)
    own, donor = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    U = torch.linalg.qr(torch.randn(6, 2, generator=g))[0]
    step = per_fold_states(own, donor, [FoldSubspace(np.arange(3), U, 1.0)], "subspace", random_rank_seed=5) - own
    sv = torch.linalg.svdvals(step)
    assert sv[1] > 1e-3 * sv[0] and sv[2] < 1e-5 * sv[0]


def test_energy_fraction_of_no_swap_is_nan():
    """energy_fraction is num / den with den = sum of |donor - own|^2; with no difference at all there is no share
    to report: nan (not a ZeroDivisionError). Mutant killed: `den > 0` -> `den >= 0`."""
    from interventions.subspace import FoldSubspace, energy_fraction

    own = torch.randn(4, 3)
    f = FoldSubspace(np.arange(4), torch.eye(3)[:, :1], 1.0)
    assert np.isnan(energy_fraction(own, own.clone(), [f]))


# ------------------------------------------------------------------------------------------- interventions.batch

def _batch(**over):
    """A valid 4-row Batch, pairs (0, 1) and (2, 3), T = 4; keyword arguments replace its fields."""
    from interventions.batch import Batch

    kw = dict(input_ids=torch.tensor([[0, 5, 6, 7], [0, 5, 8, 7], [0, 5, 6, 7], [0, 5, 6, 7]]),
              attention_mask=torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]),
              labels=torch.tensor([0, 1, 1, 0]), pair=torch.tensor([1, 0, 3, 2]), groups=np.array([0, 0, 1, 1]),
              label_ids=(11, 12))
    kw.update(over)
    return Batch(**kw)


def test_first_diff_by_hand_padding_counts_as_a_difference():
    """first_diff: per row, the offset from the end (-1 = T) of the first column where the row and its pair differ,
    "token or padding". Rows 0/1 differ first at column 2 of 4 (offset -2); rows 2/3 have the same tokens (the pad
    id 0 is also a real token in row 3) and differ only in the mask at column 0 (offset -4). Mutant killed: the
    mask term of the difference dropped."""
    assert _batch().first_diff.tolist() == [-2, -2, -4, -4]


def test_first_diff_of_identical_rows_is_past_T():
    """Where a row and its pair are the same input, no column differs: the states entering the fusion at every
    column up to T are identical, so first_diff must not name T (-1) or any column; it is 0, one past T. Mutant
    killed: the no-difference value T -> T - 1 (first_diff -1, "T differs")."""
    same = torch.tensor([[4, 5, 6, 7]] * 4)
    b = _batch(input_ids=same, attention_mask=torch.ones(4, 4, dtype=torch.long))
    assert b.first_diff.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("over, match", [
    (dict(input_ids=torch.tensor([[7], [7], [7], [7]]), attention_mask=torch.ones(4, 1, dtype=torch.long)),
     "at least 2 samples of at least 2 tokens"),
    (dict(labels=torch.tensor([0, 2, 2, 0])), r"labels must be in 0\.\.1"),
    (dict(labels=torch.tensor([-1, 1, 1, -1])), r"labels must be in 0\.\.1"),
    (dict(pair=torch.tensor([1, 0, 4, 2])), "pair indices out of range"),
    (dict(label_ids=(11, 11)), "at least two distinct token ids"),
    (dict(probe_labels=torch.tensor([1, 1, 1, 1])), "probe_labels need one entry per row and at least 2 classes"),
    (dict(diff_line=np.array([0, 0, 1])), "diff_line needs one entry per row"),
    (dict(line_index=np.zeros((4, 3))), "line_index needs one entry per column of every row"),
])
def test_batch_refuses_each_bad_field_in_one_line(over, match):
    """Batch's checks (its field comments and messages): T >= 2 (T-1 and T), labels in 0..K-1, pair indices in
    0..B-1, K distinct label ids, probe labels with 2 classes, diff_line [B], line_index [B, T]; each bad field is
    one UserError naming it (not an IndexError later). Mutants killed: `T < 2` -> `T < 1`, `labels >= K` ->
    `labels > K`, the `labels < 0` check dropped, `pair >= B` -> `pair > B`, the distinct-label-ids check dropped,
    `< 2` probe classes -> `< 1`, and the diff_line / line_index shape checks dropped."""
    _batch()  # the unchanged batch is valid
    with pytest.raises(UserError, match=match):
        _batch(**over)


# ------------------------------------------------------------------------------------------------- tasks.samples

def _s(label, pair, group, text=None, task="shell_game", n=1):
    from tasks.samples import Sample

    return Sample(task=task, text=text or f"p{pair} l{label} :", label=label, pair_id=pair, group_id=group,
                  n_distractors=n)


def test_a_three_class_task_is_never_relabelled_by_pair_role():
    """probe_labels falls back to the pair roles only for a task with MORE than 3 answer classes (docstring); a
    3-class task (shell_game) whose labels fall in too few groups is refused, not silently probed for its pair
    order. Six pairs, one group each: label 2 lies in 2 groups (< 5 folds). Mutant killed: `len(set(y)) <= 3` ->
    `< 3`."""
    from tasks.samples import probe_labels

    labels = [(0, 1), (1, 0), (0, 1), (1, 0), (0, 2), (2, 0)]
    ds = [_s(lab, p, p) for p, ab in enumerate(labels) for lab in ab]
    with pytest.raises(UserError, match="too few groups"):
        probe_labels(ds, 5)
    # the same layout with 4 classes is relabelled: roles 0/1 in 6 groups each
    four = [(0, 1), (1, 0), (0, 3), (3, 0), (0, 2), (2, 0)]
    ds4 = [_s(lab, p, p) for p, ab in enumerate(four) for lab in ab]
    assert probe_labels(ds4, 5) == ([0, 1] * 6, "the pair role (tasks.pair_roles)")



def test_probe_target_of_a_users_task_refuses_unscorable_labels():
    """probe_target with roles_allowed=False (a user's task): never the roles, "and a dataset whose labels cannot be
    scored is refused" (docstring), whichever N it is. Mutant killed: the per-dataset check skipped (False
    returned for any data)."""
    from tasks.samples import probe_target

    good = [_s(lab, p, p, task="t") for p in range(6) for lab in ((0, 1) if p % 2 else (1, 0))]
    few = [_s(lab, p, p % 2, task="t") for p in range(6) for lab in ((0, 1) if p % 2 else (1, 0))]  # 2 groups
    assert probe_target([good], 5, roles_allowed=False) is False
    with pytest.raises(UserError, match="too few groups"):
        probe_target([good, few], 5, roles_allowed=False)


# -------------------------------------------------------------------------------------------------- tasks.custom

def _jsonl(path, header, rows, bom=False):
    path.write_text(("\ufeff" if bom else "") + "".join(json.dumps(r) + "\n" for r in [header, *rows]),
                    encoding="utf-8")
    return str(path)


def _pair_rows(pair, group=None, n=None, a=0, b=1, **extra):
    rows = [{"text": f"p{pair} = {lab}\nvalue:", "label": lab, "pair": pair,
             "group": pair if group is None else group, **extra} for lab in (a, b)]
    if n is not None:
        for r in rows:
            r["n_distractors"] = n
    return rows


def test_a_jsonl_file_takes_its_defaults_from_the_docs(tmp_path):
    """docs/tasks.md, JSONL format: `name` defaults to the file's STEM, `n_distractors` to 0, `answer_sep` to one
    space. Mutants killed: the name default path.name ("my_task.jsonl", which the name rule refuses), the N default
    1, the answer_sep default ""."""
    from tasks.custom import resolve_task

    src = resolve_task(_jsonl(tmp_path / "my_task.jsonl", {"label_words": ["A", "B"]}, _pair_rows(0) + _pair_rows(1)))
    assert src.name == "my_task" and src.default_distractors == (0,) and src.answer_sep == " "
    s = src.make(None, 0, 0)[0]
    assert s.task == "my_task" and s.n_distractors == 0 and s.full_text == "p0 = 0\nvalue: A"


def test_a_header_with_an_unknown_key_is_refused(tmp_path):
    """The header holds label_words and optionally name and answer_sep; unknown keys are refused (docs/tasks.md:
    "typos do not pass silently"). Mutant killed: the header's unknown-key check dropped."""
    from tasks.custom import resolve_task

    spec = _jsonl(tmp_path / "t.jsonl", {"label_words": ["A", "B"], "answer_seperator": ""}, _pair_rows(0))
    with pytest.raises(UserError, match="the first line must be the header"):
        resolve_task(spec)


def test_a_byte_order_mark_is_not_content(tmp_path):
    """A leading UTF-8 byte-order mark (some Windows editors) does not make the header unreadable. Mutant killed:
    decoding as "utf-8" instead of "utf-8-sig"."""
    from tasks.custom import resolve_task

    src = resolve_task(_jsonl(tmp_path / "bom.jsonl", {"label_words": ["A", "B"]}, _pair_rows(0), bom=True))
    assert src.label_words == ("A", "B") and len(src.make(None, 0, 0)) == 2


def test_n_pairs_keeps_the_first_pairs_in_file_order(tmp_path):
    """A file is used whole, or `--n-pairs k` keeps its FIRST k pairs per N (docs/tasks.md), in file order (pair
    ids are strings or ints, not sorted). Mutants killed: the pairs kept taken in another order than the file's,
    and k + 1 pairs kept."""
    from tasks.custom import resolve_task

    rows = _pair_rows("z") + _pair_rows("b") + _pair_rows("m") + _pair_rows(7, n=3) + _pair_rows(2, n=3)
    src = resolve_task(_jsonl(tmp_path / "t.jsonl", {"label_words": ["A", "B"]}, rows))
    assert [s.text for s in src.make(2, 0, 0)] == ["pz = 0\nvalue:", "pz = 1\nvalue:", "pb = 0\nvalue:",
                                                   "pb = 1\nvalue:"]
    assert [s.text for s in src.make(1, 3, 0)] == ["p7 = 0\nvalue:", "p7 = 1\nvalue:"]
    assert len(src.make(None, 0, 0)) == 6 and len(src.make(3, 0, 0)) == 6


def test_a_files_n_values_are_sorted(tmp_path):
    """default_distractors: the N values in the file, ascending whatever the line order (the CLIs' default N
    sweep and the first-N prompt label_token_ids checks). Mutant killed: the N values in file order."""
    from tasks.custom import resolve_task

    rows = _pair_rows(0, n=8) + _pair_rows(1, n=2) + _pair_rows(2, n=4)
    assert resolve_task(_jsonl(tmp_path / "t.jsonl", {"label_words": ["A", "B"]}, rows)).default_distractors == (2, 4, 8)


def test_a_bad_sample_is_named_by_its_file_line(tmp_path):
    """Errors on a sample name its line in the file (docs/tasks.md: "with the line number"; the header is line 1).
    The bad sample is the 4th line. Mutant killed: the line map shifted by one."""
    from tasks.custom import resolve_task

    rows = _pair_rows(0) + [{"text": "x :", "label": 0, "pair": 1, "group": 1, "running": [0, 7]},
                            {"text": "y :", "label": 1, "pair": 1, "group": 1}]
    with pytest.raises(UserError, match=r"t\.jsonl line 4: sample has running \[0, 7\]"):
        resolve_task(_jsonl(tmp_path / "t.jsonl", {"label_words": ["A", "B"]}, rows))


def test_running_from_a_file_is_a_tuple(tmp_path):
    """Sample is frozen and hashable; `running` is a tuple (a list would make it unhashable: validate_samples'
    comment). Mutant killed: the file's running list kept as a list."""
    from tasks.custom import resolve_task

    rows = _pair_rows(0, running=[0, 1], diff_line=1)
    s = resolve_task(_jsonl(tmp_path / "t.jsonl", {"label_words": ["A", "B"]}, rows)).make(None, 0, 0)[0]
    assert s.running == (0, 1) and hash(s) == hash(s)


@pytest.mark.parametrize("field, value, match", [
    ("diff_line", 2, "diff_line 2; must be an integer >= 0 below len\\(running\\)"),
    ("label", 2, "label 2; labels must be integers in 0..1"),
])
def test_validate_samples_bounds_are_exclusive(field, value, match):
    """validate_samples: labels in 0..K-1 and diff_line indexing `running` (so < len(running)); the value one past
    the end is refused. Mutants killed: `diff_line >= len(running)` -> `>`, `label < k` -> `<= k`."""
    import dataclasses

    from tasks.custom import validate_samples
    from tasks.samples import Sample

    a = Sample("t", "a :", 0, 0, 0, 1, running=(0, 1), diff_line=0)
    b = Sample("t", "b :", 1, 0, 0, 1, running=(1, 1), diff_line=0)
    validate_samples([a, b], ("A", "B"), "t")
    with pytest.raises(UserError, match=match):
        validate_samples([dataclasses.replace(a, **{field: value}), b], ("A", "B"), "t")


@pytest.mark.parametrize("sep, ok", [("", True), (" ", True), ("\n\t  ", True), ("     ", False), ("\n\n\n\n\n", False)])
def test_answer_sep_is_at_most_four_whitespace_characters(sep, ok):
    """answer_sep is "" or up to 4 whitespace characters (docs/tasks.md). Mutant killed: the bound 4 -> 5."""
    from tasks.custom import _check_answer_sep

    if ok:
        assert _check_answer_sep(sep, "t") == sep
    else:
        with pytest.raises(UserError, match="up to 4 whitespace characters"):
            _check_answer_sep(sep, "t")


def test_one_input_may_have_another_answer_at_another_n():
    """"One input, one answer" holds within one N: datasets are read one N at a time, so the same tokens at N = 1
    and N = 2 with two labels are two prompts of two runs, not a contradiction; within one N they are refused.
    Mutant killed: the key without N (the same input at two N with other labels wrongly refused)."""
    from tasks.custom import _check_one_answer_per_input

    ids = [5, 6, 7]
    _check_one_answer_per_input([ids, ids], [_s(0, 0, 0, n=1), _s(1, 1, 1, n=2)], "t")
    with pytest.raises(UserError, match="one prompt cannot have two answers"):
        _check_one_answer_per_input([ids, ids], [_s(0, 0, 0, n=1), _s(1, 1, 1, n=1)], "t")


def test_a_row_with_one_real_token_is_refused():
    """Batch needs "at least 2 real tokens (T-1 and T) per row": a row padded up to T leaves T-1 a pad column, where
    the T-1 patches and the recurrence's h_{T-1} would read padding. Mutant killed: only T's mask checked."""
    with pytest.raises(UserError, match="at least 2 real tokens"):
        _batch(attention_mask=torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]]))


def test_line_index_counts_the_real_newlines_before_each_column_by_hand():
    """Batch.line_index: per column, the real newlines before it (a newline column still belongs to the line it
    ends), -1 on padding. Hand reference: a walk over each row's decoded tokens. Rows of two lengths (N = 2 and
    N = 5), so the short ones are left-padded. Mutants killed: the count including the column's own newline;
    padding not marked -1. (Padding that decodes to a newline cannot arise: a prompt holding the padding token is
    refused by tasks.tokenizer.)"""
    from interventions.batch import Batch
    from tasks import build_tokenizer, make_dataset

    tok = build_tokenizer()
    from dataclasses import replace

    samples = make_dataset("parity", 3, 2, seed=0) + [replace(s, pair_id=s.pair_id + 1000)  # unique pair ids
                                                      for s in make_dataset("parity", 3, 5, seed=1)]
    b = Batch.from_samples(samples, tok, "parity")
    assert not bool(b.attention_mask.all())  # the case is there: padded rows
    for ids, mask, got in zip(b.input_ids.tolist(), b.attention_mask.tolist(), b.line_index.tolist()):
        want, seen = [], 0
        for i, m in zip(ids, mask):
            if not m:
                want.append(-1)
                continue
            want.append(seen)
            seen += tok.decode([i]) == "\n"
        assert got == want


def test_a_sample_without_its_pair_is_refused_by_name():
    """Batch.from_samples: "every sample needs its pair (same pair_id, different label) in the dataset"; a lone
    sample (its pair dropped) is told so, not as an index error. Mutant killed: only pair ids with more than 2
    members refused (a lone one then left with pair -1: "pair indices out of range")."""
    from interventions.batch import Batch
    from tasks import build_tokenizer, make_dataset

    samples = make_dataset("parity", 3, 2, seed=0)
    with pytest.raises(UserError, match="every sample needs its pair"):
        Batch.from_samples(samples[:-1], build_tokenizer(), "parity")


def test_diff_line_is_kept_only_when_every_sample_has_one():
    """A task file may give diff_line for some samples only (tasks.custom: optional per sample); the batch then
    has none (None) rather than an object array holding None. Mutant killed: None only when no sample has one."""
    from dataclasses import replace

    from interventions.batch import Batch
    from tasks import build_tokenizer, make_dataset

    samples = make_dataset("parity", 3, 2, seed=0)
    tok = build_tokenizer()
    full = Batch.from_samples(samples, tok, "parity")
    assert full.diff_line is not None and np.issubdtype(full.diff_line.dtype, np.integer)
    some = [replace(s, diff_line=None) if s.pair_id == samples[0].pair_id else s for s in samples]
    assert Batch.from_samples(some, tok, "parity").diff_line is None


def test_a_label_word_that_merges_with_the_prompts_end_is_refused(tmp_path):
    """A label word must be one token AFTER the prompt's own tokens: under a BPE that merges across the join, the
    prompt's last token changes and counting the extra tokens is not enough. Here ":" + "1" merge, so prompt +
    "12" tokenizes as [..., ":1", "2"], one token more than the prompt, yet "2" is not the word "12" after
    "value:". Mutant killed: the check that the prompt's tokens are a prefix of the joined text's dropped (the
    answer read as "2")."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tasks.custom import resolve_task

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789=:\n ")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[":1"] = len(vocab)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[(":", "1")])))
    header = {"label_words": ["12", "3"], "answer_sep": ""}
    src = resolve_task(_jsonl(tmp_path / "joined.jsonl", header, _pair_rows(0) + _pair_rows(1)))
    assert tok.convert_ids_to_tokens(tok("value:12")["input_ids"])[-2:] == [":1", "2"]  # the case is there
    with pytest.raises(UserError, match="label word '12' is not one token after the prompt"):
        src.label_token_ids(tok)
    ok = resolve_task(_jsonl(tmp_path / "plain.jsonl", {"label_words": ["2", "3"], "answer_sep": ""},
                             _pair_rows(0) + _pair_rows(1)))
    assert ok.label_token_ids(tok) == [vocab["2"], vocab["3"]]  # no merge at the join: one token each
