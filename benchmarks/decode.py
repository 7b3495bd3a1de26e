"""What feedback costs at decode time, measured: per-token latency of `soft` vs `std` decoding, and the engine's
recurrent-full per prompt token against the plain HF cached decode step.

Measured side by side in one run (interleaved pairs, their order alternating, medians), for every --models entry
and every --batches size, on random prompt tokens (no padding), with a KV cache:

  1. decode: engine.prefill.generate(model, ids, mask, N, decoding) for decoding std and soft, --prompt-len T
     prompt tokens, --new-tokens N greedy tokens. Per-token latency = time from the start of the first decoding
     step (the model call that feeds generated token 1 back) to generate's return, / (N-1): a forward pre-hook
     on the model stamps every call, so the prefills (std: one pass; soft: recurrent-1, a pass and one step) are
     left out. Headline: soft/std, the median of the per-pair ratios. Goal <= 1.02 at SmolLM2's shape (the
     paper: two D x D matmuls per token, under 1%); informational on the other models.
  2. recurrent-full: engine.prefill.prefill(model, ids, mask, "recurrent-full", collect=False) on the same T
     tokens against the floor any sequential engine sits on: the wrapped HF decoder stepped one token at a time
     from an empty cache, `lm(ids[:, t:t+1], cache=cache, use_cache=True)` for t = 0..T-1 (transformers 5's name
     for past_key_values). Per prompt token = total / T; headline: engine/floor, the median of the per-pair
     ratios. Goal <= 1.10. Also printed: the engine's standard prefill (its first model call, cropped to one
     column afterwards) as a share of the floor, and its mean one-token step / the floor's step. The engine runs
     the LM head at the read position T alone (its earlier steps need only their top state); the floor, HF's
     causal LM, runs it at every step. So beside it, in the same rounds (each arm in each slot of a round in
     turn), the floor with the head at T alone (`lm.base_model` steps, then one `lm` step): engine / that floor
     is the engine against the same work.

Models: `smol` = a random-init FullBandwidthLM of SmolLM2-135M's shape (Llama: 30 layers, D 576, 9 heads / 3 KV
heads, head_dim 64, d_ff 1536, vocab 49152, tied embeddings; --smol-arch qwen3 builds it with the project's
Qwen3 builder, which adds QK-norm; --smol-layers shrinks it for a quick check, and the decode goal then no longer
applies); anything else is a preset name or checkpoint dir (default tiny-fbt), loaded like the other benchmarks.

Threads: one-token steps are where OpenMP contention bites (see common.cpus.sequential_threads): on a machine
with other busy processes use --threads 1 (and --clock cpu); the figures of record come from an idle machine.
Human-readable lines first; the LAST line of stdout is one JSON object with all the figures.

    python benchmarks/decode.py                                   # smol and tiny-fbt, batch 1 and 8
    python benchmarks/decode.py --threads 1 --models tiny-fbt --repeats 3 --prompt-len 32 --new-tokens 16
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without an install

from common.cli import (Parser, add_device_flags, add_seed_flag, add_threads_flag, int_in, int_list,  # noqa: E402
                        set_threads)
from common.cpus import available_cpus  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402
from common.placement import Placement  # noqa: E402
from engine.decode import step_loop  # noqa: E402
from engine.inputs import model_context  # noqa: E402
from engine.prefill import DECODINGS, generate, prefill  # noqa: E402
from models.full_bandwidth import FullBandwidthLM  # noqa: E402

GOAL_DECODE, GOAL_RECURRENT = 1.02, 1.10
SMOL = "smol"
# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): the shape only, weights are random.
SMOL_SHAPE = dict(vocab=49152, layers=30, d_model=576, heads=9, kv_heads=3, head_dim=64, d_ff=1536, max_len=8192,
                  rope_theta=100000.0, rms_norm_eps=1e-5)
assert "std" in DECODINGS and "soft" in DECODINGS


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/decode.py", description=__doc__.split("\n\n")[0],
               epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default=f"{SMOL},tiny-fbt",
                   help=f"comma-separated: '{SMOL}' (random-init SmolLM2-135M shape) and/or preset names or "
                        "checkpoint dirs with a fusion module (default: %(default)s)")
    p.add_argument("--batches", default="1,8",
                   help="comma-separated batch sizes, each in 1..4096 (default: %(default)s)")
    p.add_argument("--prompt-len", type=int_in(2, 100_000), default=64,
                   help="T: prompt tokens for decoding, and the T of recurrent-full vs the HF floor, 2..100000 "
                        "(default: %(default)s)")
    p.add_argument("--new-tokens", type=int_in(2, 100_000), default=32,
                   help="N: greedy tokens per generate call, 2..100000; N-1 decoding steps are timed "
                        "(default: %(default)s)")
    p.add_argument("--repeats", type=int_in(1, 10_000), default=5,
                   help="interleaved pairs per figure, their order alternating (recurrent-full: rounds of three arms, "
                        "each arm in each slot in turn), 1..10000 (default: %(default)s)")
    p.add_argument("--parts", default="decode,recurrent-full",
                   help="which measurements: decode, recurrent-full or both (default: %(default)s)")
    add_threads_flag(p, available_cpus(), default_text=f"{available_cpus()}, the CPUs available to this process")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="'wall': elapsed time; 'cpu': this process's CPU time, much less disturbed by other busy "
                        "processes (meaningful with --threads 1 on CPU) (default: %(default)s)")
    p.add_argument("--smol-arch", choices=("llama", "qwen3"), default="llama",
                   help="architecture of the SmolLM2-shaped model: llama (SmolLM2's own) or the project's qwen3 "
                        "builder (models.configs.qwen3_config, adds QK-norm) (default: %(default)s)")
    p.add_argument("--smol-layers", type=int_in(1, 1000), default=SMOL_SHAPE["layers"],
                   help="decoder blocks of the SmolLM2-shaped model, 1..1000; fewer for a quick check, the decode "
                        "goal then does not apply (default: %(default)s)")
    add_seed_flag(p, "the random weights and tokens")
    add_device_flags(p, dtype=False, device_map=False)
    a = p.parse_args(argv)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    if not a.models:
        p.error("--models is empty")
    a.batches = int_list(a.batches, "--batches", lo=1, hi=4096)
    a.parts = [s.strip() for s in a.parts.split(",") if s.strip()]
    bad = [s for s in a.parts if s not in ("decode", "recurrent-full")]
    if bad or not a.parts:
        p.error(f"--parts must name decode and/or recurrent-full, got {','.join(bad) or 'nothing'}")
    return a


def build_smol(a) -> FullBandwidthLM:
    s = SMOL_SHAPE
    if a.smol_arch == "qwen3":
        from models.configs import qwen3_config

        cfg = qwen3_config(s["vocab"], n_layers=a.smol_layers, d_model=s["d_model"], n_heads=s["heads"],
                           n_kv_heads=s["kv_heads"], d_ff=s["d_ff"], max_len=s["max_len"])
    else:
        from transformers import LlamaConfig

        cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d_model"], intermediate_size=s["d_ff"],
                          num_hidden_layers=a.smol_layers, num_attention_heads=s["heads"],
                          num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], hidden_act="silu",
                          max_position_embeddings=s["max_len"], rope_theta=s["rope_theta"],
                          rms_norm_eps=s["rms_norm_eps"], tie_word_embeddings=True, pad_token_id=0,
                          bos_token_id=None, eos_token_id=None)
    return FullBandwidthLM.from_config(cfg, seed=a.seed).eval()


def load(name: str, a) -> tuple[FullBandwidthLM, str]:
    if name == SMOL:
        label = f"smol ({a.smol_arch}, {a.smol_layers} layers)"
        return build_smol(a), label
    from models.loading import load_model

    model, _, label = load_model(name)
    if not model.has_fusion:
        raise UserError(f"model {name!r} has no fusion module: soft decoding and recurrent-full need one")
    return model.float().eval(), label


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CallClock:
    """Stamps the start of every call of `module` (a forward pre-hook); `with` removes the hook."""

    def __init__(self, module: torch.nn.Module, device: torch.device, clock):
        self.stamps: list[float] = []
        self.device, self.clock = device, clock
        self.handle = module.register_forward_pre_hook(self._pre)

    def _pre(self, mod, args):
        sync(self.device)
        self.stamps.append(self.clock())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(num, den))


def bench_decode(model, ids, mask, a, device, clock) -> dict:
    N = a.new_tokens
    with CallClock(model, device, clock) as cc:
        def per_token(decoding: str) -> float:
            cc.stamps.clear()
            generate(model, ids, mask, N, decoding)
            sync(device)
            end = clock()
            if len(cc.stamps) < N:  # at least one prefill call + N-1 decoding steps
                raise RuntimeError(f"generate made {len(cc.stamps)} model calls for {N} tokens: the hook missed some")
            return (end - cc.stamps[-(N - 1)]) / (N - 1)

        for d in ("std", "soft"):  # warm-up
            generate(model, ids[:, -8:], mask[:, -8:], 4, d)
        times = {"std": [], "soft": []}
        for r in range(a.repeats):
            for d in (("std", "soft") if r % 2 == 0 else ("soft", "std")):
                times[d].append(per_token(d))
    std, soft = statistics.median(times["std"]), statistics.median(times["soft"])
    return {"std_ms_per_token": std * 1e3, "soft_ms_per_token": soft * 1e3,
            "soft_over_std": median_ratio(times["soft"], times["std"]), "soft_over_std_ratio_of_medians": soft / std,
            "soft_over_std_ratio_of_minima": min(times["soft"]) / min(times["std"]),
            "std_runs_ms": [round(t * 1e3, 4) for t in times["std"]],
            "soft_runs_ms": [round(t * 1e3, 4) for t in times["soft"]]}


def bench_recurrent(model, ids, mask, a, device, clock) -> dict:
    T = ids.shape[1]
    lm = model.lm

    # The floor's steps run under the engine's own loop settings (engine.decode.step_loop: one thread and
    # inference_mode, ~12% less per-op overhead), so that engine / floor measures the engine's step, not the mode.
    @torch.no_grad()
    def floor(ids_: torch.Tensor) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=lm.config)
        with step_loop():
            for t in range(ids_.shape[1]):
                lm(ids_[:, t:t + 1], cache=cache, use_cache=True)

    @torch.no_grad()
    def floor_head_at_T(ids_: torch.Tensor) -> None:
        # The same steps with the LM head at the last one only (HF's base model before it): what the engine
        # runs when it reads T alone (engine.prefill.recurrent_steps' `logits_at`). No hook on the base model:
        # the engine calls it too, and a hook there takes the engine off its lean step.
        from transformers import DynamicCache

        cache = DynamicCache(config=lm.config)
        with step_loop():
            for t in range(ids_.shape[1] - 1):
                lm.base_model(ids_[:, t:t + 1], cache=cache, use_cache=True)
            lm(ids_[:, -1:], cache=cache, use_cache=True)

    # Both sides carry one pre-hook per one-token step: the engine's on the wrapper (which it calls), the floor's
    # on the HF model (which the engine never calls; it runs lm.base_model and the LM head itself).
    with CallClock(model, device, clock) as eng, CallClock(lm, device, clock) as hf:
        def time_engine() -> tuple[float, float, float]:
            eng.stamps.clear()
            t0 = clock()
            prefill(model, ids, mask, "recurrent-full", collect=False)
            sync(device)
            end = clock()
            if len(eng.stamps) != T:  # one standard prefill + T-1 one-token steps
                raise RuntimeError(f"recurrent-full made {len(eng.stamps)} model calls for T={T}, expected {T}")
            return end - t0, eng.stamps[1] - eng.stamps[0], (end - eng.stamps[1]) / (T - 1)

        def time_floor(run=floor) -> float:
            hf.stamps.clear()
            sync(device)
            t0 = clock()
            run(ids)
            sync(device)
            return clock() - t0

        prefill(model, ids[:, -8:], mask[:, -8:], "recurrent-full", collect=False)  # warm-up
        floor(ids[:, -8:]), floor_head_at_T(ids[:, -8:])
        t_eng, t_pre, t_step, t_hf, t_hf_T = [], [], [], [], []
        sides = ("floor", "engine", "floor_T")
        for r in range(a.repeats):
            for side in sides[r % 3:] + sides[:r % 3]:  # each arm in each slot of the round in turn
                if side == "floor":
                    t_hf.append(time_floor())
                elif side == "floor_T":
                    t_hf_T.append(time_floor(floor_head_at_T))
                else:
                    total, pre, step = time_engine()
                    t_eng.append(total), t_pre.append(pre), t_step.append(step)
    e, h = statistics.median(t_eng), statistics.median(t_hf)
    hf_step = h / T
    return {"hf_ms_per_token": h / T * 1e3, "engine_ms_per_token": e / T * 1e3,
            "engine_over_hf": median_ratio(t_eng, t_hf), "engine_over_hf_ratio_of_medians": e / h,
            "engine_over_hf_ratio_of_minima": min(t_eng) / min(t_hf),
            "hf_head_at_T_ms_per_token": statistics.median(t_hf_T) / T * 1e3,
            "engine_over_hf_head_at_T": median_ratio(t_eng, t_hf_T),
            "engine_prefill_ms": statistics.median(t_pre) * 1e3,
            "engine_prefill_share_of_floor": statistics.median(p / f for p, f in zip(t_pre, t_hf)),
            "engine_step_ms": statistics.median(t_step) * 1e3,
            "engine_step_over_hf_step": statistics.median(s / (f / T) for s, f in zip(t_step, t_hf)),
            "hf_step_ms": hf_step * 1e3,
            "engine_runs_ms": [round(t * 1e3, 3) for t in t_eng], "hf_runs_ms": [round(t * 1e3, 3) for t in t_hf]}


def verdict(x: float, goal: float | None) -> str:
    return "" if goal is None else ("PASS" if x <= goal else "FAIL")


@cli_entry
def main(argv=None) -> dict:
    a = parse_args(argv)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    a.threads = set_threads(a.threads)
    device = Placement.from_args(a).torch_device
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"torch threads {torch.get_num_threads()}; clock {a.clock}; device {device}; T={a.prompt_len} prompt "
          f"tokens, N={a.new_tokens} new tokens; {a.repeats} interleaved pairs per figure")
    if load_before is not None:
        print(f"load average before the run: {load_before:.2f} on {os.cpu_count()} CPUs (other processes inflate "
              "and scatter the timings; with busy cores prefer --threads 1)")
        if a.threads > 1 and load_before >= 0.5 and device.type == "cpu":
            print(f"WARNING: {a.threads} threads on a machine with other load: one-token steps split across "
                  "OpenMP threads wait for descheduled workers and run 10-100x slow (measured), which swamps "
                  "every ratio below; rerun with --threads 1")
    loaded = []  # every model first: a bad name or length fails before any measurement
    for name in a.models:
        model, label = load(name, a)
        ctx = model_context(model)  # the engine's own rule (engine.decode.check_generation): the last new token
        if ctx is not None and a.prompt_len + a.new_tokens - 1 > ctx:  # is never fed back; a windowed model: none
            raise UserError(f"--prompt-len + --new-tokens - 1 = {a.prompt_len + a.new_tokens - 1} exceeds {label}'s "
                            f"context ({ctx})")
        loaded.append((name, label, model.to(device)))
    g = torch.Generator().manual_seed(a.seed)
    decode_rows, rec_rows = [], []
    for name, label, model in loaded:
        full_smol = name == SMOL and a.smol_layers == SMOL_SHAPE["layers"]
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\nmodel {label}: {model.n_layers} layers, D {model.d_model}, vocab {model.config.vocab_size}, "
              f"{n_params / 1e6:.1f}M params")
        for B in a.batches:
            ids = torch.randint(1, model.config.vocab_size, (B, a.prompt_len), generator=g).to(device)
            mask = torch.ones_like(ids)
            base = {"model": name, "label": label, "batch": B}
            if "decode" in a.parts:
                r = {**base, **bench_decode(model, ids, mask, a, device, clock)}
                r["goal_max"] = GOAL_DECODE if full_smol else None
                r["pass"] = None if r["goal_max"] is None else r["soft_over_std"] <= GOAL_DECODE
                decode_rows.append(r)
                print(f"  decode     batch {B:3d}: std {r['std_ms_per_token']:9.3f} ms/token   soft "
                      f"{r['soft_ms_per_token']:9.3f} ms/token   soft/std {r['soft_over_std']:.3f} (ratio of medians "
                      f"{r['soft_over_std_ratio_of_medians']:.3f}, of minima {r['soft_over_std_ratio_of_minima']:.3f})"
                      f"  {'goal <= %.2f ' % GOAL_DECODE + verdict(r['soft_over_std'], r['goal_max']) if r['goal_max'] else ''}")
            if "recurrent-full" in a.parts:
                r = {**base, **bench_recurrent(model, ids, mask, a, device, clock)}
                r["goal_max"], r["pass"] = GOAL_RECURRENT, r["engine_over_hf"] <= GOAL_RECURRENT
                rec_rows.append(r)
                print(f"  recurrent  batch {B:3d}: HF floor {r['hf_ms_per_token']:9.3f} ms/token   recurrent-full "
                      f"{r['engine_ms_per_token']:9.3f} ms/token   engine/floor {r['engine_over_hf']:.3f} (ratio of "
                      f"medians {r['engine_over_hf_ratio_of_medians']:.3f}, of minima "
                      f"{r['engine_over_hf_ratio_of_minima']:.3f})  goal <= {GOAL_RECURRENT:.2f} "
                      f"{verdict(r['engine_over_hf'], GOAL_RECURRENT)}")
                print(f"             of which: standard prefill {r['engine_prefill_ms']:.2f} ms = "
                      f"{100 * r['engine_prefill_share_of_floor']:.1f}% of the floor; one-token step "
                      f"{r['engine_step_ms']:.3f} ms = {r['engine_step_over_hf_step']:.3f} x the floor's "
                      f"{r['hf_step_ms']:.3f} ms")
                print(f"             the floor with the head at T alone {r['hf_head_at_T_ms_per_token']:.3f} ms/token: "
                      f"engine / it {r['engine_over_hf_head_at_T']:.3f}")

    print("\nsummary (median of per-pair ratios)")
    print(f"  {'model':32s} {'batch':>5s} {'soft/std':>9s} {'rf/floor':>9s}")
    keys = [(r["label"], r["batch"]) for r in decode_rows + rec_rows]
    for key in dict.fromkeys(keys):
        d = next((r for r in decode_rows if (r["label"], r["batch"]) == key), None)
        e = next((r for r in rec_rows if (r["label"], r["batch"]) == key), None)
        fmt = lambda r, k: f"{r[k]:9.3f}" if r else f"{'-':>9s}"  # noqa: E731
        print(f"  {key[0]:32s} {key[1]:5d} {fmt(d, 'soft_over_std')} {fmt(e, 'engine_over_hf')}")
    judged_d = [r["pass"] for r in decode_rows if r["pass"] is not None]
    result = {
        "benchmark": "decode", "threads": torch.get_num_threads(), "clock": a.clock, "device": str(device),
        "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "repeats": a.repeats, "smol_arch": a.smol_arch,
        "smol_layers": a.smol_layers, "seed": a.seed, "load_avg_1min_before": load_before,
        "load_avg_1min_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "decode_goal_max": GOAL_DECODE, "recurrent_full_goal_max": GOAL_RECURRENT,
        "soft_over_std": {f"{r['model']}/b{r['batch']}": round(r["soft_over_std"], 4) for r in decode_rows},
        "recurrent_full_over_hf": {f"{r['model']}/b{r['batch']}": round(r["engine_over_hf"], 4) for r in rec_rows},
        "decode_pass": all(judged_d) if judged_d else None,
        "recurrent_full_pass": all(r["pass"] for r in rec_rows) if rec_rows else None,
        "decode": decode_rows, "recurrent_full": rec_rows,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
