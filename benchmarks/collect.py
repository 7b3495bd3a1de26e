"""Activation-collection benchmark: nnsight collection of every depth vs a plain HF forward.

1. On the same batch (completion prompts, N distractors, equal lengths so nobody pads), time
     a) probes.collect: one nnsight trace of the prefill engine, reading block 0's input and every block's
        output at the last position (standard mode), and
     b) a plain ``model.lm(ids, output_hidden_states=True)`` forward (no nnsight),
     c) the same without the LM head, ``model.lm.base_model(ids, output_hidden_states=True)``: the collector
        reads residuals only and runs no head (``prefill_many(logits=False)``), so c) is the same work,
   as --repeats interleaved rounds (each arm in each slot in turn); headline = median of the per-round ratios
   a/b (robust to background load), goal <= 1.15, and a/c beside it. Both wall-clock and process-CPU medians
   are printed.
2. End-to-end wall time (and CPU time) of the default command ``python -m probes.run --task completion``
   in a subprocess with a fresh activation cache (goal < 180 s on 2 cores). Skipped with --skip-e2e, or when
   the default model has no checkpoint and no --model is given.

Human-readable lines first; the LAST line of stdout is one JSON object.

    python benchmarks/collect.py                     # random tiny-fbt-shaped model for part 1
    python benchmarks/collect.py --model runs/A      # a checkpoint for both parts
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without an install

from common.cli import Parser, add_model_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import cli_entry  # noqa: E402

GOAL_RATIO = 1.15
GOAL_E2E_S = 180.0
AGREE_TOL = 1e-4  # the recorded residuals against output_hidden_states


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/collect.py", description=__doc__)
    add_model_flag(p, None, " for both parts",
                   default_text="a random tiny-fbt-shaped model for part 1, the tiny-fbt checkpoint for part 2")
    p.add_argument("--batch", type=int_in(2, 100_000), default=32,
                   help="prompts in the batch (completion pairs: an even count), 2..100000 (default: %(default)s)")
    p.add_argument("--distractors", type=int_in(0, 100_000), default=32,
                   help="N: distractors per completion prompt, 0..100000 (default: %(default)s)")
    p.add_argument("--repeats", type=int_in(1, 10_000), default=15,
                   help="interleaved rounds of the three arms, 1..10000 (default: %(default)s)")
    p.add_argument("--skip-e2e", action="store_true", help="skip part 2, the end-to-end probes.run")
    add_threads_flag(p)
    a = p.parse_args(argv)
    if a.batch % 2:  # the prompts come in pairs: an odd count would silently run one fewer
        p.error(f"--batch must be even (completion pairs), got {a.batch}")
    return a


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


@cli_entry
def main(argv=None):
    a = parse_args(argv)
    set_threads(a.threads)
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from engine.prefill import pad_left
    from probes.collect import Collector
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    if a.model:
        from models.loading import load_model

        model, tok, name = load_model(a.model)
        tok = tok or build_tokenizer()
    else:
        tok = build_tokenizer()
        model, name = FullBandwidthLM.from_config(qwen3_config(len(tok)), seed=0), "random tiny-fbt-shaped"
    model = model.eval().float()
    ids_list, _ = tokenize_samples(make_dataset("completion", a.batch // 2, a.distractors, seed=0), tok)
    ids, mask = pad_left(ids_list, tok.pad_token_id or 0)
    assert bool(mask.all()), "completion prompts of one N have equal lengths"
    col = Collector(model, progress=False)

    def nnsight_run():
        col.collect_batch(ids, mask, ["standard"])

    @torch.no_grad()
    def plain_run():
        model.lm(input_ids=ids, output_hidden_states=True)

    @torch.no_grad()
    def base_run():
        model.lm.base_model(input_ids=ids, output_hidden_states=True)

    nnsight_run(), plain_run(), base_run()  # warm up
    # same numbers from both paths (depths 0..L-1; HF's last entry is after the final norm)
    got = col.collect_batch(ids, mask, ["standard"])["standard"]
    with torch.no_grad():
        hs = torch.stack(model.lm(input_ids=ids, output_hidden_states=True).hidden_states, 1)[:, :, -1]
    max_diff = float((got[:, :-1] - hs[:, :-1]).abs().max())
    arms = (nnsight_run, plain_run, base_run)
    pairs, base_t = [], []
    for r in range(a.repeats):
        t = {}
        for i in (r % 3, (r + 1) % 3, (r + 2) % 3):
            t[i] = _timed(arms[i])
        pairs.append((t[0], t[1]))
        base_t.append(t[2])
    ratio_wall = statistics.median(n[0] / p[0] for n, p in pairs)
    ratio_cpu = statistics.median(n[1] / p[1] for n, p in pairs)
    ratio_base_wall = statistics.median(n[0] / b[0] for (n, _), b in zip(pairs, base_t))
    nn_w, pl_w = statistics.median(n[0] for n, _ in pairs), statistics.median(p[0] for _, p in pairs)
    nn_c, pl_c = statistics.median(n[1] for n, _ in pairs), statistics.median(p[1] for _, p in pairs)
    ba_w = statistics.median(b[0] for b in base_t)
    print(f"model: {name}; batch {ids.shape[0]} x {ids.shape[1]} tokens; threads {torch.get_num_threads()}; "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"  nnsight collection (all {got.shape[1]} depths): {nn_w * 1e3:8.1f} ms wall  {nn_c * 1e3:8.1f} ms cpu")
    print(f"  plain forward, output_hidden_states:     {pl_w * 1e3:8.1f} ms wall  {pl_c * 1e3:8.1f} ms cpu")
    print(f"  the same without the LM head:            {ba_w * 1e3:8.1f} ms wall")
    ok = ratio_wall <= GOAL_RATIO and max_diff <= AGREE_TOL  # the same activations, or no pass
    print(f"  ratio nnsight/plain = {ratio_wall:.3f} wall, {ratio_cpu:.3f} cpu (median of {a.repeats} per-pair "
          f"ratios; goal <= {GOAL_RATIO}, activations agreeing to {AGREE_TOL:g}) {'PASS' if ok else 'FAIL'}; "
          f"max |diff| {max_diff:.2e}")
    print(f"  ratio nnsight/plain without the head (the same work) = {ratio_base_wall:.3f} wall")

    e2e = None
    target = a.model
    if target is None and (ROOT / "checkpoints" / "tiny-fbt" / "model.safetensors").is_file():
        target = "tiny-fbt"
    if not a.skip_e2e and target is not None:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, "-m", "probes.run", "--task", "completion", "--no-progress", "--out",
                   f"{d}/out", "--cache-dir", f"{d}/cache"]
            if a.model:
                cmd += ["--model", a.model]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        e2e = {"command": " ".join(cmd[1:4] + ["completion"]) + (f" --model {a.model}" if a.model else ""),
               "wall_s": wall, "cpu_s": cpu, "returncode": r.returncode,
               "pass": r.returncode == 0 and wall < GOAL_E2E_S}
        print(f"end to end `python -m probes.run --task completion`{' --model ' + a.model if a.model else ''}: "
              f"{wall:.1f} s wall, {cpu:.1f} s cpu (goal < {GOAL_E2E_S:.0f} s wall) "
              f"{'PASS' if e2e['pass'] else 'FAIL'}" + ("" if r.returncode == 0 else f"; exit {r.returncode}: "
                                                         f"{r.stderr.strip()[-200:]}"))
    else:
        print("end to end: skipped (no --model and no checkpoints/tiny-fbt)" if not a.skip_e2e
              else "end to end: skipped (--skip-e2e)")

    result = {"model": name, "batch": list(ids.shape), "threads": torch.get_num_threads(),
              "load_avg_1min": os.getloadavg()[0], "repeats": a.repeats,
              "nnsight_ms_wall": nn_w * 1e3, "plain_ms_wall": pl_w * 1e3, "nnsight_ms_cpu": nn_c * 1e3,
              "plain_ms_cpu": pl_c * 1e3, "ratio_wall": ratio_wall, "ratio_cpu": ratio_cpu,
              "plain_no_head_ms_wall": ba_w * 1e3, "ratio_no_head_wall": ratio_base_wall,
              "ratio_goal_max": GOAL_RATIO, "ratio_pass": ok, "agree_tol": AGREE_TOL, "max_abs_diff": max_diff,
              "e2e": e2e}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
