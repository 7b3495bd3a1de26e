"""scripts/stress_tracking.py: its prompts' labels against a hand-written simulation of the text, each family's
defining property, and the shipped parity model on every family past its window."""
import importlib.util
import re
from pathlib import Path

import pytest

from models.checkpoints import checkpoint_dir

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stress_tracking", ROOT / "scripts/stress_tracking.py")
stress = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stress)

CUP = {"A": 0, "B": 1, "C": 2}


def simulate(task, text):
    """The tracked value after every update line, read from the prompt text alone (not tasks.tracking)."""
    lines = text.split("\n")
    if task == "parity":
        v, out = 0, []
        for ln in lines[1:-1]:
            v ^= int(ln == "x ^= 1")
            out.append(v)
        return out
    cup = (lambda c: CUP[c]) if task == "shell_game" else int
    ball, out = cup(lines[0].split()[-1]), []
    for ln in lines[1:-1]:
        op, *cs = ln.split()
        cs = [cup(c) for c in cs]
        if op == "swap":
            ball = cs[1] if ball == cs[0] else cs[0] if ball == cs[1] else ball
        else:  # cycle x y z: x -> y -> z -> x
            ball = cs[(cs.index(ball) + 1) % 3] if ball in cs else ball
        out.append(ball)
    return out


def start_value(task, text):
    first = text.split("\n")[0].split()[-1]
    return 0 if task == "parity" else CUP[first] if task == "shell_game" else int(first)


@pytest.mark.parametrize("task", stress.TASKS)
def test_labels_and_family_shapes(task):
    n = 150
    for fam in stress.families(task):
        texts, labels = stress.prompts(task, fam, n, 4, seed=3)
        assert texts == stress.prompts(task, fam, n, 4, seed=3)[0]  # deterministic
        for text, label in zip(texts, labels):
            run = simulate(task, text)
            assert run[-1] == label, (fam, text[:80])
            assert len(run) == (4 * n if fam == "uniform-4x" else n)
            changes = [i for i in range(1, len(run)) if run[i] != run[i - 1]]
            lines = text.split("\n")[1:-1]
            if fam.startswith("repeat-"):
                assert len(set(lines)) == 1
            elif fam == "move-then-hold":
                assert changes == [] and run[0] != start_value(task, text)
            elif fam == "hold-then-move":
                assert changes == [n - 1]
            elif fam == "sparse-70":
                assert changes == [i for i in range(1, n) if i % 70 == 69]


def test_bad_family_and_mode_are_one_line(capsys):
    for argv, words in ((["parity", "--families", "nope"], "unknown family nope"),
                        (["parity", "--mode", "recurrent-x"], "prefill mode")):
        with pytest.raises(SystemExit) as e:
            stress.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not (checkpoint_dir("tiny-fbt-track3") / "model.safetensors").is_file(),
                    reason="tiny-fbt-track3 is not shipped in this checkout")
def test_shipped_parity_model_holds_every_family(capsys):
    """N = 80 (the hold families' still stretches outlast the 4-token window 80 times over)."""
    assert stress.main(["parity", "--model", "tiny-fbt-track3", "--distractors", "80", "--samples", "4",
                        "--seed", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    import json

    acc = json.loads(out.strip().splitlines()[-1])["accuracy"]
    assert set(acc) == set(stress.families("parity"))
    assert all(v == 1.0 for v in acc.values()), acc


_cspec = importlib.util.spec_from_file_location("heldout_cells", ROOT / "scripts/heldout_cells.py")
heldout_cells = importlib.util.module_from_spec(_cspec)
_cspec.loader.exec_module(heldout_cells)


@pytest.mark.parametrize("task", ["parity", "shell_game", "a5"])
def test_heldout_cells_hold_one_heldout_pair_entered_with_the_cells_value(task):
    from tasks.tracking import heldout_pairs, tracker

    tr, held, n = tracker(task), heldout_pairs(task), 8
    got = heldout_cells.cells(task, n, 3, seed=2)
    assert {(a, b) for a, b, _ in got} == set(held)
    for (a, b, v), (texts, labels) in got.items():
        assert len(texts) == 3
        for text, label in zip(texts, labels):
            idx = [tr.lines.index(ln) for ln in text.split("\n")[1:-1]]
            pairs = [i for i, pq in enumerate(zip(idx, idx[1:])) if pq in held]
            assert pairs == [n // 2 - 1] and idx[n // 2 - 1:n // 2 + 1] == [a, b]
            run = simulate(task, text)
            assert run[-1] == label and run[n // 2 - 1] == v


def test_heldout_cells_fill_every_cell_at_a_long_n():
    """The lines around the pair are drawn forward, never rejected: N = 300 (299 line pairs) fills every cell."""
    got = heldout_cells.cells("shell_game", 300, 4, seed=3)
    assert len(got) == 6 and all(len(t) == 4 for t, _ in got.values())
