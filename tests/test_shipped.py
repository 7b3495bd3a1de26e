"""The shipped checkpoint reproduces its model card's accuracy (inference only, a cheap subset of cells)."""
import json
from pathlib import Path

import pytest

from analysis.evaluate import evaluate
from models.checkpoints import checkpoint_dir
from models.loading import load_model

CARD = checkpoint_dir("tiny-fbt") / "eval.json"


@pytest.mark.skipif(not CARD.is_file(), reason="tiny-fbt is not shipped in this checkout")
@pytest.mark.parametrize("task, n", [("memory", 8), ("completion", 8), ("multi_register", 8)])
def test_tiny_fbt_reproduces_model_card(task, n):
    card = json.loads(CARD.read_text())
    want = {r["mode"]: r for r in card["results"] if r["task"] == task and r["n_distractors"] == n}
    model, tok, _ = load_model("tiny-fbt")
    rows = evaluate(model, tok, [task], [n], ["std", "soft", "recurrent-full"], 3, card["meta"]["n_pairs"],
                    progress=False)
    assert rows, "nothing evaluated"
    for r in rows:
        assert r["accuracy"] == pytest.approx(want[r["mode"]]["accuracy"], abs=1e-9), r["mode"]
        assert r["label_loss"] == pytest.approx(want[r["mode"]]["label_loss"], rel=1e-4, abs=1e-5), r["mode"]
    assert "MODEL_CARD.md" in {p.name for p in Path(CARD.parent).iterdir()}


TRACK = ("tiny-fbt-track", "tiny-std-track")


def _card_rows(name, task, n):
    card = json.loads((checkpoint_dir(name) / "eval.json").read_text())
    return card, {r["mode"]: r for r in card["results"] if r["task"] == task and r["n_distractors"] == n}


@pytest.mark.skipif(not all((checkpoint_dir(m) / "eval.json").is_file() for m in TRACK),
                    reason="the tracking pair is not shipped in this checkout")
@pytest.mark.parametrize("name", TRACK)
@pytest.mark.parametrize("task", ["parity", "shell_game"])
def test_tracking_pair_reproduces_model_cards(name, task):
    """Every mode of both cards (the twin's recurrent-full and fused-k included) at the cheapest N."""
    card, want = _card_rows(name, task, 4)
    model, tok, _ = load_model(name)
    rows = evaluate(model, tok, [task], [4], ["std", "soft", "recurrent-full"], 3, card["meta"]["n_pairs"],
                    progress=False)
    assert {r["mode"] for r in rows} == {"std", "soft", "recurrent-full", "fused-1", "fused-2", "fused-3"}
    for r in rows:
        assert r["accuracy"] == pytest.approx(want[r["mode"]]["accuracy"], abs=1e-9), r["mode"]
        assert r["label_loss"] == pytest.approx(want[r["mode"]]["label_loss"], rel=1e-4, abs=1e-5), r["mode"]


@pytest.mark.skipif(not (checkpoint_dir("tiny-std-track") / "eval.json").is_file(),
                    reason="tiny-std-track is not shipped in this checkout")
def test_argmax_counts_agrees_with_the_card():
    """scripts/argmax_counts.py answers with evaluate's samples and argmax: its answers score the card's accuracy."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "argmax_counts.py"
    spec = importlib.util.spec_from_file_location("argmax_counts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    card, want = _card_rows("tiny-std-track", "parity", 4)
    model, tok, _ = load_model("tiny-std-track")
    said, samples = mod.predictions(model, tok, "parity", 4, "recurrent-full", card["meta"]["n_pairs"])
    assert len(said) == len(samples) == want["recurrent-full"]["n_samples"]
    right = sum(a == s.answer for a, s in zip(said, samples))
    assert right / len(samples) == pytest.approx(want["recurrent-full"]["accuracy"], abs=1e-9)
    assert set(said) - {"0", "1"}, "the twin's recurrent-full gives non-label answers at N = 4 (eval: 0.455)"


@pytest.mark.parametrize("name,task,n", [("tiny-loop-track", "parity", 16), ("tiny-loop-track", "shell_game", 16),
                                          ("tiny-loop-group", "s5", 8), ("tiny-loop-group", "a5", 8)])
def test_looped_models_reproduce_their_cards_at_every_r(name, task, n):
    """A looped card's cells where r matters: its trained r (standard) and test-time r = 1, 2, 8."""
    if not (checkpoint_dir(name) / "eval.json").is_file():
        pytest.skip(f"{name} is not shipped in this checkout")
    card, want = _card_rows(name, task, n)
    model, tok, _ = load_model(name)
    modes = ["standard", "loop-1", "loop-2", "loop-8"]
    rows = evaluate(model, tok, [task], [n], modes, 0, card["meta"]["n_pairs"], progress=False)
    assert {r["mode"] for r in rows} == set(modes)
    for r in rows:
        assert r["accuracy"] == pytest.approx(want[r["mode"]]["accuracy"], abs=1e-9), r["mode"]
        assert r["label_loss"] == pytest.approx(want[r["mode"]]["label_loss"], rel=1e-4, abs=1e-5), r["mode"]


