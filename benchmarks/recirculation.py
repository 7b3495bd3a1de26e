"""Recirculation benchmark: generation latency per token (recirculated vs base, side by side) and the speed of
sequential vs blockwise recirculated prefill.

  1. per-token greedy generation latency: base (one cached 1-token step per token) vs recirculated (one cached
     2-token step [r_{t-1}, n_t] per token: the two stacks run side by side). Per-token time = (time to generate
     N tokens - time to generate 1 token) / (N - 1), median of --repeats, base and recirculated interleaved,
     after each of the four generations has run once untimed (else the first arm timed runs cold, which skews
     the ratio most at --repeats 1).
  2. prefill of one T-token prompt: standard (no recirculation), exact sequential, blockwise with 1/2/4 passes:
     seconds and tokens/s (median of --repeats).

Default model: a random tiny Qwen3-style model (4 layers, d_model 128) that runs anywhere; `--model smollm2-135m`
(or a local HF dir) for the real one. Human-readable lines first; the LAST line is one JSON object.

    python benchmarks/recirculation.py
    python benchmarks/recirculation.py --model smollm2-135m --prompt-len 64 --new-tokens 16 --prefill-len 128
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without an install

from common.cli import (DefaultsFormatter, Parser, add_model_flag, add_threads_flag, int_in, int_list,  # noqa: E402
                        set_threads)
from common.errors import cli_entry  # noqa: E402
from engine.prefill import generate  # noqa: E402
from engine.recirculation import RecirculatedLM, parse_recirculate  # noqa: E402


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/recirculation.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    add_model_flag(p, "tiny", ", or tiny (a random 4-layer d128 Qwen3-style model)")
    p.add_argument("--recirculate", default=None,
                   help="s:d:alpha[:convex|residual][:rampN] (default: L:L//4:0.1:convex for the model's L layers)")
    p.add_argument("--prompt-len", type=int_in(1, 100_000), default=64,
                   help="prompt tokens before generating, 1..100000")
    p.add_argument("--new-tokens", type=int_in(2, 100_000), default=32,
                   help="tokens generated per timing, 2..100000")
    p.add_argument("--prefill-len", type=int_in(1, 100_000), default=256,
                   help="prompt length of the prefill comparison, 1..100000")
    p.add_argument("--passes", default="1,2,4", help="blockwise pass counts, comma-separated, each in 1..1000")
    p.add_argument("--repeats", type=int_in(1, 10_000), default=3, help="timings per measurement (median), 1..10000")
    add_threads_flag(p)
    a = p.parse_args(argv)
    a.passes = int_list(a.passes, "--passes", lo=1, hi=1000)
    return a


def _load(name):
    if name == "tiny":
        from models.configs import qwen3_config
        from models.full_bandwidth import FullBandwidthLM

        return FullBandwidthLM.from_config(qwen3_config(64, n_layers=4, d_model=128), fusion=False, seed=0).eval()
    from models.loading import load_model

    return load_model(name)[0]


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@cli_entry
def main(argv=None):
    a = parse_args(argv)
    passes = a.passes
    set_threads(a.threads)
    model = _load(a.model)
    L = model.n_layers
    spec = parse_recirculate(f"{L}:{max(1, L // 4)}:0.1:convex" if a.recirculate is None else a.recirculate, L)
    r = RecirculatedLM(model, spec)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, V, (1, a.prompt_len), generator=g)
    pm = torch.ones_like(prompt)
    print(f"model {a.model}: L={L}, D={model.d_model}; {spec.name}; threads {torch.get_num_threads()}", flush=True)

    # 1. generation latency per token
    arms = (lambda: generate(model, prompt, pm, a.new_tokens, "std"), lambda: generate(model, prompt, pm, 1, "std"),
            lambda: r.generate(prompt, pm, a.new_tokens), lambda: r.generate(prompt, pm, 1))
    for arm in arms:  # warm-up, untimed: no timed arm is the process's first call of its kind
        arm()
    base_t, rec_t = [], []
    for _ in range(a.repeats):
        bN, b1, rN, r1 = (_time(arm) for arm in arms)
        base_t.append((bN - b1) / (a.new_tokens - 1))
        rec_t.append((rN - r1) / (a.new_tokens - 1))
    gb, gr = statistics.median(base_t), statistics.median(rec_t)
    print(f"generation ms/token: base {1e3 * gb:.2f}   recirculated {1e3 * gr:.2f}   ratio {gr / gb:.2f}x", flush=True)

    # 2. prefill
    x = torch.randint(2, V, (1, a.prefill_len), generator=g)
    xm = torch.ones_like(x)
    runs = [("standard", lambda: model(x, xm)), ("sequential", lambda: r.prefill(x, xm, "sequential"))]
    runs += [(f"blockwise-{p}", (lambda p=p: r.prefill(x, xm, "blockwise", passes=p))) for p in passes]
    pre = {}
    with torch.no_grad():  # warm-up, untimed, as in section 1: no timed arm is the process's first call of its kind
        for _, fn in runs:
            fn()
    for name, fn in runs:
        with torch.no_grad():  # every arm without autograd (the standard forward recorded a graph, slowing it)
            s = statistics.median(_time(fn) for _ in range(a.repeats))
        pre[name] = {"seconds": s, "tokens_per_s": a.prefill_len / s}
        print(f"prefill T={a.prefill_len} {name:12s} {s:8.3f}s {a.prefill_len / s:9.1f} tok/s", flush=True)
    seq = pre["sequential"]["seconds"]
    summary = {"model": a.model, "n_layers": L, "d_model": model.d_model, "spec": spec.name,
               "threads": torch.get_num_threads(), "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
               "gen_ms_per_token_base": 1e3 * gb, "gen_ms_per_token_recirculated": 1e3 * gr,
               "gen_latency_ratio": gr / gb, "prefill_len": a.prefill_len, "prefill": pre,
               "blockwise_speedup_vs_sequential": {k: seq / v["seconds"] for k, v in pre.items()
                                                   if k.startswith("blockwise")},
               "sequential_over_standard": seq / pre["standard"]["seconds"]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
