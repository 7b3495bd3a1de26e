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
