"""The looped family (models.looped): the unrolled forward against a hand-written loop, r = 1 without injection
against the plain stack, per-iteration recordings, an identity patch of a loop state, the KV-cache slots, the
checkpoint round trip and truncated backpropagation."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.errors import UserError
from engine.hooks import ResidualRecorder
from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM
from models.looped import LoopedLM, LoopSpec, looping

V = 40


def make(spec=LoopSpec(1, 2, 1, 3), window=None, seed=0) -> LoopedLM:
    torch.manual_seed(seed)
    cfg = qwen3_config(V, n_layers=spec.n_blocks, d_model=32, n_heads=2, n_kv_heads=1, attn_window=window)
    model = LoopedLM(AutoModelForCausalLM.from_config(cfg), spec).eval()
    if model.adapter is not None:  # an adapter that is not the mean (the init): the injection must matter
        with torch.no_grad():
            model.adapter.weight.add_(0.2 * torch.randn_like(model.adapter.weight))
    return model


def saved_looped(path, spec: LoopSpec) -> None:
    """A random looped checkpoint with the task tokenizer at `path` (for the CLIs)."""
    from tasks import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = qwen3_config(len(tok.get_vocab()), n_layers=spec.n_blocks, d_model=32, n_heads=2, n_kv_heads=1)
    LoopedLM(AutoModelForCausalLM.from_config(cfg), spec).save_pretrained(path, tok)


def ids_of(B=3, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    return ids, torch.ones_like(ids)


def hand_loop(model: LoopedLM, ids, r: int):
    """The loop written out: prelude, r iterations of the core with Huginn's injection (s_0 = e), coda; full causal
    attention, no padding. Returns (logits [B, T, V], states [s_0 .. s_r])."""
    lm, s = model.lm, model.spec
    T = ids.shape[1]
    h = lm.model.embed_tokens(ids)
    pos = torch.arange(T)[None].expand(ids.shape[0], -1)
    pe = lm.model.rotary_emb(h, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

    def block(j, x):
        out = model.blocks[j](x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    for j in range(s.prelude):
        h = block(j, h)
    e = state = h
    states = [state]
    for _ in range(r):
        x = model.adapter(torch.cat([state, e], -1)) if model.adapter is not None else state
        for j in range(s.core):
            x = block(s.prelude + j, x)
        state = x
        states.append(state)
    h = state
    for j in range(s.coda):
        h = block(s.prelude + s.core + j, h)
    return lm.lm_head(lm.model.norm(h)), states


@pytest.mark.parametrize("r", [1, 3, 5])
def test_unrolled_forward_and_recordings_equal_the_hand_written_loop(r):
    model = make()
    ids, mask = ids_of()
    with torch.no_grad(), looping(model, r):
        want, states = hand_loop(model, ids, r)
        with ResidualRecorder(model) as rec:
            rec.cols = torch.arange(ids.shape[1])
            got = model(ids, mask).logits
            resid = rec.take()  # [B, T, L+1, D] over the unrolled stack
        assert resid.shape[2] == model.n_layers + 1 == model.spec.n_blocks + model.spec.core * (r - 1) + 1
        for i, s in enumerate(states):
            assert torch.allclose(resid[:, :, model.state_depth(i)], s, atol=1e-5), i
    assert torch.allclose(got, want, atol=1e-5)
    assert model.iterations == 3  # looping() restored the trained r


def test_one_iteration_without_injection_is_the_plain_stack():
    torch.manual_seed(0)
    cfg = qwen3_config(V, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1)
    lm = AutoModelForCausalLM.from_config(cfg).eval()
    plain = FullBandwidthLM(copy.deepcopy(lm), fusion=False).eval()
    looped = LoopedLM(lm, LoopSpec(1, 2, 1, 1, inject=False)).eval()
    ids, mask = ids_of()
    with torch.no_grad():
        assert torch.equal(looped(ids, mask).logits, plain(ids, mask).logits)
        looped.set_iterations(2)  # two iterations of a non-identity core: no longer the plain stack
        assert not torch.allclose(looped(ids, mask).logits, plain(ids, mask).logits, atol=1e-3)


def test_patching_a_loop_state_with_its_own_clean_value_changes_nothing():
    from interventions.core import Batch, CausalContext, Patch

    model = make()
    ids, mask = ids_of(B=4, T=9)
    batch = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (5, 6))
    ctx = CausalContext(model, batch, modes=("standard",))
    clean = ctx.clean["standard"].logits
    resid = ctx.resid("standard")
    for i in range(model.iterations + 1):
        d = model.state_depth(i)
        for pos in (-1, -4):
            out = ctx.run("standard", [Patch("resid", resid[:, ids.shape[1] + pos, d], depth=d, pos=pos)]).logits
            assert torch.equal(out, clean), (i, pos)
    # the donor's state at an iteration moves the answer (the site is live; the coda still reads own columns)
    for i in (1, model.iterations):
        d = model.state_depth(i)
        swapped = ctx.run("standard", [Patch("resid", resid[:, -1, d][batch.pair], depth=d, pos=-1)]).logits
        assert (swapped - clean).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 4])
def test_each_unrolled_block_has_its_own_cache_slot(window):
    """A cached prefix then one-token steps equal the full forward: every iteration keeps its own keys/values."""
    from engine.cache import new_cache

    model = make(window=window)
    ids, mask = ids_of(T=10)
    with torch.no_grad():
        full = model(ids, mask).logits
        cache = new_cache(model, slack=0) if window else new_cache()
        out = model(ids[:, :6], mask[:, :6], cache=cache, use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(6, 10):
            steps.append(model(ids[:, t:t + 1], mask[:, :t + 1], cache=cache, use_cache=True).logits[:, -1])
    assert len(cache.layers) == model.n_layers
    assert torch.allclose(torch.stack(steps[1:], 1), full[:, 6:], atol=1e-5)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    import json

    model = make()
    ids, mask = ids_of()
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["format_version"] == 2 and cfg["loop"] == {"prelude": 1, "core": 2, "coda": 1, "iterations": 3,
                                                         "inject": True}
    assert cfg["base_config"]["num_hidden_layers"] == 4
    from models.loading import load_model

    with pytest.raises(UserError, match="is a looped model"):
        FullBandwidthLM.from_pretrained(tmp_path / "m")
    back, _, _ = load_model(str(tmp_path / "m"))
    assert isinstance(back, LoopedLM) and back.iterations == 3
    with torch.no_grad():
        assert torch.equal(back(ids, mask).logits, model(ids, mask).logits)
    cfg["loop"]["core"] = 3  # 1 + 3 + 1 blocks for a 4-block base
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="needs a base model of 5 blocks"):
        LoopedLM.from_pretrained(tmp_path / "m")
    del cfg["loop"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="go together"):
        load_model(str(tmp_path / "m"))
    for bad in (dict(prelude=-1, core=1, coda=0, iterations=1), dict(prelude=0, core=0, coda=0, iterations=1),
                dict(prelude=0, core=1, coda=0, iterations=0)):
        with pytest.raises(UserError):
            LoopSpec(**bad)
    with pytest.raises(UserError):
        model.set_iterations(0)


def test_truncated_backpropagation_trains_the_last_iterations_and_the_prelude_through_injection():
    model = make(LoopSpec(1, 1, 1, 4)).train()
    ids, mask = ids_of()
    model.frozen_iterations = 3  # only iteration 4 keeps its graph
    loss = model(ids, mask).logits.pow(2).mean()
    loss.backward()
    assert model.blocks[0].mlp.down_proj.weight.grad is not None  # prelude: through e injected into iteration 4
    assert model.blocks[1].mlp.down_proj.weight.grad.abs().sum() > 0  # the core (iteration 4)
    assert model.adapter.weight.grad.abs().sum() > 0
    # the same loss without truncation gives other core gradients (iterations 1-3 contribute)
    g_trunc = model.blocks[1].mlp.down_proj.weight.grad.clone()
    model.zero_grad()
    model.frozen_iterations = 0
    model(ids, mask).logits.pow(2).mean().backward()
    assert not torch.allclose(model.blocks[1].mlp.down_proj.weight.grad, g_trunc)


def test_loop_modes_rerun_the_model_at_another_r_and_refuse_plain_models(tiny_model):
    from engine.modes import parse_mode
    from engine.prefill import prefill_many

    assert parse_mode("loop-8").name == "loop-8" and not parse_mode("loop-8").feeds_state
    for bad in ("loop-0", "loop-999", "loop-x"):
        with pytest.raises(UserError):
            parse_mode(bad)
    model = make(window=4)
    ids, mask = ids_of(T=10)
    res = prefill_many(model, ids, mask, ["standard", "loop-3", "loop-6"])
    assert torch.equal(res["standard"].logits, res["loop-3"].logits)  # standard = the trained r
    assert res["loop-6"].resid.shape[2] == model.spec.n_blocks + model.spec.core * 5 + 1
    assert model.iterations == 3 and model.n_layers == 8
    with looping(model, 6):
        want = model(ids, mask).logits[:, -1]
    assert torch.equal(res["loop-6"].logits[:, 0], want)
    with pytest.raises(UserError, match="has no loop"):
        prefill_many(tiny_model, ids % 30, mask, ["loop-2"])


def test_a_loop_mode_context_patches_the_unrolled_stack_exactly():
    from interventions.core import Batch, CausalContext, Patch

    model = make()
    ids, mask = ids_of(B=4, T=9)
    batch = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (5, 6))
    ctx = CausalContext(model, batch, modes=("loop-6",))  # checks the clean run against the engine, bit for bit
    assert ctx.mode == "loop-6" and model.iterations == 3
    assert ctx.n_layers == model.spec.prelude + model.spec.core * 6 + model.spec.coda
    resid = ctx.resid("loop-6")
    d = model.spec.prelude + model.spec.core * 5  # s_5
    out = ctx.run("loop-6", [Patch("resid", resid[:, -3, d], depth=d, pos=-3)]).logits
    assert torch.equal(out, ctx.clean["loop-6"].logits)
    # the unrolled blocks share their modules: a block site (one iteration's attention / MLP / head) is refused
    for site, kw in (("mlp_out", {}), ("attn_out", {}), ("head", {"head": 0})):
        with pytest.raises(UserError, match="looped model's unrolled blocks share their modules"):
            ctx.run("loop-6", [Patch(site, torch.zeros(4, model.d_model), pos=-1, layer=2, **kw)])


def test_recording_a_patched_run_reads_the_loop_modes_own_stack():
    """engine.patching.record_at_T (LEACE's patched runs) records on the patcher's own stack: at another r than the
    trained one it registered on the trained unrolling, recorded nothing, and returned the clean residual (2.2 off
    the patched run's above the patch, on tiny-loop-track)."""
    from interventions.core import Batch, CausalContext, Patch
    from interventions.erasure import run_recording

    model = make()
    ids, mask = ids_of(B=4, T=9)
    batch = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (5, 6))
    ctx = CausalContext(model, batch, modes=("loop-6",))
    clean = ctx.resid("loop-6")[:, -1]  # [B, L+1, D] at T
    d = model.spec.prelude + model.spec.core * 2  # s_2
    donor = clean[:, d][batch.pair]
    logits, resid = run_recording(ctx, "loop-6", [Patch("resid", donor, depth=d, pos=-1)])
    assert resid.shape[1] == ctx.n_layers + 1 and model.iterations == 3
    assert torch.equal(resid[:, d], donor) and torch.allclose(resid[:, :d], clean[:, :d], atol=1e-6)
    assert not torch.allclose(resid[:, d + 1], clean[:, d + 1], atol=1e-3)
    # the top of the recorded stack is what the head read: its logits are the patched run's
    with torch.no_grad():
        top = model.lm.lm_head(model.lm.model.norm(resid[:, -1]))
    assert torch.allclose(top, logits, atol=1e-5) and not torch.allclose(logits, ctx.clean["loop-6"].logits, atol=1e-3)


def test_depth_flags_are_checked_against_the_loop_modes_stack(tmp_path, capsys):
    """--erase-depths, --sweep-depth, the default --das-site (interventions.run) and --erase (probes.run) take the
    depths of the mode's own unrolling: they were checked against the trained r's stack, so a valid depth of a
    longer loop was refused and one past a shorter loop's top crashed with an IndexError."""
    import json

    from interventions.run import main
    from probes.run import main as probes

    saved_looped(tmp_path / "m", LoopSpec(1, 1, 1, 2))  # trained stack 4 blocks; loop-1: 3, loop-4: 6
    common = ["--model", str(tmp_path / "m"), "--task", "parity", "--n-pairs", "10", "--distractors", "4",
              "--control-model", "none", "--no-progress", "--max-positions", "2"]
    for argv in (["--mode", "loop-1", "--erase-depths", "4"], ["--mode", "loop-1", "--sweep-depth", "4"],
                 ["--mode", "loop-4", "--erase-depths", "7"]):
        with pytest.raises(SystemExit) as e:
            main(common + argv + ["--out", str(tmp_path / "no")])
        assert e.value.code == 2 and not (tmp_path / "no").exists()
        assert f"{argv[3]} is beyond {argv[1]}'s depth 0..{3 if argv[1] == 'loop-1' else 6}" in capsys.readouterr().err
    out = tmp_path / "rep"
    assert main(common + ["--mode", "loop-4", "--erase-depths", "6", "--sweep-depth", "5", "--das", "1",
                          "--das-steps", "2", "--out", str(out)]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert [r["name"] for r in rep["results"]["leace"]["rows"] if r["site"] == "resid"] == ["leace_resid_d6"]
    assert rep["results"]["das"]["site"]["depth"] == 3  # L // 2 of loop-4's 6
    for modes, ok in (("loop-1", False), ("standard,loop-1", False), ("loop-4", True)):
        argv = ["--task", "parity", "--model", str(tmp_path / "m"), "--modes", modes, "--distractors", "4",
                "--n-pairs", "10", "--no-progress", "--no-mdl", "--erase", "4", "--out", str(tmp_path / modes)]
        if ok:
            assert probes(argv) == 0
            doc = json.loads((tmp_path / modes / "probes.json").read_text())
            assert [r["depth"] for r in doc["erased"]] == [4, 5, 6]
        else:
            with pytest.raises(SystemExit) as e:
                probes(argv)
            assert e.value.code == 2 and "--erase 4: loop-1's depths are 0..3" in capsys.readouterr().err


def test_the_card_states_the_largest_r_a_step_draws():
    """1 + Poisson(r - 1) capped at 2r: at r = 1 every step draws 1 (Poisson(0) = 0), so the card says so instead of
    "at most 2" (it did); at r = 4 the cap is 8, and the draws reach it. One bound for the config, draw and card."""
    from dataclasses import replace

    from training.card import _objective
    from training.config import most_loop_iterations
    from training.model import loop_iterations_at
    from training.presets import get_preset

    cfg = get_preset("tiny-loop-track")
    common = dict(schedule="1", objective="multipass", depth_scale=False)
    one = " ".join(_objective(dict(common, loop_iterations=1), loop=True))
    assert "loop iterations per step 1" in one and "Poisson" not in one and "at most" not in one
    four = " ".join(_objective(dict(common, loop_iterations=4), loop=True))
    assert "loop iterations per step 1 + Poisson(3), at most 8" in four
    assert {loop_iterations_at(replace(cfg, loop_iterations=1), s) for s in range(100)} == {1}
    assert max(loop_iterations_at(cfg, s) for s in range(2000)) == most_loop_iterations(4) == 8
    assert [most_loop_iterations(r) for r in (1, 2, 3)] == [1, 4, 6]


def test_training_recipe_of_a_looped_model_is_checked_and_draws_r_per_step():
    from training.config import TrainConfig
    from training.model import build_model, loop_iterations_at
    from training.presets import get_preset

    cfg = get_preset("tiny-loop-track")
    rs = [loop_iterations_at(cfg, s) for s in range(200)]
    assert rs == [loop_iterations_at(cfg, s) for s in range(200)]  # a function of (seed, step): every process agrees
    assert min(rs) >= 1 and max(rs) <= 2 * cfg.loop_iterations and 3 <= np.mean(rs) <= 5
    model = build_model(cfg, 45)
    assert isinstance(model, LoopedLM) and model.spec == LoopSpec(2, 2, 2, 4, True) and not model.has_fusion
    assert "loop_core" in cfg.to_dict() and "loop_core" not in TrainConfig().to_dict()
    from models.looped import MAX_ITERATIONS
    from training.config import INT_LIMITS

    assert 2 * INT_LIMITS["loop_iterations"][1] == MAX_ITERATIONS  # a step draws up to 2r
    ok = dict(loop_core=2, objective="multipass", schedule="1")  # a valid looped recipe: each case breaks one rule
    TrainConfig(**ok, loop_iterations=2, loop_truncate=3)
    TrainConfig(**{**ok, "schedule": "1/0"})  # one pass, spelled with a zero-weight second (it was refused)
    TrainConfig(**ok, loop_prelude=1, loop_iterations=2, loop_truncate=1)
    for bad, msg in ((dict(loop_prelude=5), "must be at most"), (dict(objective="recurrent"), "has no fusion"),
                     (dict(schedule="60/40"), "has no fusion"), (dict(arch="gpt2"), "built from scratch as qwen3"),
                     (dict(loop_prelude=1, loop_iterations=2, loop_truncate=1, loop_inject=False), "without injection"),
                     (dict(loop_iterations=2, loop_truncate=4), "never truncates"),  # a step runs at most 2r
                     (dict(loop_iterations=1, loop_truncate=1), "never truncates"),  # r = 1: every step draws 1
                     (dict(loop_iterations=129), "loop_iterations")):  # a step could draw 258 > MAX_ITERATIONS
        with pytest.raises(UserError, match=msg):
            TrainConfig(**{**ok, **bad})
    with pytest.raises(UserError, match="describe a looped model"):
        TrainConfig(loop_prelude=1)
    from training.config import parse_lr_legs

    assert parse_lr_legs("3,6") == (3, 6)
    with pytest.raises(UserError, match="--lr-legs"):  # Python's int() reads 10
        parse_lr_legs("1_0")


@pytest.mark.parametrize("prelude", [0, 1])
def test_a_patch_of_the_prelude_output_reaches_every_injection(prelude):
    """Depth P is s_0 = e: the donor's values there at every column give the donor's logits exactly (nothing after
    the prelude reads the tokens), with or without a prelude."""
    from interventions.core import Batch, CausalContext, Patch

    model = make(LoopSpec(prelude, 2, 1, 3))
    ids, mask = ids_of(B=4, T=6)
    batch = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (5, 6))
    ctx = CausalContext(model, batch, modes=("standard",))
    resid = ctx.resid("standard")
    T, d = ids.shape[1], model.state_depth(0)
    out = ctx.run("standard", [Patch("resid", resid[:, c, d][batch.pair], depth=d, pos=c - T) for c in range(T)])
    assert torch.allclose(out.logits, ctx.clean["standard"].logits[batch.pair], atol=1e-5)


def test_the_battery_runs_on_a_looped_checkpoint_at_another_r(tmp_path):
    import json

    from interventions.run import main

    saved_looped(tmp_path / "m", LoopSpec(1, 2, 1, 2))
    out = tmp_path / "rep"
    assert main(["--model", str(tmp_path / "m"), "--task", "parity", "--mode", "loop-4", "--n-pairs", "10",
                 "--distractors", "4", "--out", str(out), "--control-model", "none", "--no-progress",
                 "--max-positions", "2", "--das", "1", "--das-steps", "2", "--das-site", "resid:7",
                 "--attribution"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["config"]["mode"] == "loop-4" and rep["model"]["n_layers"] == 6  # the trained r = 2 stack
    assert "feeds no state across positions" in rep["results"]["fed_state"]
    assert rep["results"]["layer_patching"]["modes"] == ["loop-4"]
    assert max(rep["results"]["layer_patching"]["depths"]) == 1 + 2 * 4 + 1  # the loop-4 stack
    assert rep["results"]["das"]["site"]["depth"] == 7
    assert main(["--model", str(tmp_path / "m"), "--task", "parity", "--n-pairs", "10", "--distractors", "4",
                 "--out", str(tmp_path / "default"), "--control-model", "none", "--no-progress",
                 "--max-positions", "2"]) == 0  # no --mode: the loop at its trained r (standard)
    default = json.loads((tmp_path / "default" / "causal_report.json").read_text())
    assert default["config"]["mode"] == "standard" and default["results"]["loop_iterations"]["iterations"] == 2
    at = rep["results"]["attribution"]
    assert at["sites"] == [f"d{d}" for d in range(1 + 2 * 4 + 1 + 1)]  # no fed state; every depth of loop-4
    it = rep["results"]["loop_iterations"]
    assert it["iterations"] == 4 and [r["iteration"] for r in it["rows"]] == [0, 1, 2, 3, 4]
    assert [r["depth"] for r in it["rows"]] == [1, 3, 5, 7, 9] and it["rows"][0]["state_change"] is None
    for r in it["rows"]:
        assert {"swap_T", "swap_all_positions", "mean_T"} <= set(r) and 0 <= r["lens_accuracy"] <= 1
        assert [d["alpha"] for d in r["dose_T"]] == [0.25, 0.5, 0.75] and all("follows_donor_rate" in d
                                                                               for d in r["dose_T"])
    assert "dose at T (a = 0.25 / 0.5 / 0.75)" in (out / "causal_report.md").read_text()


def test_probes_write_the_iteration_axis_and_its_heatmap(tmp_path):
    import json

    from probes.run import main

    saved_looped(tmp_path / "m", LoopSpec(1, 1, 1, 2))
    out = tmp_path / "p"
    assert main(["--task", "parity", "--model", str(tmp_path / "m"), "--modes", "standard,loop-5", "--distractors", "4",
                 "--n-pairs", "30", "--out", str(out), "--no-progress", "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["loop"] == {"prelude": 1, "core": 1, "coda": 1, "iterations": 2, "inject": True}
    loop5 = [r for r in doc["results"] if r["mode"] == "loop-5"]
    assert [r["depth"] for r in loop5] == list(range(1 + 5 + 1 + 1))  # the stack unrolled 5 times, depths 0..7
    assert [r["loop"]["iteration"] for r in loop5 if r["loop"]["part"] == "core"] == [1, 2, 3, 4, 5]
    assert max(r["depth"] for r in doc["results"] if r["mode"] == "standard") == 1 + 2 + 1  # the trained r = 2
    assert "Probe accuracy per loop iteration" in (out / "depth_curves.html").read_text()


def test_adaptive_exit_runs_each_prompt_to_its_settled_iteration():
    from engine.loops import exit_iterations
    from engine.prefill import prefill_many

    states = torch.tensor([[[1.0, 0], [2, 0], [2.001, 0], [2.001, 0]],   # settles at i = 2 (change 5e-4)
                           [[1.0, 0], [2, 0], [3, 0], [4, 0]]])          # never: R = 3
    assert exit_iterations(states, 1e-3).tolist() == [2, 3]
    model = make(window=4)
    ids, mask = ids_of(B=5, T=9)
    res = prefill_many(model, ids, mask, ["loop-8:0.5", "loop-8:1e-9"])
    r = res["loop-8:0.5"].iterations
    assert r.shape == (5,) and ((1 <= r) & (r <= 8)).all()
    assert len(set(r.tolist())) > 1  # prompts that exit at different iterations: each group run on its own
    for row, k in enumerate(r.tolist()):  # each row's answer is the model run exactly k times
        with looping(model, k), torch.no_grad():
            assert torch.allclose(res["loop-8:0.5"].logits[row, 0], model(ids[row:row + 1], mask[row:row + 1])
                                  .logits[0, -1], atol=1e-5)
    assert res["loop-8:1e-9"].iterations.tolist() == [8] * 5  # never settles that far: runs to R
    from engine.modes import parse_mode

    for bad in ("loop-8:0", "loop-8:2", "loop-8:x", "loop-8:nan"):
        with pytest.raises(UserError):
            parse_mode(bad)
    from interventions.core import Batch, CausalContext

    batch = Batch(ids[:4], mask[:4], torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]),
                  (5, 6))
    with pytest.raises(UserError, match="evaluation mode"):
        CausalContext(model, batch, modes=("loop-8:0.05",))


def test_the_verdict_names_the_first_iteration_whose_loop_state_carries_the_answer():
    from interventions.report import _loop_clause

    def row(i, t, a):
        return {"iteration": i, "swap_T": {"follows_donor_rate": t, "follows_donor_rate_ci": [t, t]},
                "swap_all_positions": {"follows_donor_rate": a, "follows_donor_rate_ci": [a, a]}}

    res = {"loop_iterations": {"mode": "loop-8", "iterations": 8,
                               "rows": [row(0, 0.1, 1.0), row(1, 0.0, 0.2), row(2, 0.5, 0.9), row(3, 0.99, 1.0)]}}
    text = _loop_clause(res)
    assert "swapped at T from iteration 3 (0.99" in text and "at every position from iteration 2 (0.90" in text
    res["loop_iterations"]["rows"] = [row(0, 0.1, 0.3), row(1, 0.2, 0.4)]
    assert "at T at no iteration (at most 0.20)" in _loop_clause(res)
    assert _loop_clause({}) == ""


def test_config_hash_tells_loop_splits_and_fusion_eps_apart(tmp_path):
    """The same tensors under another prelude / core / coda split (the same unrolled depth) or another fusion eps
    compute something else: they must not share cached activations or a run signature."""
    from models.fingerprint import config_hash, weights_hash

    a = make(LoopSpec(1, 2, 1, 3))
    b = make(LoopSpec(2, 2, 0, 3))  # 4 blocks either way, unrolled to 1 + 6 + 1 vs 2 + 6 + 0
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, V, (1, 9))
    assert weights_hash(a) == weights_hash(b) and not torch.equal(a(x).logits, b(x).logits)
    assert config_hash(a) != config_hash(b)
    saved_looped(tmp_path / "l", LoopSpec(1, 2, 1, 3))
    from models.loading import load_model

    assert config_hash(load_model(str(tmp_path / "l"))[0]) == config_hash(load_model(str(tmp_path / "l"))[0])
    torch.manual_seed(0)
    fb = FullBandwidthLM(AutoModelForCausalLM.from_config(qwen3_config(V, n_layers=2, d_model=32, n_heads=2,
                                                                       n_kv_heads=1)))
    other = copy.deepcopy(fb)
    other.fusion.norm.eps = 0.5
    assert weights_hash(fb) == weights_hash(other) and config_hash(fb) != config_hash(other)
    assert config_hash(fb.lm.config) == config_hash(fb.lm.config.to_dict())  # a bare config: as before


def test_the_activation_cache_hits_a_loop_mode_at_another_r(tmp_path):
    """The cache checked every entry against the trained r's depth count: a loop-R entry (another depth count)
    never hit, and every run collected it again."""
    from probes.collect import ActivationCache, Collector, collect_with_cache
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = qwen3_config(len(tok.get_vocab()), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1)
    model = LoopedLM(AutoModelForCausalLM.from_config(cfg), LoopSpec(1, 1, 1, 2)).eval()
    ids, samples = tokenize_samples(make_dataset("parity", 3, 4, seed=0), tok)
    col, cache = Collector(model, progress=False), ActivationCache(tmp_path / "cache")
    a, st = collect_with_cache(col, ids, samples, ["standard", "loop-5"], tok, cache)
    assert st == {"standard": "miss", "loop-5": "miss"} and a["loop-5"].shape[1] == 1 + 5 + 1 + 1
    b, st = collect_with_cache(col, ids, samples, ["standard", "loop-5"], tok, cache)
    assert st == {"standard": "hit", "loop-5": "hit"} and np.array_equal(a["loop-5"], b["loop-5"])


def test_the_every_position_swap_under_recirculation_reaches_the_recirculated_stream():
    """Under recirc-S:D:A the later tokens read each earlier column's recirculation branch; a resid patch above D is
    the normal branch's, so "swap s_i at every position" was the swap at T again (identical rows at every
    iteration above D). At a near-zero alpha the recirculated model is the loop itself: its every-position swaps
    must match the loop's (they matched the swap at T)."""
    from interventions.batch import Batch
    from interventions.core import CausalContext
    from interventions.suite import Suite
    from models.loading import load_model
    from tasks import make_dataset

    model, tok, _ = load_model("tiny-loop-track")
    batch = Batch.from_samples(make_dataset("parity", 12, 8, seed=3), tok, "parity")

    def rows(mode):
        ctx = CausalContext(model, batch, modes=[mode], check_engine=False)
        return Suite(ctx, n_boot=20).loop_iterations()["rows"]

    loop, recirc = rows("standard"), rows("recirc-10:3:0.000001")
    assert [r["depth"] for r in recirc] == [2, 4, 6, 8, 10]
    for a, b in zip(loop, recirc):
        assert b["swap_all_positions"]["follows_donor_rate"] == pytest.approx(a["swap_all_positions"]["follows_donor_rate"])
        assert b["swap_T"]["follows_donor_rate"] == pytest.approx(a["swap_T"]["follows_donor_rate"])
    assert any(r["swap_all_positions"]["follows_donor_rate"] != r["swap_T"]["follows_donor_rate"] for r in recirc[1:])
