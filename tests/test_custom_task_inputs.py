"""A user's task judged by the inputs the model reads (the custom-task review of 2026-12-07): one probe target for
every N of a run, a file's classes scored or refused as docs/tasks.md says, label words checked after every N's
prompts, one answer per input, and a generator's changed data never replacing earlier results silently."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ARGS = ["--modes", "standard", "--n-boot", "20", "--no-mdl", "--no-cache", "--no-progress"]


def _write(path: Path, header: dict, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in [header, *rows]) + "\n")
    return path


def _pairs(n_pairs, labels=(0, 1), n=0, text=lambda lab, p: f"state = {lab}\n# final state:", group=None):
    rows = []
    for p in range(n_pairs):
        a, b = labels[p % len(labels)] if isinstance(labels[0], tuple) else labels
        for lab in (a, b):
            rows.append({"text": text(lab, p), "label": lab, "pair": p, "group": p if group is None else group(p),
                         "n_distractors": n})
    return rows


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_one_probe_target_for_every_n_of_a_run():
    """binding at 48 pairs (seed 0): N = 0 needs the pair roles, N = 2 and 4 do not. Each N chose for itself and
    probes.json described the run by the last N only: now the roles for all three."""
    from stats.linear import ProbeConfig
    from tasks import make_dataset, probe_labels, probe_target
    from tasks.samples import ROLE_PROBE_LABEL

    k = ProbeConfig().n_splits
    sets = [make_dataset("binding", 48, n, seed=0) for n in (0, 2, 4)]
    assert [probe_labels(s, k)[1] == ROLE_PROBE_LABEL for s in sets] == [True, False, False]  # each N alone
    assert probe_target(sets, k) is True
    assert probe_labels(sets[1], k, roles=True)[1] == ROLE_PROBE_LABEL
    assert probe_target(sets[1:], k) is False


def test_a_file_whose_class_is_in_too_few_groups_is_refused_not_probed_by_row_order(tiny_ckpt, tmp_path, capsys):
    from interventions.run import main as interventions
    from probes.run import main as probes

    # 4 classes: pairs (0,1) and (2,3) in 12 groups each, one pair (3,0) more: fine; class 3 alone in 2 groups: not
    rows = _pairs(24, labels=[(0, 1), (2, 3)])
    f = _write(tmp_path / "k4.jsonl", {"label_words": ["0", "1", "2", "3"]}, rows)
    assert probes(["--task", str(f), "--model", str(tiny_ckpt), "--out", str(tmp_path / "ok"), *ARGS]) == 0
    meta = json.loads((tmp_path / "ok" / "probes.json").read_text())["meta"]["labels"]
    assert "probe_label" not in meta and meta["chance"] == 0.25  # the answer, against 1/4
    capsys.readouterr()
    few = _pairs(24, labels=[(0, 1)] * 10 + [(0, 2)] * 10 + [(1, 3), (2, 0)] * 2)
    f = _write(tmp_path / "few.jsonl", {"label_words": ["0", "1", "2", "3"]}, few)
    err = _refused(probes, ["--task", str(f), "--model", str(tiny_ckpt), "--out", str(tmp_path / "a"), *ARGS], capsys)
    assert "label 3 occurs in 2 group(s)" in err, err
    err = _refused(interventions, ["--task", str(f), "--model", str(tiny_ckpt), "--out", str(tmp_path / "b"),
                                   "--control-model", "none", "--no-progress"], capsys)
    assert "label 3 occurs in 2 group(s)" in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_label_words_are_checked_after_every_n_s_prompts(tiny_ckpt, tmp_path, capsys):
    """answer_sep "" after `value:` at N = 0 and after `value` at N = 1: the words are one token after the first,
    two after the second. analysis.evaluate refused it; probes.run checked N = 0 alone and scored a lens at N = 1."""
    from probes.run import main as probes

    rows = (_pairs(6, text=lambda lab, p: f"state = {lab}\nvalue :")
            + _pairs(6, n=1, text=lambda lab, p: f"state = {lab}\nx\nvalue"))
    f = _write(tmp_path / "sep.jsonl", {"label_words": ["0", "1"], "answer_sep": ""}, rows)
    err = _refused(probes, ["--task", str(f), "--model", str(tiny_ckpt), "--out", str(tmp_path / "o"), *ARGS], capsys)
    assert "is not one token after the prompt" in err or "other tokens after the prompts of N=1" in err, err


@pytest.mark.parametrize("case", ["pair", "two_pairs"])
def test_one_input_has_one_answer_under_the_tokenizer(tiny_ckpt, tmp_path, capsys, case):
    """Two texts that differ only in whitespace are one input to the word-level tokenizer: a pair of them was an
    identity swap ("inconclusive"), two pairs holding them with other labels a contradiction the probes scored."""
    from probes.run import main as probes

    rows = _pairs(6)
    if case == "pair":
        rows[1]["text"] = rows[0]["text"].replace(" = ", "  =  ")  # label 1, the same input as label 0
    else:
        rows[2]["text"], rows[3]["text"] = rows[1]["text"] + " ", rows[0]["text"].replace("=", " = ")
    f = _write(tmp_path / f"{case}.jsonl", {"label_words": ["0", "1"]}, rows)
    err = _refused(probes, ["--task", str(f), "--model", str(tiny_ckpt), "--out", str(tmp_path / "o"), *ARGS], capsys)
    assert "the same input under this tokenizer" in err and "one prompt cannot have two answers" in err, err


def test_copies_across_groups_count_inputs_not_texts():
    from tasks import build_tokenizer, copies_across_groups, make_dataset
    from tasks.tokenizer import tokenize_samples

    s = make_dataset("completion", 4, 0, seed=0)
    spaced = [type(x)(**{**x.__dict__, "text": x.text.replace(" ", "  ")}) if i < 2 else x for i, x in enumerate(s)]
    spaced = [type(x)(**{**x.__dict__, "group_id": 99}) if i < 2 else x for i, x in enumerate(spaced)]
    moved = spaced + [type(x)(**{**x.__dict__, "group_id": 98}) for x in s[:2]]  # the same inputs in another group
    seqs, _ = tokenize_samples(moved, build_tokenizer())
    assert copies_across_groups(moved) == 0 and copies_across_groups(moved, seqs) == 4


def test_a_changed_generator_is_another_run(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from probes.run import main as probes

    (tmp_path / "my_tasks.py").write_text(
        "import os\nfrom tasks import Sample\n\n"
        "def gen(n_pairs, n_distractors, seed):\n"
        "    flip = int(os.environ.get('FLIP', '0'))\n"
        "    return [Sample('gen', f'state = {l}\\n# final state:', l ^ flip, p, p, n_distractors)\n"
        "            for p in range(n_pairs) for l in (0, 1)]\n\n"
        "gen.label_words = ('0', '1')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--task", "my_tasks:gen", "--model", str(tiny_ckpt), "--distractors", "2", "--n-pairs", "12",
            "--out", str(tmp_path / "o"), *ARGS]
    monkeypatch.setenv("FLIP", "0")
    assert probes(argv) == 0
    before = (tmp_path / "o" / "probes.json").read_text()
    assert probes(argv) == 0  # the same data: the same run, rerun
    monkeypatch.setenv("FLIP", "1")  # same name, other code: other labels
    capsys.readouterr()
    err = _refused(probes, argv, capsys)
    assert "differs in datasets" in err, err
    assert json.loads((tmp_path / "o" / "probes.json").read_text())["meta"]["datasets"] == json.loads(before)["meta"]["datasets"]


def test_a_file_named_like_a_task_variant_is_a_file(tmp_path, monkeypatch):
    from tasks import resolve_task

    _write(tmp_path / "parity@v2.jsonl", {"label_words": ["0", "1"], "name": "pv2"}, _pairs(5))
    monkeypatch.chdir(tmp_path)
    src = resolve_task("parity@v2.jsonl")
    assert src.form == "jsonl" and len(src.make(None, 0, 0)) == 10
    with pytest.raises(Exception, match="unknown variant"):
        resolve_task("parity@v3.jsonl")  # no such file: still read as a variant, and refused
