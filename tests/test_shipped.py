"""The shipped checkpoint reproduces its model card's accuracy (inference only, a cheap subset of cells)."""
import json
from pathlib import Path

import pytest

from analysis.evaluate import evaluate
from training.presets import checkpoint_dir, load_model

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
