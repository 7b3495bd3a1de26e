"""--dense-every: the running value as the target at every column, checked against a direct reading of the text."""
from dataclasses import replace

import pytest

from common.errors import UserError
from tasks import build_tokenizer, label_token_ids
from training.data import make_batches
from training.presets import get_preset


def _value_as_of_each_token(task: str, text: str) -> list:
    """The running value after the latest completed update line, for every character's line (golden, from text)."""
    lines = text.split("\n")
    if task == "parity":
        x = int(lines[0].split("=")[1])
        values = []
        for ln in lines[1:-1]:  # the update lines; the last one is the query
            x ^= int(ln.split("^=")[1])
            values.append(x)
        return values
    cup = lines[0].split()[-1]
    values = []
    for ln in lines[1:-1]:
        a, b = ln.split()[1:]
        cup = b if cup == a else a if cup == b else cup
        values.append("ABC".index(cup))
    return values


@pytest.mark.parametrize("task", ["parity", "shell_game"])
def test_every_column_holds_the_latest_completed_value(task):
    tok = build_tokenizer()
    words = label_token_ids(tok, task)
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    base = replace(get_preset("tiny-fbt-track"), tasks=(task,), task_weights=None, dense_every=False)
    every = replace(base, dense_every=True)
    for step in (0, 450):
        (b0,), (b1,) = make_batches(base, tok, step), make_batches(every, tok, step)
        assert (b0.ids == b1.ids).all()
        set0 = b0.dense != -100
        assert (b1.dense[set0] == b0.dense[set0]).all()  # the line ends' targets are unchanged
        assert (b1.dense != -100).sum() > set0.sum()
        for r in range(b1.ids.shape[0]):
            ids = b1.ids[r].tolist()
            text = tok.decode(ids[:-1])  # the prompt, without the answer token
            values = _value_as_of_each_token(task, text)
            ends = [j - 1 for j, t in enumerate(ids) if t == newline]
            for j in range(len(ids)):
                done = [i for i, e in enumerate(ends[1:1 + len(values)]) if e <= j]  # update lines ended by j
                want = -100 if not done or j >= len(ids) - 1 else words[values[done[-1]]]
                if j == len(ids) - 2:
                    want = b0.dense[r, j].item()  # the final ":" keeps the answer
                assert b1.dense[r, j].item() == want, (task, step, r, j)


def test_dense_every_needs_dense_targets():
    with pytest.raises(UserError, match="dense_every needs --dense-targets"):
        replace(get_preset("tiny-fbt-track"), dense_targets=False, dense_every=True)
