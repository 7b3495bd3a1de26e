"""interventions.run on any HF causal LM in standard mode (issue 37, item 4), the budget and the progress bar.

A plain Llama and a plain GPT-2 with random weights, saved with `save_pretrained` beside the task tokenizer (no
download), and the real SmolLM2-135M: the residual analyses run and are checked against their invariants (a
residual swap before the pair's first differing token changes nothing, exactly; the donor's top residual at T
gives the donor's answer), the fed-state analyses read "not applicable (no feedback)", and a feedback mode is
refused in one line. The standard runner's cached-suffix patch is held to a full patched forward."""
from __future__ import annotations

import io
import json

import pytest
import torch

from engine.patching import _hooks
from interventions.core import Batch, CausalContext, Patch


def _plain_lm(family: str, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return LlamaForCausalLM(cfg).eval()
    cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2,
                     bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def plain_dir(request, tmp_path_factory):
    """A plain HF causal LM folder (config.json, model.safetensors, the task tokenizer's files)."""
    from models.full_bandwidth import save_tokenizer
    from tasks import build_tokenizer

    tok = build_tokenizer()
    path = tmp_path_factory.mktemp(request.param)
    _plain_lm(request.param, len(tok.get_vocab())).save_pretrained(str(path))
    save_tokenizer(tok, path)
    return path


def test_standard_mode_battery_on_a_plain_hf_lm(plain_dir, tmp_path):
    from interventions.run import main

    out = tmp_path / "o"
    assert main(["--model", str(plain_dir), "--mode", "standard", "--task", "parity", "--n-pairs", "10",
                 "--distractors", "3", "--max-positions", "0", "--out", str(out), "--no-progress"]) == 0
    assert {"causal_report.json", "causal_report.md", "causal_report.html"} <= {p.name for p in out.iterdir()}
    rep = json.loads((out / "causal_report.json").read_text())
    res, cfg = rep["results"], rep["config"]
    assert rep["model"]["feedback"] is False and rep["model"]["file_sha256"]
    assert rep["verdict"]["label"] == "not applicable (no feedback)"
    assert res["fed_state"] == "not applicable (no feedback): the model has no fusion module"
    assert res["interventions"] == [] and res["subspace"] is None and res["dose"] is None
    assert rep["control"] == {"skipped": "a control model tests a fed state; standard prefill has none"}
    assert cfg["n_pairs"] == 10 and rep["dataset"]["n_samples"] == 20 and cfg["budget"] == "quick"
    # every row carries CIs
    ab = res["resid_mean_ablation"]["rows"]
    assert [r["depth"] for r in ab] == [0, 1, 2] and all(r["normalized_effect_ci"] for r in ab)
    # the residual sweep: nothing before the first differing token, exactly
    sw = res["position_sweep"]
    assert sw["site"] == "resid" and sw["depth"] == 1 and sw["at_or_before_first_diff"]["n"] > 0
    assert sw["max_abs_ld_change_at_or_before_first_diff"] == 0.0
    assert sw["at_or_before_first_diff"]["changed_rate"] == 0.0
    # layer patching: the donor's top residual at T is the donor's run from there on: normalized effect 1
    lp = res["layer_patching"]
    assert lp["modes"] == ["standard"] and lp["depths"] == [0, 1, 2]
    assert lp["standard"]["normalized_effect"][-1][-1] == pytest.approx(1.0, abs=1e-4)
    md = (out / "causal_report.md").read_text()
    assert "not applicable (no feedback)" in md and "Mean ablation by depth" in md and "20 samples" in md
    # the page says what it shows, and nothing it did not compute: the residual sweep's alignment (the residual at
    # t is column t's own: relative = t - first differing position + 1), no empty LEACE table, no empty figure
    assert "relative = t - first differing position + 1: 0 is the last position before it" in md
    assert "is after t (their two residuals, column t's own, are identical there)" in md
    assert "## Concept erasure (LEACE)" not in md
    page = (out / "causal_report.html").read_text()
    assert "by t - first differing token + 1" in page and "Interventions at T:" not in page


def test_a_feedback_mode_on_a_plain_lm_is_one_line(plain_dir, tmp_path, capsys):
    from interventions.run import main

    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(plain_dir), "--mode", "recurrent-1", "--task", "parity", "--n-pairs", "10",
              "--distractors", "3", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "use --mode standard" in err
    assert not out.exists()


def test_standard_suffix_patch_equals_a_full_patched_forward(plain_dir):
    """The standard runner reruns only the columns from the first patched one; the result must be the full
    patched forward's (up to float rounding), at every depth and at early and late positions."""
    from tasks import make_dataset
    from models.loading import load_model

    model, tok, _ = load_model(str(plain_dir))
    b = Batch.from_samples(make_dataset("parity", n_pairs=6, n_distractors=3, seed=1), tok, "parity")
    ctx = CausalContext(model, b, modes=("standard",))
    r = ctx.runners["standard"]
    T = b.input_ids.shape[1]
    for pos in (-1, -4, 1 - T):
        for d in range(model.n_layers + 1):
            fast = ctx.patch_resid("standard", d, pos, b.pair)
            with torch.no_grad(), _hooks(model, [Patch("resid", ctx.resid("standard")[:, T + pos, d][b.pair], d,
                                                       pos)], r.col):
                full = model(b.input_ids, b.attention_mask).logits[:, -1]
            assert torch.allclose(fast, full, atol=1e-5, rtol=1e-5), (pos, d)
            own = ctx.resid("standard")[:, T + pos, d]
            # nothing to move, exactly: the top residual of an earlier column (nothing reads it), or a column
            # where the pair's residuals are equal (before the differing token; the shared final token at depth 0)
            if (d == model.n_layers and pos != -1) or torch.equal(own, own[b.pair]):
                assert torch.equal(fast, ctx.clean["standard"].logits), (pos, d)
            else:  # the pair's residuals differ there and are read later: the patch moves the answer
                assert (fast - ctx.clean["standard"].logits).abs().max() > 1e-3, (pos, d)


def test_standard_mode_on_smollm2(smollm2, tmp_path):
    """The real SmolLM2-135M: the standard battery runs, nothing moves before the first differing token."""
    from interventions.run import main

    out = tmp_path / "o"
    assert main(["--model", "smollm2-135m", "--mode", "standard", "--task", "completion", "--n-pairs", "10",
                 "--distractors", "0", "--out", str(out), "--no-progress", "--max-positions", "4"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    res = rep["results"]
    assert rep["model"]["n_layers"] == 30 and rep["verdict"]["label"] == "not applicable (no feedback)"
    assert res["layer_patching"]["depths"] == [0, 10, 20, 30]  # the quick budget's 4 depths
    assert len(res["resid_mean_ablation"]["rows"]) == 31 and res["position_sweep"]["depth"] == 15
    lp = res["layer_patching"]["standard"]["normalized_effect"]
    assert lp[-1][-1] == pytest.approx(1.0, abs=1e-3)  # the donor's top residual at T: the donor's answer


# ----- the progress bar --------------------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self):
        return True


def _small_ctx():
    from pathlib import Path

    from tasks import make_dataset
    from models.loading import load_model

    model, tok, _ = load_model(str(Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-fbt-track"))
    b = Batch.from_samples(make_dataset("parity", n_pairs=10, n_distractors=4, seed=0), tok, "parity")
    return CausalContext(model, b, modes=("standard", "recurrent-full"))


def test_progress_counts_every_patched_run_as_planned():
    """The suite announces its plan before the first run; the bar then counts every patched run: the counts
    agree, stage by stage, so the ETA is the whole battery's."""
    from interventions.progress import Progress
    from interventions.suite import run_suite

    ctx = _small_ctx()
    stream = io.StringIO()
    p = Progress(stream=stream)
    run_suite(ctx, rank=1, n_boot=20, progress=p, max_positions=3, erase_depths=[0], layer_depths=[0, 6])
    p.close()
    patched = p.done
    assert patched == p.total > 0  # the plan was exact
    assert ctx.on_run is None  # the hook is removed after the battery
    lines = stream.getvalue().splitlines()
    assert any(line.startswith("[interventions] layer_patching: 12 patched runs") for line in lines)
    assert lines[-1].endswith(f"({patched}/{patched} of the battery)")


def test_progress_bar_on_a_terminal_and_silence_when_disabled():
    from interventions.progress import Progress

    tty = _Tty()
    p = Progress(stream=tty)
    p.plan(5)
    p.stage("swap", 5)
    for _ in range(5):
        p.step()
    p.close()
    text = tty.getvalue()
    assert "5/5" in text and "run/s" in text and "swap" in text  # tqdm: count, rate, stage
    quiet = io.StringIO()
    q = Progress(enabled=False, stream=quiet)
    q.plan(2), q.stage("x", 2), q.step(), q.say("hello"), q.close()
    assert quiet.getvalue() == ""


def test_per_row_positions_in_one_run_equal_one_run_per_position():
    """first_line_after patches every row at its own position in ONE run (Patch.rows); rows of a recurrent run
    are independent, so each row's logits must equal, bit for bit, those of a run patched at its position only."""
    import numpy as np

    from interventions.suite import Suite, first_line_after_positions

    ctx = _small_ctx()
    b, mode = ctx.batch, "recurrent-full"
    suite = Suite(ctx)
    pos, has = first_line_after_positions(b, suite._first_diff_lines())
    ps = sorted({int(v) for v in pos[has]})
    assert len(ps) > 1  # the rows really sit at different positions
    patches = [Patch("state", ctx.state(mode, p)[b.pair], pos=p, rows=torch.as_tensor(has & (pos == p)))
               for p in ps]
    one = ctx.run(mode, patches).logits
    for p in ps:
        rows = np.where(has & (pos == p))[0]
        alone = ctx.swap_state(b.pair, mode, p)
        assert torch.equal(one[rows], alone[rows]), p
    untouched = np.where(~has)[0]
    assert torch.equal(one[untouched], ctx.clean[mode].logits[untouched])


def test_a_task_file_gives_its_n_and_first_k_pairs(tiny_ckpt, tmp_path):
    """--n-pairs means the same for a file as in probes.run (its first k pairs of the N), the file's N is the
    default, and the report says how many pairs and samples it used."""
    from pathlib import Path

    from interventions.run import main

    data = Path(__file__).resolve().parent / "data" / "last_write.jsonl"  # N = 1 and N = 2, 15 pairs each
    for extra, pairs in (([], 15), (["--n-pairs", "10"], 10)):
        out = tmp_path / f"o{pairs}"
        assert main(["--model", str(tiny_ckpt), "--task", str(data), "--out", str(out), "--no-progress",
                     "--control-model", "none", "--mode", "recurrent-1", *extra]) == 0
        rep = json.loads((out / "causal_report.json").read_text())
        assert rep["config"]["distractors"] == 1  # the file's first N, not the built-in default 8
        assert rep["config"]["n_pairs"] == rep["dataset"]["n_pairs"] == pairs
        assert rep["dataset"]["n_samples"] == 2 * pairs
        assert f"{pairs} pairs ({2 * pairs} samples" in (out / "causal_report.md").read_text()


def test_changed_and_follows_donor_are_two_rates():
    """On a model that is often wrong, a no-op patch 'follows the donor' wherever the clean answer already was the
    donor's label, but changes nothing: the two rates differ, and each is what its name says (binary and K-way)."""
    import numpy as np

    from interventions.metrics import changed, summarize

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 50)
    r = 1 - y
    ld = rng.normal(0, 1, 50)  # about half the rows wrong
    acc = float((ld > 0).mean())
    m = summarize(ld, ld, -ld, y, r, np.arange(50), n_boot=50)  # the patch changes nothing
    assert m["changed_rate"] == 0.0 and m["changed"] == 0.0
    assert m["follows_donor_rate"] == pytest.approx(1 - acc) and 0.3 < 1 - acc < 0.7
    flipped = summarize(-ld, ld, -ld, y, r, np.arange(50), n_boot=50)  # every decision reversed
    assert flipped["changed_rate"] == 1.0 and flipped["follows_donor_rate"] == pytest.approx(acc)
    # K = 3, by hand: argmax sets {0} vs {0}: same; {1} vs {0}: changed; {0, 1} tie vs {0}: changed with p 1/2
    clean = torch.tensor([[3.0, 1, 0], [3.0, 1, 0], [3.0, 1, 0]])
    patched = torch.tensor([[2.0, 1, 0], [0.0, 2, 1], [2.0, 2, 0]])
    assert changed(patched, clean, (0, 1, 2)).tolist() == [0.0, 1.0, 0.5]


def test_a_model_folder_without_a_tokenizer_is_refused(tmp_path, capsys):
    """interventions.run never runs a folder with the suite's own task tokenizer unasked: one line, naming the
    files looked for and the flag; with --tokenizer it runs."""
    from interventions.run import main
    from tasks import build_tokenizer

    model_dir = tmp_path / "bare"
    _plain_lm("llama", len(build_tokenizer().get_vocab())).save_pretrained(str(model_dir))
    out = tmp_path / "o"
    base = ["--model", str(model_dir), "--mode", "standard", "--task", "parity", "--n-pairs", "10",
            "--distractors", "3", "--out", str(out), "--no-progress"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(base)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "tokenizer.json" in err and "--tokenizer" in err
    assert not out.exists()
    assert main(base + ["--tokenizer", "tiny-fbt-track"]) == 0 and (out / "causal_report.json").is_file()


def test_patches_at_two_depths_in_one_standard_run_equal_a_full_forward(plain_dir):
    """Two resid patches at different depths in one standard run (the cached-suffix shift would compound): the
    result is the full patched forward's."""
    from tasks import make_dataset
    from models.loading import load_model

    model, tok, _ = load_model(str(plain_dir))
    b = Batch.from_samples(make_dataset("parity", n_pairs=6, n_distractors=3, seed=1), tok, "parity")
    ctx = CausalContext(model, b, modes=("standard",))
    T, R = b.input_ids.shape[1], ctx.resid("standard")
    patches = [Patch("resid", R[:, T - 3, 1][b.pair], 1, -3), Patch("resid", R[:, T - 1, 2][b.pair], 2, -1)]
    with torch.no_grad(), _hooks(model, patches, ctx.runners["standard"].col):
        full = model(b.input_ids, b.attention_mask).logits[:, -1]
    assert torch.allclose(ctx.run("standard", patches).logits, full, atol=1e-5)


def test_an_exact_tie_left_as_it_was_is_no_change():
    import numpy as np

    from interventions.metrics import changed, summarize

    z = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    assert changed(z, z, (0, 1, 2)).tolist() == [0.0, 0.0]
    ld = np.array([0.0, 1.0, -1.0, 0.0])
    m = summarize(ld, ld, -ld, np.array([0, 1, 0, 1]), np.array([1, 0, 1, 0]), np.arange(4), n_boot=10)
    assert m["changed_rate"] == 0.0


def test_first_diff_lines_of_pairs_of_different_lengths():
    """s5 pairs differ in one line, a `swap` (3 words) against a `cycle` (4): the two prompts share their prefix,
    not their columns. Each row's differing line must be the pair's real one (Sample.diff_line update lines after
    the `ball under` line), and the line after it must start at the same end offset in both rows (end-aligned:
    it was the longer row's line 0 and the shorter row was dropped)."""
    import numpy as np

    from interventions.batch import Batch
    from interventions.suite import first_diff_lines, first_line_after_positions
    from tasks import build_tokenizer, make_dataset

    samples = make_dataset("s5", 12, 8, seed=0)
    b = Batch.from_samples(samples, build_tokenizer(), "s5")
    lengths = b.attention_mask.sum(1)
    assert (lengths != lengths[b.pair]).any()  # the case at hand: some pairs differ in length
    header_lines = samples[0].text.split("\n").index(next(x for x in samples[0].text.split("\n")
                                                          if x.startswith(("swap", "cycle"))))
    fline = first_diff_lines(b)
    assert fline.tolist() == [s.diff_line + header_lines for s in samples]
    pos, has = first_line_after_positions(b, fline)
    assert has.all() and np.array_equal(pos, pos[b.pair])