@pytest.mark.parametrize("name, task", [("tiny-fbt-track3", t) for t in ("parity", "parity@hold", "parity@periodic",
                                                                         "parity@heldout")]
                         + [("tiny-fbt-track4", t) for t in ("shell_game", "shell_game@heldout", "parity@hold")])
def test_short_window_models_reproduce_their_cards(name, task):
    """The 4- and 2-token window models' card cells at N = 16 (recurrent-full over a window cache)."""
    if not (checkpoint_dir(name) / "eval.json").is_file():
        pytest.skip(f"{name} is not shipped in this checkout")
    card, want = _card_rows(name, task, 16)
    model, tok, _ = load_model(name)
    rows = evaluate(model, tok, [task], [16], ["recurrent-full"], 0, card["meta"]["n_pairs"], progress=False)
    assert [r["mode"] for r in rows] == ["recurrent-full"]
    assert rows[0]["accuracy"] == pytest.approx(want["recurrent-full"]["accuracy"], abs=1e-9)
    assert rows[0]["label_loss"] == pytest.approx(want["recurrent-full"]["label_loss"], rel=1e-4, abs=1e-5)


def test_the_plain_decodable_direction_is_the_read_one(capsys):
    """scripts/probe_direction.py on tiny-fbt-track's parity (docs/results.md): the suite's standardized probe
    subspace moves no answer, the class-mean difference (and a logistic regression on the raw state) moves as many
    as the whole swap."""
    import importlib.util

    import numpy as np

    path = Path(__file__).resolve().parents[1] / "scripts" / "probe_direction.py"
    spec = importlib.util.spec_from_file_location("probe_direction", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import torch

    from interventions.subspace import FoldSubspace, class_mean_subspaces

    H = np.random.default_rng(0).normal(size=(40, 6))
    y = np.repeat([0, 1, 2], [10, 14, 16])
    B = class_mean_subspaces(torch.from_numpy(H), y, [FoldSubspace(np.array([], dtype=int), None, 1.0)])[0].U.numpy()
    assert np.allclose(B.T @ B, np.eye(2))  # orthonormal, spanning the class-mean differences the script swaps
    d = H[y == 2].mean(0) - H[y == 0].mean(0)
    assert np.allclose(B @ (B.T @ d), d)
    w = mod.raw_logistic_basis(H, (y > 0).astype(int))
    assert w.shape == (6, 1) and np.isclose(np.linalg.norm(w), 1.0)
    assert mod.main(["--model", "tiny-fbt-track", "parity", "--n-pairs", "20", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["directions"]
    assert rows["probe"]["follows_donor"] <= 0.1 and out["whole_swap"]["follows_donor"] >= 0.9
    assert rows["class means"]["follows_donor"] >= 0.9 and rows["raw logistic"]["follows_donor"] >= 0.9
    assert out["cosines"]["probe / class means"] < 0.5
    with pytest.raises(SystemExit) as refused:  # parity at N = 1 has one group: one line, not sklearn's traceback
        mod.main(["--model", "tiny-fbt-track", "parity", "--n-pairs", "10", "--distractors", "1", "--threads", "1"])
    assert refused.value.code == 2 and "too few groups" in capsys.readouterr().err
