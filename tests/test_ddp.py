"""Training on several processes (DistributedDataParallel, gloo on CPU) trains what one process trains.

- in-process, no processes: the processes' shares of a micro-batch (training.data.shard, training.loss.share_of)
  add up to the global micro-batch's loss and gradients, also with fewer rows than processes;
- one 2-process torchrun launch (this file run as the workers): the DDP gradients of three steps equal one
  process's (1-pass, fixed-point 3-pass and warm 2-pass steps, three micro-batches each, one of them a single row),
  and a 5-step CLI run, then resumed on ONE process to step 6, gives the single-process run's loss trajectory and
  final weights.

Tolerances (float32, the same sums added in another order): gradients rtol 1e-4 / atol 1e-6, logged losses
1e-4 (they are rounded to 5 decimals), weights rtol 1e-4 / atol 1e-5 compared tensor by tensor over exactly what
the project's weights hash covers (models.fingerprint.weights_hash: every parameter and buffer, by name, with equal
dtypes and shapes); measured: weights within 1.3e-6, losses equal to the 5th decimal.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # a torchrun worker: this file is the script, the repository is not on the path yet
    sys.path.insert(0, str(ROOT))

import training.cli as tcli  # noqa: E402
import training.data as tdata  # noqa: E402
import training.loop as tloop  # noqa: E402
import training.loss as tloss  # noqa: E402
import training.model as tmodel  # noqa: E402
from tasks import build_tokenizer  # noqa: E402
from training.presets import get_preset  # noqa: E402

# Unpacked (three micro-batches a step, uneven row counts, a 1-row one at step 2), fixed-point starts, warm passes,
# state noise, prefix mixin and a windowed consistency loss: every term that depends on how rows are split.
RECIPE = ["--preset", "smoke", "--threads", "1", "--no-progress", "--no-packing", "--skip-values",
          "--batch-tokens", "1536", "--fixed-point-prob", "0.5", "--fixed-point-tol", "0.1",  # a Jacobi start where
          # the whole batch and a process's share of it would otherwise take different branches and stops
          "--consistency", "1", "--consistency-window", "2",
          "--steps", "6", "--eval-every", "1000", "--save-every", "1000"]
GRAD_STEPS = (0, 2, 4)  # 1-pass (the fusion unused), 3-pass from the fixed point, 2-pass after 2 warm passes
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)


def _gradients(cfg, procs) -> tuple[dict, dict]:
    """({step/param: gradient}, {step: [loss, *pass losses, *consistency]}) of GRAD_STEPS from a fresh model,
    computed as the trainer computes a step (training.loop._step_gradients), on `procs`."""
    tok = build_tokenizer()
    model = tmodel.build_model(cfg, len(tok)).train()
    net = tloop._wrap(tloss.StepLoss(model, cfg), procs)
    grads, figures = {}, {}
    for step in GRAD_STEPS:
        model.zero_grad(set_to_none=True)
        loss, parts, cons = tloop._step_gradients(net, tdata.make_batches(cfg, tok, step), cfg,
                                                  tloop.noise_generator(cfg, step), procs)
        grads.update({f"{step}/{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        figures[str(step)] = [float(loss), *map(float, parts), *(cons[j] for j in sorted(cons))]
    return grads, figures


def _worker(work: Path) -> None:
    """One of the two processes: the DDP gradients, then a 5-step training run through the CLI."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    procs = tloop.Processes.start()
    grads, figures = _gradients(tcli.config_of(tcli.parse_args(RECIPE)), procs)
    save_file(grads, str(work / f"grads{procs.rank}.safetensors"), metadata={"figures": json.dumps(figures)})
    try:
        tcli.main(RECIPE + ["--out", str(work / "run"), "--stop-at", "5"])  # in the same process group
    finally:
        procs.end()


def _cheap_eval(model, tok, cfg, context=None):  # quick_eval costs seconds on a shared CPU; its mode toggling is kept
    model.eval()
    model.train()
    return {}


