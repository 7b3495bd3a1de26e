"""What a one-token step costs right after a long prefill, against the same step warm: why recurrent-1 / standard
(benchmarks/prefill.py, section 3) is bounded by the machine, not by the engine's bookkeeping.

Measured side by side in one process, single-threaded, on the CPU clock, rounds interleaved:

  1. a fixed bundle of --ops tiny torch ops (a [1, 1, 128] linear, a multiply and an add, repeated) timed warm
     (right after the same bundle) and cold (right after ~60 ms of something else: sleeping, a pure-Python busy
     loop, or the 1024-column standard prefill of the benchmark's model). Nothing of the engine is involved.
  2. the engine's cached one-token recurrent step (engine.prefill.recurrent_step) at column T-1 of the prefill
     benchmark's model (random Qwen3-style, 4 layers, d_model 128), with the lean step (models.lean_step) and with
     HF's own step, cold (right after a T-column prefill, as recurrent-1's step follows one; the prefill timed
     before it runs without a cache: the step's cache is filled once, before the rounds) and warm (right after
     another step).

Before the counted rounds, one round runs untimed (every bundle, prefill and step once), so that no counted
measurement is the process's first call of its kind.

Human-readable lines first; the LAST line of stdout is one JSON object with all the figures.

    python benchmarks/cold_step.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without an install

from common.cli import DefaultsFormatter, Parser, add_seed_flag, float_in, int_in  # noqa: E402
from common.errors import cli_entry  # noqa: E402
from engine.cache import new_cache  # noqa: E402
from engine.decode import step_loop  # noqa: E402
from engine.prefill import recurrent_step  # noqa: E402
from models.configs import qwen3_config  # noqa: E402
from models.full_bandwidth import FullBandwidthLM  # noqa: E402
from models.lean_step import enabled as lean_step_enabled  # noqa: E402

CLOCK = time.process_time


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/cold_step.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    p.add_argument("--rounds", type=int_in(1, 10_000), default=25,
                   help="interleaved rounds (medians are reported), 1..10000")
    p.add_argument("--ops", type=int_in(3, 1_000_000), default=300,
                   help="tiny torch ops in the bundle of section 1, a multiple of 3 in 3..1000000")
    p.add_argument("--T", type=int_in(2, 100_000), default=1024,
                   help="prompt length of the prefill before the step, 2..100000")
    p.add_argument("--gap-ms", type=float_in(0, 60_000, lo_open=True), default=60.0,
                   help="how long the sleep and the busy loop of section 1 last, in milliseconds, in (0, 60000]")
    add_seed_flag(p, "the random weights and tokens")
    a = p.parse_args(argv)
    if a.ops % 3:
        p.error(f"--ops must be a multiple of 3, got {a.ops}")
    return a


def timed(fn) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


@cli_entry
def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(1)
    cfg = qwen3_config(64, n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, max_len=max(2048, a.T))
    model = FullBandwidthLM.from_config(cfg, seed=a.seed).eval()
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(1, 64, (1, a.T), generator=g)
    mask = torch.ones_like(ids)
    x, w = torch.randn(1, 1, 128, generator=g), torch.randn(128, 128, generator=g)

    def bundle():
        for _ in range(a.ops // 3):
            F.linear(x, w).mul(2.0).add(1.0)

    def sleep():
        time.sleep(a.gap_ms / 1e3)

    def busy():
        t = time.perf_counter()
        while time.perf_counter() - t < a.gap_ms / 1e3:
            pass

    def prefill():
        model(ids, mask)

    befores = {"warm": bundle, "after_sleep": sleep, "after_busy_python": busy, "after_prefill": prefill}
    ops = {k: [] for k in befores}
    steps = {f"{kind}_{when}": [] for kind in ("lean", "hf") for when in ("cold", "warm")}
    with torch.no_grad():
        cache = new_cache(model, slack=1)
        prev = model(ids, mask, cache=cache, use_cache=True).top[:, -2]
        cache.crop(-1)

        def step():
            recurrent_step(model, ids, mask, a.T - 1, prev, cache)
            cache.crop(-1)

        with step_loop():
            for before in befores.values():  # warm-up round, untimed
                before()
                bundle()
            for kind in ("lean", "hf"):
                with lean_step_enabled(kind == "lean"):
                    prefill()
                    step()
                    step()
            for _ in range(a.rounds):
                for k, before in befores.items():
                    before()
                    ops[k].append(timed(bundle))
                for kind in ("lean", "hf"):
                    with lean_step_enabled(kind == "lean"):
                        prefill()
                        steps[f"{kind}_cold"].append(timed(step))
                        steps[f"{kind}_warm"].append(timed(step))
    ms = {k: 1e3 * statistics.median(v) for k, v in {**ops, **steps}.items()}
    print(f"model: Qwen3-style, 4 layers, d_model 128; T={a.T}; torch threads 1; clock cpu; {a.rounds} rounds")
    print(f"1. {a.ops} tiny torch ops: warm {ms['warm']:.2f} ms; after {a.gap_ms:.0f} ms asleep "
          f"{ms['after_sleep']:.2f} ms, after a busy Python loop {ms['after_busy_python']:.2f} ms, after the "
          f"prefill {ms['after_prefill']:.2f} ms ({ms['after_prefill'] / ms['warm']:.2f}x warm)")
    for kind, name in (("lean", "lean step (models.lean_step)"), ("hf", "HF's own step")):
        print(f"2. one-token step, {name}: {ms[kind + '_cold']:.2f} ms right after the prefill, "
              f"{ms[kind + '_warm']:.2f} ms warm ({ms[kind + '_cold'] / ms[kind + '_warm']:.2f}x)")
    result = {"T": a.T, "ops": a.ops, "rounds": a.rounds, "gap_ms": a.gap_ms, "threads": 1, "clock": "cpu",
              "bundle_ms": {k: ms[k] for k in ops}, "step_ms": {k: ms[k] for k in steps},
              "bundle_after_prefill_over_warm": ms["after_prefill"] / ms["warm"],
              "lean_over_hf_step_cold": ms["lean_cold"] / ms["hf_cold"],
              "lean_over_hf_step_warm": ms["lean_warm"] / ms["hf_warm"]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
