"""Bring-your-own tasks (tasks.custom.resolve_task): the JSONL format, module:function generators, their
one-line validation errors, and probes.run / analysis.evaluate on them (docs/tasks.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import UserError
from tasks import build_tokenizer, make_dataset, resolve_task

DATA = Path(__file__).resolve().parent / "data"
JSONL = DATA / "last_write.jsonl"
FUNC = "tests.data.custom_tasks:first_bit"


def test_builtin_specs_are_make_dataset():
    src = resolve_task("shell_game")
    assert src.builtin and src.label_words == ("A", "B", "C") and src.n_classes == 3 and src.min_distractors == 1
    assert src.make(6, 3, 5) == make_dataset("shell_game", 6, 3, seed=5)
    assert resolve_task("completion").min_distractors == 0
    tok = build_tokenizer()
    from tasks import label_token_ids

    assert src.label_token_ids(tok) == label_token_ids(tok, "shell_game")
    with pytest.raises(UserError, match="unknown task 'nope'"):
        resolve_task("nope")


def test_jsonl_fixture():
    src = resolve_task(str(JSONL))
    assert (src.form, src.name, src.label_words, src.default_distractors) == ("jsonl", "last_write", ("0", "1", "2"),
                                                                              (1, 2))
    assert src.fixed and len(src.sha256) == 64 and src.describe()["spec"] == str(JSONL)
    whole = src.make(None, 2, 0)
    assert len(whole) == 30 and {s.task for s in whole} == {"last_write"} and {s.n_distractors for s in whole} == {2}
    assert src.make(None, 2, 123) == whole  # fixed data: the seed is ignored
    first = src.make(4, 1, 0)
    assert len(first) == 8 and len({s.pair_id for s in first}) == 4
    assert first[0].text == "x = 1\nx = 0\nvalue:" and first[0].label == 0
    with pytest.raises(UserError, match="no samples with n_distractors = 3 .*has 1, 2"):
        src.make(None, 3, 0)
    tok = build_tokenizer()
    ids, samples = src.tokenize(whole, tok)
    assert len(ids) == 30 and samples[0].n_tokens == len(ids[0])
    assert src.label_token_ids(tok) == [tok.convert_tokens_to_ids(w) for w in ("0", "1", "2")]


HEADER = {"label_words": ["0", "1"]}


def _sample(label, pair, group=None, text=None, **kw):
    # a pair's two prompts differ (the state line names the label): one text cannot have two answers
    text = f"state = {label}\n# final state:" if text is None else text
    return {"text": text, "label": label, "pair": pair, "group": pair if group is None else group, **kw}


@pytest.mark.parametrize("lines, msg", [
    ([], "is empty"),
    (["{not json"], "line 1: not valid JSON"),
    ([[1, 2]], "line 1: expected a JSON object"),
    ([_sample(0, 0)], "line 1: the first line must be the header"),
    ([{"label_words": ["0"]}], "at least 2 strings"),
    ([{"label_words": ["0", "0"]}], "are not all different"),
    ([{"label_words": ["0", "a b"]}], "without whitespace"),
    ([{"label_words": ["0", "1"], "name": "parity"}], "is a built-in task's"),
    ([HEADER], "has a header but no samples"),
    ([HEADER, _sample(0, 0), {"text": "x", "label": 1, "pair": 0}], "line 3: missing group"),
    ([HEADER, _sample(0, 0), _sample(1, 0, colour="red")], "line 3: unknown key(s) colour"),
    ([HEADER, _sample(0, 0), _sample(2, 0)], "line 3: sample has label 2; labels must be integers in 0..1"),
    ([HEADER, _sample(0, 0), _sample(True, 0)], "line 3: sample has label True"),
    ([HEADER, _sample(0, 0), _sample(1, 0), _sample(0, 1)], "pair 1 (N=0) has 1 member(s)"),
    ([HEADER, _sample(0, 0), _sample(0, 0)], "have the same label 0"),
    ([HEADER, _sample(0, 0, 1), _sample(1, 0, 2)], "are in different groups"),
    ([HEADER, _sample(0, 0, text="x"), _sample(1, 0, text="x")], "pair 0 (N=0) have the same text but different"),
    ([HEADER, _sample(0, 0, n_distractors=-1), _sample(1, 0)], "line 2: n_distractors must be an integer >= 0"),
    ([HEADER, _sample(0, 0, running=[0, 5]), _sample(1, 0)], "line 2: sample has running [0, 5]"),
    ([{"label_words": ["0", "1", "2"]}, _sample(0, 0), _sample(1, 0)], "label word(s) ['2'] never occur"),
])
def test_jsonl_errors_are_one_line(tmp_path, lines, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    with pytest.raises(UserError) as e:
        resolve_task(str(p))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_bad_spec():
    with pytest.raises(UserError, match="does not exist"):
        resolve_task("no/such/file.jsonl")
    with pytest.raises(UserError, match="unknown task"):
        resolve_task("not a spec")


def test_label_words_the_tokenizer_cannot_score(tmp_path):
    tok = build_tokenizer()
    for words, msg in ((["0", "0+"], "not one token after the prompt"), (["0", "zzz"], "unknown to tokenizer")):
        p = tmp_path / "w.jsonl"
        p.write_text("\n".join(json.dumps(x) for x in [{"label_words": words}, _sample(0, 0), _sample(1, 0)]))
        src = resolve_task(str(p))
        with pytest.raises(UserError, match=msg):
            src.label_token_ids(tok)


def test_the_padding_token_is_no_word(tmp_path):
    """[PAD] marks padding: a prompt holding it, or a label word that is it, is refused (fed as a token it would be
    read as a word, and scored)."""
    tok = build_tokenizer()
    p = tmp_path / "pad.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [{"label_words": ["[PAD]", "1"]}, _sample(0, 0), _sample(1, 0)]))
    with pytest.raises(UserError, match="label word '\\[PAD\\]' is the padding token"):
        resolve_task(str(p)).label_token_ids(tok)
    text = "state = 1\n[PAD]\n# final state:"
    p.write_text("\n".join(json.dumps(x) for x in [HEADER, _sample(0, 0, text=text), _sample(1, 0)]))
    src = resolve_task(str(p))
    with pytest.raises(UserError, match="holds the padding token '\\[PAD\\]'"):
        src.tokenize(src.make(None, 0, 0), tok)


def test_tokenizer_checks_name_the_task(tmp_path):
    tok = build_tokenizer()
    for a, b, msg in (("state = 1\nzzz:", "state = 0\nzzz:", "does not know every word"),
                      ("state = 1\nfinal:", "state = 0\nfinal", "same final token")):
        p = tmp_path / "t.jsonl"
        p.write_text("\n".join(json.dumps(x) for x in [HEADER, _sample(0, 0, text=a), _sample(1, 0, text=b)]))
        src = resolve_task(str(p))
        with pytest.raises(UserError, match=msg) as e:
            src.tokenize(src.make(None, 0, 0), tok)
        assert str(e.value).startswith(f"task {p}:")


def test_function_spec():
    src = resolve_task(FUNC)
    assert (src.form, src.name, src.label_words, src.default_distractors) == ("function", "first_bit", ("0", "1"),
                                                                              (2, 4))
    s = src.make(5, 2, 0)
    assert len(s) == 10 and s[0].task == "first_bit" and s == src.make(5, 2, 0)
    assert src.label_token_ids(build_tokenizer(), prompt=s[0].text) == [2, 3]


@pytest.mark.parametrize("spec, msg, at_make", [
    ("tests.data.no_such_module:f", "cannot import module 'tests.data.no_such_module'", False),
    ("tests.data.custom_tasks:nothing", "has no function 'nothing'", False),
    ("tests.data.custom_tasks:no_words", "needs a label_words attribute", False),
    ("tests.data.custom_tasks:crashes", "failed for n_pairs=3, N=2, seed=0: ValueError: boom", True),
    ("tests.data.custom_tasks:same_labels", "have the same label 0", True),
    ("tests.data.custom_tasks:wrong_n", "asked for N=2 and returned a sample with n_distractors=7", True),
    ("tests.data.custom_tasks:extra_pairs", "asked for 3 pairs (N=2) and returned 5", True),
    ("tests.data.custom_tasks:crashes_on_two_lines", "RuntimeError: boom", True),
])
def test_function_spec_errors(spec, msg, at_make):
    with pytest.raises(UserError) as e:
        resolve_task(spec).make(3, 2, 0)
    assert msg in str(e.value) and "\n" not in str(e.value)
    if at_make:
        resolve_task(spec)  # resolving alone is fine: the generator runs on make


# ----- CLIs ---------------------------------------------------------------------------------------------------


def test_probes_run_on_a_jsonl_file(tiny_ckpt, tmp_path):
    from probes.run import main

    out = tmp_path / "lw"
    assert main(["--task", str(JSONL), "--model", str(tiny_ckpt), "--out", str(out), "--modes", "standard,recurrent-1",
                 "--n-boot", "50", "--no-cache", "--no-progress"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    run = doc["meta"]["run"]
    assert run["task"] == "last_write" and run["distractors"] == [1, 2] and run["n_pairs"] is None
    assert run["task_source"]["kind"] == "jsonl" and run["task_source"]["label_words"] == ["0", "1", "2"]
    assert doc["meta"]["labels"]["chance"] == pytest.approx(1 / 3)
    assert [w for w in doc["meta"]["warnings"] if w["kind"] == "leakage"] == []
    assert doc["meta"]["datasets"]["1"]["n_samples"] == 30 and doc["meta"]["datasets"]["1"]["n_pairs"] == 15
    assert doc["meta"]["datasets"]["1"]["copies_across_groups"] == 30  # this file's 4-line prompts recur across groups
    assert {r["task"] for r in doc["results"]} == {"last_write"}
    std0 = [r for r in doc["results"] if r["mode"] == "standard" and r["depth"] == 0]
    assert all(r["ci_low"] <= 1 / 3 <= r["ci_high"] for r in std0)


def test_probes_run_on_a_function_and_errors(tiny_ckpt, tmp_path, capsys):
    from probes.run import main

    out = tmp_path / "fb"
    assert main(["--task", FUNC, "--model", str(tiny_ckpt), "--out", str(out), "--modes", "standard",
                 "--n-pairs", "10", "--n-boot", "50", "--no-cache", "--no-progress"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["run"]["distractors"] == [2, 4] and doc["meta"]["labels"]["words"] == ["0", "1"]
    assert doc["meta"]["run"]["task_source"]["spec"] == FUNC
    capsys.readouterr()  # the run's own lines (its short prompts recur across groups: a warning)
    for argv, msg in (
            (["--task", str(JSONL), "--distractors", "3"], "no samples with n_distractors = 3"),
            (["--task", str(JSONL), "--n-pairs", "5"], "last_write N=1 with --n-pairs 5: too few groups"),
            (["--task", "tests.data.custom_tasks:same_labels", "--distractors", "1"], "have the same label"),
            (["--task", "tests.data.custom_tasks:crashes", "--distractors", "1"], "ValueError: boom")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--model", str(tiny_ckpt), "--out", str(tmp_path / "x")])  # refused before loading
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()


def test_probes_run_refuses_unscorable_label_words(tiny_ckpt, tmp_path, capsys):
    from probes.run import main

    lines = JSONL.read_text().splitlines()
    lines[0] = json.dumps({"label_words": ["0", "1", "zzz"], "name": "lw2"})
    p = tmp_path / "lw2.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["--task", str(p), "--model", str(tiny_ckpt), "--out", str(tmp_path / "o"), "--no-cache",
              "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and "label word 'zzz' is unknown" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_evaluate_on_custom_tasks(tiny_ckpt, tmp_path):
    from analysis.evaluate import main

    out = tmp_path / "eval.json"
    main(["--model", str(tiny_ckpt), "--tasks", f"{JSONL},{FUNC}", "--modes", "std,soft", "--n-pairs", "4",
          "--out", str(out), "--no-progress"])
    doc = json.loads(out.read_text())
    cells = {(r["task"], r["n_distractors"], r["mode"]): r for r in doc["results"]}
    assert set(cells) == {(t, n, m) for t, ns in (("last_write", (1, 2)), ("first_bit", (2, 4))) for n in ns
                          for m in ("std", "soft")}
    assert all(r["n_samples"] == 8 and r["ci_low"] <= r["accuracy"] <= r["ci_high"] for r in cells.values())
    assert [t["name"] for t in doc["meta"]["custom_tasks"]] == ["last_write", "first_bit"]
    # without --n-pairs a JSONL file is used whole
    main(["--model", str(tiny_ckpt), "--tasks", str(JSONL), "--modes", "std", "--out", str(out), "--overwrite",
          "--no-progress"])
    doc = json.loads(out.read_text())
    assert {r["n_samples"] for r in doc["results"]} == {30}
    assert doc["meta"]["n_pairs"] is None and {d["n_pairs"] for d in doc["meta"]["datasets"]} == {15}


def test_interventions_run_on_a_jsonl_file(tiny_ckpt, tmp_path):
    """The same resolve_task serves interventions.run: a 3-class hand-written task, its K-class report."""
    from interventions.run import main

    out = tmp_path / "iv"
    assert main(["--task", str(JSONL), "--model", str(tiny_ckpt), "--distractors", "1", "--mode", "recurrent-1",
                 "--control-model", "none", "--out", str(out), "--no-progress"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["config"]["task_source"]["kind"] == "jsonl"
    assert rep["dataset"]["n_samples"] == 30
    swap = next(r for r in rep["results"]["interventions"] if r["name"] == "state_swap")
    assert swap["n"] == 30 and 0.0 <= swap["follows_donor_rate"] <= 1.0


def test_custom_samples_know_their_answer(tmp_path):
    """Sample.answer / full_text work for a custom task: the samples carry the task's label words."""
    from tasks.custom import resolve_task

    path = tmp_path / "mine.jsonl"
    rows = [{"label_words": ["red", "blue"], "name": "colours"}]
    rows += [{"text": f"item {i} is :", "label": i % 2, "pair": i // 2, "group": i // 4} for i in range(16)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    samples = resolve_task(str(path)).make(None, 0, 0)
    assert [s.answer for s in samples[:2]] == ["red", "blue"]
    assert samples[1].full_text == "item 1 is : blue"


def test_leakage_check_compares_with_what_a_probe_without_information_scores(tiny_ckpt, tmp_path):
    """The depth-0 leakage check's chance is the probe's own score on constant features: 1/K on balanced labels;
    on a 3-class file whose class 0 is in every pair it is class 0's share (0.5), where the balanced probe's tie
    lands, and a model without leakage is not flagged (1/3 was: a warning that called it a bug)."""
    import numpy as np

    from probes.run import _null_accuracy
    from stats.linear import ProbeConfig

    groups = np.repeat(np.arange(12), 2)
    assert _null_accuracy(np.tile([0, 1], 12), groups, ProbeConfig()) == 0.5
    assert _null_accuracy(np.array([0, 1, 1, 2, 2, 0] * 4), groups, ProbeConfig()) == pytest.approx(1 / 3)
    y = np.array([0, 1] * 6 + [0, 2] * 6)
    assert _null_accuracy(y, groups, ProbeConfig()) == 0.5

    lines = [{"label_words": ["0", "1", "2"], "name": "unbalanced"}]
    for p, (a, b) in enumerate([(0, 1)] * 8 + [(0, 2)] * 8):
        lines += [_sample(a, p), _sample(b, p)]
    path = tmp_path / "unbalanced.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    from probes.run import main

    out = tmp_path / "unbalanced"
    assert main(["--task", str(path), "--model", str(tiny_ckpt), "--out", str(out), "--modes", "standard",
                 "--n-boot", "50", "--no-cache", "--no-progress"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    std0 = [r for r in doc["results"] if r["mode"] == "standard" and r["depth"] == 0]
    assert std0 and all(r["accuracy"] == 0.5 for r in std0)  # the constant input's score: class 0's share
    assert [w for w in doc["meta"]["warnings"] if w["kind"] == "leakage"] == []  # (its texts recur: counted)


def test_leakage_check_trusts_an_estimate_equal_to_the_null(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """A percentile interval from few resamples can miss its own estimate (--n-boot 1 gave "0.350 (95% CI
    0.450..0.450) is not at chance (0.350)"): a depth-0 estimate equal to the no-information probe's is no leak,
    whatever its interval; 1..19 resamples are refused."""
    import stats.linear as linear
    from probes.run import main

    monkeypatch.setattr(linear, "percentile_ci", lambda r: (0.95, 0.95))  # an interval away from every estimate
    out = tmp_path / "o"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--modes", "standard",
                 "--n-pairs", "10", "--distractors", "0", "--n-boot", "20", "--no-cache", "--no-progress",
                 "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert [r["accuracy"] for r in doc["results"] if r["depth"] == 0] == [0.5]
    assert doc["meta"]["warnings"] == [] and "LEAKAGE" not in capsys.readouterr().err
    for argv in (["--n-boot", "19"], ["--n-boot", "1"]):
        with pytest.raises(SystemExit):
            main(["--task", "completion", *argv])
    from interventions.run import main as interventions

    with pytest.raises(SystemExit):
        interventions(["--task", "parity", "--n-boot", "1"])


def test_texts_in_two_groups_are_counted_and_said(tiny_ckpt, tmp_path, capsys):
    """Parity at N = 4 has 16 texts: most samples recur in another group, so held-out scores include texts the
    probe was trained on. probes.json says how many (meta.datasets, meta.warnings) and stderr says so."""
    from probes.run import main
    from tasks import copies_across_groups, make_dataset

    assert copies_across_groups(make_dataset("parity", 96, 8, seed=0)) == 106
    assert copies_across_groups(make_dataset("parity", 96, 32, seed=0)) == 0
    assert copies_across_groups(make_dataset("completion", 96, 8, seed=0)) == 0
    samples = make_dataset("parity", 12, 4, seed=0)
    out = tmp_path / "o"
    assert main(["--task", "parity", "--model", str(tiny_ckpt), "--out", str(out), "--modes", "standard",
                 "--n-pairs", "12", "--distractors", "4", "--n-boot", "20", "--no-cache", "--no-progress",
                 "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    n = copies_across_groups(samples)
    assert n > 0 and doc["meta"]["datasets"]["4"]["copies_across_groups"] == n
    assert [w["count"] for w in doc["meta"]["warnings"] if w["kind"] == "copies_across_groups"] == [n]
    assert f"{n} of 24 samples have their exact text in another group" in capsys.readouterr().err


def test_erase_on_samples_that_skip_a_label_word(tiny_ckpt, tmp_path):
    """--erase on a 3-word file whose first pairs use words 0 and 2 only: LEACE's one-hot spans the word indices
    (it crashed: 'Class values must be smaller than num_classes')."""
    lines = [{"label_words": ["0", "1", "2"], "name": "gap"}]
    for p, (a, b) in enumerate([(0, 2)] * 12 + [(1, 0)] * 2):  # one text per answer: one input, one answer
        lines += [_sample(a, p, text=f"state = {a}\n# final state:"),
                  _sample(b, p, text=f"state = {b}\n# final state:")]
    path = tmp_path / "gap.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    from probes.run import main

    out = tmp_path / "gap"
    assert main(["--task", str(path), "--model", str(tiny_ckpt), "--out", str(out), "--modes", "standard",
                 "--n-pairs", "12", "--erase", "1", "--n-boot", "20", "--no-cache", "--no-progress", "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["erased"] and {r["depth"] for r in doc["erased"]} == {1, 2}


def test_answer_sep_joins_prompt_and_answer(tmp_path, smollm2):
    """A custom task's answer follows its prompt after one space unless its header (or function) sets answer_sep:
    a digit after SmolLM2's prompt ending in a space is one token, ' 7' two (the built-in lookup's rule)."""
    _, tok = smollm2
    rows = [{"label_words": [str(d) for d in range(10)], "answer_sep": ""}]
    for p in range(10):
        rows += [{"text": f"x = {d}\nprint(x)\n# ", "label": d, "pair": p, "group": p}
                 for d in (p, (p + 3) % 10)]
    path = tmp_path / "digits.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    src = resolve_task(str(path))
    assert src.answer_sep == "" and src.describe()["answer_sep"] == ""
    ids = src.label_token_ids(tok)
    assert [tok.decode([i]) for i in ids] == [str(d) for d in range(10)]
    s = src.make(None, 0)[0]
    assert s.full_text == s.text + s.answer  # the text a model is scored (and trained) on
    rows[0]["answer_sep"] = " "  # the default: ' 7' is two tokens under SmolLM2's tokenizer
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(UserError, match=r"not one token after the prompt joined by answer_sep ' '"):
        resolve_task(str(path)).label_token_ids(tok)
    for bad in ("x", " a", "     ", 1):
        rows[0]["answer_sep"] = bad
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        with pytest.raises(UserError, match="answer_sep must be"):
            resolve_task(str(path))