# ----- the shares of one micro-batch, in one process --------------------------------------------------------------
def _grad_vector(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", ["packed", "unpacked", "recurrent", "looped"])
def test_process_shares_add_up_to_the_global_micro_batch(recipe):
    tok = build_tokenizer()
    base = replace(get_preset("smoke"), curriculum_steps=0, consistency=1.0, consistency_window=2)
    cfg, step = {
        "packed": (base, 0),  # 3 passes, state noise, prefix mixin
        "unpacked": (replace(base, packing=False, skip_values=True, batch_tokens=1536, fixed_point_prob=0.5), 2),
        "recurrent": (replace(base, objective="recurrent", tasks=("parity", "shell_game"), packing=False,
                              dense_targets=True, targets="labels", distractors={1: 1.0, 4: 1.0}, batch_tokens=600), 0),
        # a looped model (models.looped): prelude 1, core 1 iterated (r drawn per step), no fusion, one pass
        "looped": (replace(base, schedule="1", consistency=0.0, consistency_window=0, n_layers=3, loop_prelude=1,
                           loop_core=1, loop_iterations=3, tasks=("parity",), packing=False, dense_targets=True,
                           targets="labels", distractors={4: 1.0}, batch_tokens=600), 0),
    }[recipe]
    if recipe == "looped":  # the trainer sets the step's r (the same in every process) before the step
        model_r = tmodel.loop_iterations_at(cfg, step)
    model = tmodel.build_model(cfg, len(tok)).train()
    if recipe == "looped":
        model.set_iterations(model_r)
    net = tloss.StepLoss(model, cfg)
    micro = tdata.make_batches(cfg, tok, step)
    assert recipe in ("recurrent", "looped") or micro[0].k > 1  # the noise and consistency terms are really there
    if recipe == "unpacked":  # a micro-batch of fewer rows than processes: some have no row of their own
        assert min(mb.ids.shape[0] for mb in micro) < 2
    for mb in micro:
        for world in (2, 3):
            model.zero_grad(set_to_none=True)
            whole = net(mb, tloop.noise_generator(cfg, step))
            whole[0].backward()
            want = _grad_vector(model)
            model.zero_grad(set_to_none=True)
            got = None
            for rank in range(world):  # each process draws the same noise stream: a generator of its own
                part = net(tdata.shard(mb, rank, world), tloop.noise_generator(cfg, step),
                           tloss.share_of(mb, cfg, rank, world))
                part[0].backward()
                flat = [part[0], *part[1], *part[2]]
                got = flat if got is None else [a + b for a, b in zip(got, flat)]
            expect = [whole[0], *whole[1], *whole[2]]
            assert len(got) == len(expect) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                                   for a, b in zip(got, expect)), (mb.desc, world, got, expect)
            have = _grad_vector(model)
            assert have.keys() == want.keys()
            for name in want:
                assert torch.allclose(have[name], want[name], **GRAD_TOL), (mb.desc, world, name)


def test_repeat_rows_count_nothing():
    """A micro-batch of 1 row on 3 processes: rows 0, 0, 0, two of them weighted 0."""
    cfg = replace(get_preset("smoke"), packing=False, batch_tokens=64, tasks=("memory",), distractors={8: 1.0})
    (mb,) = tdata.make_batches(cfg, build_tokenizer(), 0)
    assert mb.ids.shape[0] == 1
    shares = [tloss.share_of(mb, cfg, r, 3) for r in range(3)]
    assert [s.weight for s in shares] == [0.0, 0.0, 1.0]
    assert all(torch.equal(tdata.shard(mb, r, 3).ids, mb.ids) for r in range(3))


# ----- two processes under torchrun -----------------------------------------------------------------------------
def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    work = tmp_path_factory.mktemp("ddp")
    # The timeout is a hang guard only: idle this takes ~15 s, a CPU shared with training jobs needs minutes.
    r = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", __file__, str(work)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 5 steps" in r.stdout
    return work


def test_ddp_gradients_equal_one_process_gradients(two_processes):
    from safetensors import safe_open

    ranks = []
    for rank in (0, 1):  # two processes took part (a second rank 0 would have left no grads1)
        with safe_open(str(two_processes / f"grads{rank}.safetensors"), "pt") as f:
            ranks.append(({k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["figures"])))
    torch.set_num_threads(1)
    want, want_figures = _gradients(tcli.config_of(tcli.parse_args(RECIPE)), tloop.Processes(1, 0, torch.device("cpu")))
    assert "0/fusion.up.weight" not in want and "2/fusion.up.weight" in want  # 1-pass: unused, and left so
    for grads, figures in ranks:
        assert grads.keys() == want.keys()
        for name in want:
            assert torch.allclose(grads[name], want[name], **GRAD_TOL), name
        for step in want_figures:
            assert figures[step] == pytest.approx(want_figures[step], rel=1e-5, abs=1e-6), step
    assert all(torch.equal(ranks[0][0][k], ranks[1][0][k]) for k in want)  # DDP: every process steps alike


def test_two_processes_then_one_train_as_one_process(two_processes, tmp_path, monkeypatch):
    """5 steps on 2 processes, resumed on 1 to step 6 (another world size) = 6 steps on 1 process."""
    from models.full_bandwidth import FullBandwidthLM

    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    run = two_processes / "run"
    history = json.loads((run / "train_log.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
    tcli.main(RECIPE + ["--out", str(run), "--resume"])
    tcli.main(RECIPE + ["--out", str(tmp_path / "one")])
    a = json.loads((run / "train_log.json").read_text())
    b = json.loads((tmp_path / "one" / "train_log.json").read_text())
    assert "config_changes" not in a  # the world size is not part of the recipe
    assert len(a["history"]) == len(b["history"]) == 6
    assert {h["passes"] for h in b["history"]} == {1, 2, 3}
    for x, y in zip(a["history"], b["history"]):
        assert (x["step"], x["passes"], x["batch"]) == (y["step"], y["passes"], y["batch"])
        for key in ("loss", "pass_losses", "consistency"):
            assert x.get(key) == pytest.approx(y.get(key), abs=1e-4), (x, y)
    sa = FullBandwidthLM.from_pretrained(run).state_dict()
    sb = FullBandwidthLM.from_pretrained(tmp_path / "one").state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert (sa[name].dtype, sa[name].shape) == (sb[name].dtype, sb[name].shape), name
        assert torch.allclose(sa[name], sb[name], **WEIGHT_TOL), name


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
