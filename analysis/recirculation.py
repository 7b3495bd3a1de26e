"""Recirculation study on a real pretrained model (SPEC section 6): `python -m analysis.recirculation`.

Default: SmolLM2-135M-Instruct (preset `smollm2-135m`) on English text that ships with every CPython
(`pydoc_data/topics.py`: the language reference topics), cut into fixed-length chunks. Topics are split into a
*tuning* half and a *held-out* half (disjoint documents); every choice (layer pair, mode, alpha, temperatures) is
made on the tuning split and every reported number is measured on the held-out split.

Experiments (figures + one results.json under --out, default figures/<model>/recirculation/):
  a. heatmap.html   source x target perplexity change at fixed --alpha, convex and residual (tuning split,
                    plus held-out values of the chosen cell)
  b. dose.html      alpha from 0 to the failure point for the chosen pair: perplexity change and the mean KL
                    divergence KL(base || recirculated) of the next-token distributions (held-out)
  c. temperature.html  temperature-only vs recirculation-only vs both (temperatures tuned on the tuning split)
  d. basis.html     z_s injected as is vs after a small rotation vs after a Haar-random orthogonal rotation
  e. cost.html      sequential vs blockwise prefill: wall time, peak RSS increase, tokens/s, perplexity gap
  f. mediation.html (opt-in, --mediation) on a synthetic task (tasks/): a linear probe (probes.linear.LinearProbe)
                    fitted on the base model's depth-s state at the last position of the TRAINING groups gives the
                    task-state direction; recirculation is then applied fully, only within that subspace, only in
                    its orthogonal complement, or only within a random subspace of equal rank; reported: label
                    logit difference LD = logit(true) - logit(other) and accuracy on the HELD-OUT groups.
                    --mediation-only runs (f) alone, e.g. on the 1-pass-trained tiny-base, which (unlike
                    SmolLM2-135M) solves the tasks; results under figures/<model>/mediation-<task>/.

Perplexity change = 100 * (ppl_recirculated / ppl_base - 1) in percent (negative = better); the base is the same
model's ordinary forward on the same chunks. All recirculated runs use the exact sequential engine except the
blockwise rows of (e).

Budget: the defaults (4 + 4 chunks of 64 tokens, a 3 x 3 source/target grid, 5 alphas) make ~40 sequential runs
of 256 tokens; on SmolLM2-135M one such run took ~9 s on an otherwise idle 2-core machine, so the default run is
~6-8 minutes. Enlarge with --seq-len, --n-tune/--n-test, --pairs, --alphas, --passes.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import Parser, float_in, float_list, int_in, int_list, output_dir, safe_name
from common.errors import UserError, cli_entry
from common.io import DirLock, atomic_write, json_text, remove_owned, remove_stale_tmp

ROOT = Path(__file__).resolve().parent.parent


# ----- text ---------------------------------------------------------------------------------------------------
def builtin_documents() -> list[tuple[str, str]]:
    """(name, text) documents that exist offline on any machine with CPython: the pydoc topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        topics = {}
    docs = [(f"pydoc:{k}", v) for k, v in sorted(topics.items()) if len(v) > 400]
    if not docs:
        raise UserError("no built-in English text found (pydoc_data.topics is missing): pass --text FILE...")
    return docs


def file_documents(paths: list[str]) -> list[tuple[str, str]]:
    docs = []
    for p in paths:
        f = Path(p)
        if not f.is_file():
            raise UserError(f"--text: no such file {p}")
        text = f.read_text(errors="replace")
        if not text.strip():
            raise UserError(f"--text: {p} is empty")
        docs.append((str(f), text))
    return docs


def make_splits(docs, tokenizer, seq_len: int, n_tune: int, n_test: int, seed: int = 0):
    """Chunks of seq_len token ids: ([tune chunks], [held-out chunks]), from disjoint documents when possible."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    halves: list[list[list[int]]] = [[], []]
    for i, di in enumerate(order):
        ids = tokenizer(docs[di][1], add_special_tokens=False)["input_ids"]
        chunks = [ids[j:j + seq_len] for j in range(0, len(ids) - seq_len + 1, seq_len)]
        if len(docs) == 1:  # one file: first half of its chunks tunes, the second half is held out
            h = len(chunks) // 2
            halves[0] += chunks[:h]
            halves[1] += chunks[h:]
        else:
            halves[i % 2] += chunks
    for h in halves:
        rng.shuffle(h)
    tune, test = halves[0][:n_tune], halves[1][:n_test]
    if len(tune) < n_tune or len(test) < n_test:
        raise UserError(f"not enough text for {n_tune} + {n_test} chunks of {seq_len} tokens "
                        f"(got {len(tune)} + {len(test)}): pass more --text or lower --seq-len / --n-tune / --n-test")
    return torch.tensor(tune), torch.tensor(test)


class ByteTokenizer:
    """Stand-in tokenizer for the random smoke-test models: bytes folded into the model's vocabulary."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + b % (self.vocab - 2) for b in text.encode()]}


# ----- model ------------------------------------------------------------------------------------------------
TINY = ("tiny-random-qwen3", "tiny-random-gpt2")


def load(name: str):
    """(FullBandwidthLM without fusion, tokenizer, name). `tiny-random-*`: random tiny models for smoke tests."""
    if name in TINY:
        from models.configs import gpt2_config, qwen3_config
        from models.full_bandwidth import FullBandwidthLM

        build = qwen3_config if name.endswith("qwen3") else gpt2_config
        cfg = build(64, n_layers=4, d_model=32, n_heads=2, **({"n_kv_heads": 1} if name.endswith("qwen3") else {}))
        return FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval(), ByteTokenizer(64), name
    from models.presets import load_model

    model, tok, mname = load_model(name)
    if model.has_fusion:
        # Recirculation never fuses: it runs the plain (standard-prefill) path, so a checkpoint's fusion module
        # is simply unused. For a 1-pass-trained checkpoint (tiny-base) that IS the model it was trained as.
        from models.full_bandwidth import FullBandwidthLM
        print(f"note: {mname} has a fusion module; recirculation runs its plain path and never uses it", flush=True)
        model = FullBandwidthLM(model.lm, fusion=False).eval()
    if tok is None:
        raise UserError(f"{name} has no tokenizer (tokenizer.json) next to it")
    return model, tok, mname


# ----- evaluation -------------------------------------------------------------------------------------------
@dataclass
class Eval:
    nll: float  # mean next-token NLL at temperature 1
    nll_t: dict  # temperature -> mean NLL
    kl: float | None  # mean KL(base || this) of next-token distributions
    seconds: float
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


class Evaluator:
    """Runs configurations over fixed chunks; caches the base model's log-probs for KL."""

    def __init__(self, model, data: torch.Tensor, batch: int, temps: list[float]):
        self.model, self.data, self.batch, self.temps = model, data, batch, temps
        self._base_lp: list[torch.Tensor] | None = None
        self.base = self.run(None)

    def _batches(self):
        for i in range(0, len(self.data), self.batch):
            yield i // self.batch, self.data[i:i + self.batch]

    @torch.no_grad()
    def run(self, rlm, method: str = "sequential", passes: int = 2, block: int | None = None) -> Eval:
        keep = self._base_lp is None and rlm is None
        lps = [] if keep else None
        tot = {t: 0.0 for t in self.temps}
        tot1, kl, n = 0.0, 0.0, 0
        t0 = time.perf_counter()
        for bi, ids in self._batches():
            mask = torch.ones_like(ids)
            if rlm is None:
                logits = self.model(ids, mask).logits
            else:
                logits = rlm.prefill(ids, mask, method=method, passes=passes, block=block).logits
            logits, tgt = logits[:, :-1].float(), ids[:, 1:]
            lp = logits.log_softmax(-1)
            tot1 += float(-lp.gather(-1, tgt[..., None]).sum())
            for t in self.temps:
                lpt = (logits / t).log_softmax(-1)
                tot[t] += float(-lpt.gather(-1, tgt[..., None]).sum())
            if keep:
                lps.append(lp)
            elif self._base_lp is not None:
                b = self._base_lp[bi]
                kl += float((b.exp() * (b - lp)).sum())
            n += tgt.numel()
        secs = time.perf_counter() - t0
        if keep:
            self._base_lp = lps
        return Eval(tot1 / n, {t: v / n for t, v in tot.items()}, None if keep else kl / n, secs, n)


def pct(e: Eval, base: Eval) -> float:
    return 100.0 * (math.exp(e.nll - base.nll) - 1.0)


class PeakRSS:
    """Samples this process's resident set size in a thread; `peak_mb` = max increase over the start."""

    def __init__(self, every: float = 0.005):
        self.every, self.peak, self.start, self._stop = every, 0, 0, threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def __enter__(self):
        self.start = self.peak = self.rss()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20


# ----- CLI --------------------------------------------------------------------------------------------------
def _pairs(s: str) -> list[tuple[int, int]]:
    from models.recirculation import RecircSpec

    out = []
    for part in s.split(","):
        try:
            a, b = part.split(":")
            pair = (int(a), int(b))
        except ValueError:
            raise UserError(f"--pairs: expected s:d[,s:d...], got {part!r}") from None
        RecircSpec(pair[0], pair[1], 0.1)  # s > d, d >= 0
        if pair not in out:  # a repeated pair is one heatmap cell
            out.append(pair)
    return out


def default_pairs(L: int) -> list[tuple[int, int]]:
    srcs = sorted({L, round(2 * L / 3), round(L / 3)})
    tgts = sorted({max(1, round(L / 15)), round(L / 4), round(L / 2)})
    return [(s, d) for s in srcs for d in tgts if s > d]


# Size bounds of the numeric flags, checked when the arguments are parsed (before anything loads).
MAX_SEQ_LEN = 4096
MAX_CHUNKS = 1000  # --n-tune / --n-test
MAX_BATCH = 1024
MAX_PASSES = 1000  # blockwise Jacobi passes of (e); passes >= the block size is already exact
MAX_PAIRS = 5000  # --mediation-pairs
MAX_DISTRACTORS = 1024
MAX_THREADS = 1024
MAX_SEED = 2**31 - 1
MAX_TEMP = 100.0
OUTPUTS = ("results.json", "heatmap.html", "dose.html", "temperature.html", "basis.html", "cost.html",
           "mediation.html")


def parse_args(argv=None):
    p = Parser(prog="python -m analysis.recirculation", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="model: smollm2-135m, a local HF model dir, or tiny-random-qwen3/-gpt2 (smoke tests)")
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="English text files to use instead of the built-in CPython pydoc topics (one document "
                        "per file; with one file its first half tunes and the second half is held out)")
    p.add_argument("--out", help="output folder (default figures/<model>/recirculation)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing results folder")
    p.add_argument("--seq-len", type=int_in(2, MAX_SEQ_LEN), default=64,
                   help=f"tokens per chunk (one chunk = one sequence), 2..{MAX_SEQ_LEN}")
    p.add_argument("--n-tune", type=int_in(1, MAX_CHUNKS), default=4,
                   help=f"chunks in the tuning split, 1..{MAX_CHUNKS}")
    p.add_argument("--n-test", type=int_in(1, MAX_CHUNKS), default=4,
                   help=f"chunks in the held-out split, 1..{MAX_CHUNKS}")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=4, help=f"chunks per forward batch, 1..{MAX_BATCH}")
    p.add_argument("--pairs", help="source:target depth pairs for the heatmap, comma-separated "
                                   "(default: a coarse 3x3 grid over L/3, 2L/3, L and ~L/15, L/4, L/2)")
    p.add_argument("--alpha", type=float_in(0, 1), default=0.1, help="alpha of the heatmap, in [0, 1]")
    p.add_argument("--alphas", default="0.05,0.1,0.2,0.4,1.0",
                   help="dose-response alphas, each in [0, 1] (0 is added); tuning picks the best on the tuning "
                        "split")
    p.add_argument("--fail", type=float_in(0), default=5.0,
                   help="failure point: the first alpha whose held-out perplexity change exceeds this many percent "
                        "(a finite number >= 0)")
    p.add_argument("--temps", default="0.8,0.9,0.95,1.0,1.05,1.1,1.2",
                   help=f"temperatures tried for (c), each in (0, {MAX_TEMP:g}]")
    p.add_argument("--small-angle", type=float_in(0, math.pi), default=0.1,
                   help="radians a typical vector is turned by the 'small rotation' of (d), in [0, pi]")
    p.add_argument("--passes", default="1,2", help=f"blockwise Jacobi passes compared in (e), each in 1..{MAX_PASSES}")
    p.add_argument("--cost-block", type=int_in(0, MAX_SEQ_LEN), default=0,
                   help=f"block size for blockwise in (e), 0..{MAX_SEQ_LEN}; 0 = whole chunk")
    p.add_argument("--ramp", type=int_in(0, MAX_SEQ_LEN), default=0,
                   help=f"early-token ramp length for every recirculated run, 0..{MAX_SEQ_LEN}")
    p.add_argument("--mediation", action="store_true", help="run the mediation experiment (f) as well")
    p.add_argument("--mediation-only", action="store_true",
                   help="run only (f), without the text experiments (for models trained on the tasks, e.g. "
                        "tiny-base, which solve them; results go to figures/<model>/mediation-<task>)")
    p.add_argument("--mediation-spec", metavar="S:D:ALPHA[:MODE]",
                   help="recirculation of (f); default: the text-tuned best, or with --mediation-only the pair and "
                        "mode (--pairs x convex/residual, at --alpha) whose full recirculation moves the label logit "
                        "difference most on the TRAINING groups")
    p.add_argument("--mediation-task", default="memory", help="synthetic task of (f)")
    p.add_argument("--mediation-pairs", type=int_in(1, MAX_PAIRS), default=16,
                   help=f"sample pairs of (f) (half the groups held out), 1..{MAX_PAIRS}")
    p.add_argument("--mediation-distractors", type=int_in(0, MAX_DISTRACTORS), default=8,
                   help=f"distractor lines per prompt in (f), 0..{MAX_DISTRACTORS}")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=0,
                   help=f"torch threads, 0..{MAX_THREADS} (0 = torch's default)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help=f"seed of the split and of the random rotations, 0..{MAX_SEED}")
    return p.parse_args(argv)


def _html(fig, path: Path):
    atomic_write(path, lambda tmp: fig.write_html(str(tmp), full_html=True,
                                                  include_plotlyjs="cdn" if os.environ.get("FBPROBE_PLOTLY_CDN")
                                                  else True))


def _results_text(res: dict) -> str:
    try:
        return json_text(res, indent=2, default=str)
    except ValueError:
        raise UserError("the results contain NaN or inf (a diverged run?); refusing to write invalid JSON") from None


def _write_results(res: dict, out: Path, write_figures_) -> None:
    """Figures, then results.json (it marks a complete run); then an earlier run's files this run did not
    write are removed (under --overwrite), so the folder holds one run. Invalid JSON is refused first."""
    text = _results_text(res)  # checked before any file is touched
    written = set(write_figures_())
    atomic_write(out / "results.json", text)
    remove_owned(out, OUTPUTS, keep=written | {"results.json"})


@cli_entry
def main(argv=None):
    a = parse_args(argv)
    # --- everything that can be refused is checked before anything loads or any file is touched
    if not a.model.strip():
        raise UserError("--model is empty")
    alphas = sorted({0.0} | set(float_list(a.alphas, "--alphas", 0, 1)))
    temps = sorted(set(float_list(a.temps, "--temps", 0, MAX_TEMP)) | {1.0})
    if any(t <= 0 for t in temps):
        raise UserError("--temps must be positive")
    passes_list = int_list(a.passes, "--passes", 1, MAX_PASSES)
    pairs = _pairs(a.pairs) if a.pairs else None
    from tasks import TASKS
    if a.mediation_task not in TASKS:
        raise UserError(f"--mediation-task: unknown task {a.mediation_task!r} (known: {', '.join(TASKS)})")
    if a.mediation_spec:
        from models.recirculation import parse_recirculate
        parse_recirculate(a.mediation_spec)  # syntax and alpha now; the depths once the model is known
    docs = file_documents(a.text) if a.text else None
    sub = f"mediation-{a.mediation_task}" if a.mediation_only else "recirculation"
    out = output_dir(a.out if a.out is not None else ROOT / "figures" / safe_name(a.model) / sub)

    def refuse_existing():
        if not a.overwrite and any((out / f).exists() for f in OUTPUTS):
            raise UserError(f"{out} already holds results: pass --overwrite to replace them")

    refuse_existing()
    with DirLock(out, "analysis.recirculation run"):
        refuse_existing()  # again under the lock: another run may have finished meanwhile
        remove_stale_tmp(out)
        return _run(a, argv, out, alphas, temps, passes_list, pairs, docs)


def _run(a, argv, out: Path, alphas, temps, passes_list, pairs, docs):
    if a.threads:
        torch.set_num_threads(a.threads)

    from models.recirculation import RecircSpec, RecirculatedLM, random_rotation

    model, tok, mname = load(a.model)
    L = model.n_layers
    pairs = pairs or default_pairs(L)
    for s, d in pairs:
        RecircSpec(s, d, a.alpha).validate(L)
    med_spec = None
    if a.mediation_spec:
        from models.recirculation import parse_recirculate
        med_spec = parse_recirculate(a.mediation_spec, L)
    if a.mediation_only:
        t_start = time.perf_counter()
        # Tuned over pairs x modes at the one --alpha: tuning alpha by effect size would just pick the most
        # destructive dose (alpha = 1 convex replaces z_d outright).
        cands = [med_spec] if med_spec else [RecircSpec(s, d, a.alpha, mode, ramp=a.ramp) for s, d in pairs
                                             for mode in ("convex", "residual")]
        res = {"model": mname, "n_layers": L, "d_model": model.d_model,
               "mediation": mediation(model, tok, cands, a.mediation_task, a.mediation_pairs,
                                      a.mediation_distractors, a.batch, a.seed)}
        res["seconds_total"] = time.perf_counter() - t_start
        res["command"] = "python -m analysis.recirculation " + " ".join(argv if argv is not None else
                                                                         __import__("sys").argv[1:])
        _write_results(res, out, lambda: [_mediation_figure(res["mediation"], out) or "mediation.html"])
        print(f"wrote {out}/results.json and mediation.html ({res['seconds_total']:.0f}s)")
        return res
    docs = docs or builtin_documents()
    tune, test = make_splits(docs, tok, a.seq_len, a.n_tune, a.n_test, a.seed)
    print(f"model {mname}: L={L}, D={model.d_model}; {len(tune)}+{len(test)} chunks x {a.seq_len} tokens; "
          f"pairs {pairs}", flush=True)
    t_start = time.perf_counter()
    E_tune = Evaluator(model, tune, a.batch, temps)
    E_test = Evaluator(model, test, a.batch, temps)

    def spec(s, d, alpha, mode, **kw):
        return RecircSpec(s, d, float(alpha), mode, ramp=a.ramp, **kw)

    def rlm(sp):
        return RecirculatedLM(model, sp)

    res: dict = {"model": mname, "n_layers": L, "d_model": model.d_model, "seq_len": a.seq_len,
                 "n_tune_chunks": len(tune), "n_test_chunks": len(test), "text": a.text or "pydoc_data.topics",
                 "ramp": a.ramp, "base": {"tune_ppl": E_tune.base.ppl, "test_ppl": E_test.base.ppl},
                 "mediation": "not run (pass --mediation)"}

    # (a) heatmap on the tuning split
    heat = {}
    for mode in ("convex", "residual"):
        for s, d in pairs:
            e = E_tune.run(rlm(spec(s, d, a.alpha, mode)))
            heat[(mode, s, d)] = pct(e, E_tune.base)
            print(f"[a] {mode:8s} s={s:2d} d={d:2d} alpha={a.alpha}: tune ppl change {heat[(mode, s, d)]:+.2f}% "
                  f"({e.seconds:.1f}s)", flush=True)
    best_mode, best_s, best_d = min(heat, key=heat.get)
    res["heatmap"] = {"alpha": a.alpha, "split": "tune",
                      "cells": [{"mode": m, "source": s, "target": d, "ppl_change_pct": v}
                                for (m, s, d), v in heat.items()]}

    # (b) dose-response: tune alpha on the tuning split, report the curve on the held-out split
    dose_tune = {al: (0.0 if al == 0 else pct(E_tune.run(rlm(spec(best_s, best_d, al, best_mode))), E_tune.base))
                 for al in alphas}
    best_alpha = min((al for al in alphas if al > 0), key=lambda al: dose_tune[al])
    dose = []
    for al in alphas:
        e = E_test.base if al == 0 else E_test.run(rlm(spec(best_s, best_d, al, best_mode)))
        dose.append({"alpha": al, "tune_ppl_change_pct": dose_tune[al], "test_ppl_change_pct": pct(e, E_test.base),
                     "test_kl": 0.0 if al == 0 else e.kl, "test_eval": e})
        print(f"[b] alpha={al:<5g} tune {dose_tune[al]:+.2f}%  held-out {dose[-1]['test_ppl_change_pct']:+.2f}% "
              f"KL {dose[-1]['test_kl']:.2e}", flush=True)
    fail = next((r["alpha"] for r in dose if r["test_ppl_change_pct"] > a.fail), None)
    best_test = next(r for r in dose if r["alpha"] == best_alpha)
    best_spec = spec(best_s, best_d, best_alpha, best_mode)
    res["best"] = {"mode": best_mode, "source": best_s, "target": best_d, "alpha": best_alpha, "name": best_spec.name,
                   "tune_ppl_change_pct": dose_tune[best_alpha],
                   "test_ppl_change_pct": best_test["test_ppl_change_pct"], "test_kl": best_test["test_kl"],
                   "test_ppl": best_test["test_eval"].ppl}
    res["dose"] = {"pair": [best_s, best_d], "mode": best_mode, "fail_threshold_pct": a.fail,
                   "failure_alpha": fail,
                   "points": [{k: v for k, v in r.items() if k != "test_eval"} for r in dose]}
    print(f"best (tuned): {best_spec.name}: held-out ppl change {best_test['test_ppl_change_pct']:+.3f}%", flush=True)

    # (c) temperature additivity: temperatures tuned on the tuning split
    rec_tune = E_tune.run(rlm(best_spec))
    t_base = min(temps, key=lambda t: E_tune.base.nll_t[t])
    t_both = min(temps, key=lambda t: rec_tune.nll_t[t])
    rec_test = best_test["test_eval"]
    b = E_test.base

    def chg(nll):
        return 100.0 * (math.exp(nll - b.nll) - 1.0)

    temp = {"t_temperature_only": t_base, "t_both": t_both,
            "temperature_only_pct": chg(b.nll_t[t_base]), "recirculation_only_pct": chg(rec_test.nll),
            "both_pct": chg(rec_test.nll_t[t_both])}
    temp["sum_of_parts_pct"] = temp["temperature_only_pct"] + temp["recirculation_only_pct"]
    res["temperature"] = temp
    print(f"[c] temperature-only (T={t_base}) {temp['temperature_only_pct']:+.3f}%, recirculation-only "
          f"{temp['recirculation_only_pct']:+.3f}%, both (T={t_both}) {temp['both_pct']:+.3f}% "
          f"(sum {temp['sum_of_parts_pct']:+.3f}%)", flush=True)

    # (d) basis test on the held-out split at the tuned config
    D = model.d_model
    small = random_rotation(D, angle=a.small_angle, seed=a.seed + 1)
    haar = random_rotation(D, seed=a.seed + 2)
    basis = {"identity": best_test["test_ppl_change_pct"]}
    kls = {"identity": best_test["test_kl"]}
    for name, R in (("small_rotation", small), ("random_orthogonal", haar)):
        e = E_test.run(rlm(spec(best_s, best_d, best_alpha, best_mode, transform=R)))
        basis[name], kls[name] = pct(e, b), e.kl
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(0))
    cos_small = float(torch.nn.functional.cosine_similarity(x, x @ small.T).mean())
    res["basis"] = {"ppl_change_pct": basis, "kl": kls, "small_rotation_mean_cos": cos_small,
                    "small_angle_rad": a.small_angle}
    print(f"[d] basis: identity {basis['identity']:+.3f}%, small rotation (cos {cos_small:.3f}) "
          f"{basis['small_rotation']:+.3f}%, random orthogonal {basis['random_orthogonal']:+.3f}%", flush=True)

    # (e) cost: sequential vs blockwise prefill of the held-out split at the tuned config
    cost = []
    r = rlm(best_spec)
    block = a.cost_block or None
    runs = [("standard (no recirculation)", None, {}), ("sequential (exact)", "sequential", {})]
    runs += [(f"blockwise {p} pass{'es' if p > 1 else ''}", "blockwise", {"passes": p, "block": block})
             for p in passes_list]
    seq_nll = None
    for label, method, kw in runs:
        with PeakRSS() as mem:
            e = E_test.run(None if method is None else r, method=method or "sequential", **kw)
        if method == "sequential":
            seq_nll = e.nll
        cost.append({"method": label, "seconds": e.seconds, "tokens_per_s": len(test) * a.seq_len / e.seconds,
                     "peak_rss_increase_mb": mem.peak_mb, "ppl": e.ppl, "ppl_change_pct": pct(e, b),
                     "kl_from_base": e.kl})
    for c in cost:
        c["ppl_gap_vs_sequential_pct"] = 100.0 * (c["ppl"] / math.exp(seq_nll) - 1.0)
        print(f"[e] {c['method']:28s} {c['seconds']:7.2f}s {c['tokens_per_s']:8.1f} tok/s "
              f"peak +{c['peak_rss_increase_mb']:.0f} MB  ppl gap vs sequential {c['ppl_gap_vs_sequential_pct']:+.4f}%",
              flush=True)
    res["cost"] = {"config": best_spec.name, "block": block or a.seq_len, "rows": cost}
    if a.mediation:
        res["mediation"] = mediation(model, tok, [med_spec or best_spec], a.mediation_task, a.mediation_pairs,
                                     a.mediation_distractors, a.batch, a.seed)
    res["seconds_total"] = time.perf_counter() - t_start
    res["command"] = "python -m analysis.recirculation " + " ".join(argv if argv is not None else
                                                                     __import__("sys").argv[1:])

    # ----- write
    _write_results(res, out, lambda: write_figures(res, out))
    print(f"wrote {out}/results.json and {len(list(out.glob('*.html')))} HTML figures ({res['seconds_total']:.0f}s)")
    return res


def mediation(model, tok, specs, task: str, n_pairs: int, n_distractors: int, batch: int, seed: int) -> dict:
    """(f): recirculate the task-state subspace vs its complement vs a random subspace of equal rank.

    With several candidate `specs`, the one whose full recirculation changes the label logit difference most
    (mean |change|) on the TRAINING groups is used; every reported number is on the held-out groups.
    """
    import dataclasses

    import numpy as np

    from engine.prefill import pad_left, prefill
    from models.recirculation import RecirculatedLM, orthonormal
    from probes.linear import LinearProbe
    from tasks import label_token_ids, make_dataset, tokenize_samples

    if isinstance(tok, ByteTokenizer):
        raise UserError("--mediation needs a real tokenizer (not the byte stand-in of the tiny random models)")
    samples = make_dataset(task, n_pairs=n_pairs, n_distractors=n_distractors, seed=seed)
    ids, samples = tokenize_samples(samples, tok)
    lab = label_token_ids(tok, task)
    y = np.array([smp.label for smp in samples])
    groups = np.array([smp.group_id for smp in samples])
    ug = np.unique(groups)
    rng = np.random.default_rng(seed)
    test_groups = set(rng.permutation(ug)[: len(ug) // 2].tolist())
    te = np.array([g in test_groups for g in groups])
    if te.all() or not te.any():
        raise UserError("--mediation-pairs too small: need at least 2 groups")

    def run(spec_or_none, rows):
        # Residuals are only read from the base model (probe fit / probe test accuracy): the recirculated runs,
        # 2 x pairs x modes of them when tuning, skip collecting them.
        collect = spec_or_none is None
        lds, resids = [], []
        for i in range(0, len(rows), batch):
            x, m = pad_left([ids[j] for j in rows[i:i + batch]])
            if collect:
                r = prefill(model, x, m, "standard", collect=True)
                resids.append(r.resid[:, -1])
            else:
                r = RecirculatedLM(model, spec_or_none, bypass_identity=False).prefill(
                    x, m, cols=torch.tensor([x.shape[1] - 1]), collect=False)
            lg = r.logits[:, -1]
            lds.append(lg[:, lab[1]] - lg[:, lab[0]])
        # LD(label 1 - label 0) [n]; base only: resid [n, L+1, D]
        return torch.cat(lds).numpy(), (torch.cat(resids) if collect else None)

    train_rows = np.where(~te)[0].tolist()
    test_rows = np.where(te)[0].tolist()
    base_tr, resid_tr = run(None, train_rows)
    tuning = []
    if len(specs) > 1:
        for sp in specs:
            ld_tr, _ = run(sp, train_rows)
            tuning.append({"config": sp.name, "train_mean_abs_ld_change": float(np.abs(ld_tr - base_tr).mean())})
            print(f"[f] tune {sp.name:28s} train mean |LD change| {tuning[-1]['train_mean_abs_ld_change']:.4f}",
                  flush=True)
        spec = specs[int(np.argmax([t["train_mean_abs_ld_change"] for t in tuning]))]
    else:
        spec = specs[0]
    X = resid_tr[:, spec.source].double().numpy()
    probe = LinearProbe().fit(X, y[~te], groups[~te])
    u = torch.tensor(np.asarray(probe.direction), dtype=torch.float32)[None]
    D = u.shape[1]
    rnd = torch.randn(1, D, generator=torch.Generator().manual_seed(seed + 3))
    conds = {"base": None, "full": spec,
             "task_subspace": dataclasses.replace(spec, subspace=orthonormal(u)),
             "complement": dataclasses.replace(spec, subspace=orthonormal(u), subspace_complement=True),
             "random_subspace": dataclasses.replace(spec, subspace=orthonormal(rnd))}
    ysign = np.where(y[te] == 1, 1.0, -1.0)
    out = {"task": task, "n_pairs": n_pairs, "n_distractors": n_distractors, "rank": 1,
           "probe_depth": spec.source, "n_test": int(te.sum()), "n_train": int((~te).sum()),
           "probe_train_accuracy": probe.score(X, y[~te]), "config": spec.name, "tuning": tuning, "conditions": {}}
    base_ld = None
    for name, sp in conds.items():
        ld, resid_te = run(sp, test_rows)
        ld_true = ysign * ld  # logit(true) - logit(other)
        if name == "base":
            base_ld = ld_true
            out["probe_test_accuracy"] = probe.score(resid_te[:, spec.source].double().numpy(), y[te])
        d = ld_true - base_ld
        out["conditions"][name] = {"mean_ld": float(ld_true.mean()), "accuracy": float((ld_true > 0).mean()),
                                   "mean_ld_change": float(d.mean()),
                                   "ld_change_se": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0}
        print(f"[f] {name:16s} LD {ld_true.mean():+.3f} (change {d.mean():+.4f}) acc {(ld_true > 0).mean():.3f}",
              flush=True)
    return out


def _mediation_figure(med: dict, out: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    c = med["conditions"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("change in LD vs base (held-out)", "accuracy"))
    fig.add_trace(go.Bar(x=list(c), y=[v["mean_ld_change"] for v in c.values()], showlegend=False,
                         error_y={"type": "data", "array": [1.96 * v["ld_change_se"] for v in c.values()]}),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=list(c), y=[v["accuracy"] for v in c.values()], showlegend=False), row=1, col=2)
    fig.update_layout(title=f"Mediation on {med['task']} ({med['config']}; rank-{med['rank']} probe subspace "
                            f"at depth {med['probe_depth']})")
    _html(fig, out / "mediation.html")


def write_figures(res: dict, out: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cells = res["heatmap"]["cells"]
    srcs = sorted({c["source"] for c in cells})
    tgts = sorted({c["target"] for c in cells})
    fig = make_subplots(rows=1, cols=2, subplot_titles=("convex (beta = 1 - alpha)", "residual (beta = 1)"))
    vmax = max(1e-9, max(abs(c["ppl_change_pct"]) for c in cells))
    for i, mode in enumerate(("convex", "residual")):
        z = [[next((c["ppl_change_pct"] for c in cells if c["mode"] == mode and c["source"] == s
                    and c["target"] == d), None) for d in tgts] for s in srcs]
        fig.add_trace(go.Heatmap(z=z, x=[str(d) for d in tgts], y=[str(s) for s in srcs], zmid=0, zmin=-vmax,
                                 zmax=vmax, colorscale="RdBu_r", showscale=i == 1,
                                 colorbar={"title": "ppl change %"},
                                 hovertemplate="source %{y} -> target %{x}: %{z:+.2f}%<extra></extra>"),
                      row=1, col=i + 1)
        fig.update_xaxes(title_text="target depth d", row=1, col=i + 1)
        fig.update_yaxes(title_text="source depth s", row=1, col=i + 1)
    fig.update_layout(title=f"{res['model']}: perplexity change at alpha = {res['heatmap']['alpha']} "
                            f"(tuning split; chosen {res['best']['name']}, held-out "
                            f"{res['best']['test_ppl_change_pct']:+.2f}%)")
    _html(fig, out / "heatmap.html")

    pts = res["dose"]["points"]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=[p["alpha"] for p in pts], y=[p["test_ppl_change_pct"] for p in pts],
                             name="held-out ppl change %", mode="lines+markers"))
    fig.add_trace(go.Scatter(x=[p["alpha"] for p in pts], y=[p["tune_ppl_change_pct"] for p in pts],
                             name="tuning ppl change %", mode="lines+markers", line={"dash": "dot"}))
    fig.add_trace(go.Scatter(x=[p["alpha"] for p in pts], y=[max(p["test_kl"], 1e-12) for p in pts],
                             name="held-out KL(base || recirc)", mode="lines+markers"), secondary_y=True)
    fig.update_yaxes(title_text="ppl change %", secondary_y=False)
    fig.update_yaxes(title_text="KL (nats/token)", type="log", secondary_y=True)
    fig.update_xaxes(title_text="alpha")
    fa = res["dose"]["failure_alpha"]
    fig.update_layout(title=f"Dose-response, {res['dose']['mode']} s={res['dose']['pair'][0]} "
                            f"d={res['dose']['pair'][1]}; failure (> +{res['dose']['fail_threshold_pct']}%) at "
                            f"alpha = {fa if fa is not None else 'not reached'}")
    _html(fig, out / "dose.html")

    t = res["temperature"]
    labels = [f"temperature only (T={t['t_temperature_only']})", "recirculation only",
              f"both (T={t['t_both']})", "sum of the two parts"]
    vals = [t["temperature_only_pct"], t["recirculation_only_pct"], t["both_pct"], t["sum_of_parts_pct"]]
    fig = go.Figure(go.Bar(x=labels, y=vals, text=[f"{v:+.3f}%" for v in vals], textposition="outside"))
    fig.update_layout(title="Temperature additivity (held-out ppl change vs base at T = 1)",
                      yaxis_title="ppl change %")
    _html(fig, out / "temperature.html")

    bz = res["basis"]["ppl_change_pct"]
    fig = go.Figure(go.Bar(x=list(bz), y=list(bz.values()), text=[f"{v:+.3f}%" for v in bz.values()],
                           textposition="outside"))
    fig.update_layout(title=f"Basis test at {res['best']['name']} (held-out): z_s as is vs small rotation "
                            f"(mean cos {res['basis']['small_rotation_mean_cos']:.3f}) vs random orthogonal",
                      yaxis_title="ppl change %")
    _html(fig, out / "basis.html")

    med = res.get("mediation")
    if isinstance(med, dict):
        _mediation_figure(med, out)

    rows = res["cost"]["rows"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("tokens/s", "peak RSS increase (MB)",
                                                        "ppl gap vs sequential (%)"))
    for i, key in enumerate(("tokens_per_s", "peak_rss_increase_mb", "ppl_gap_vs_sequential_pct")):
        fig.add_trace(go.Bar(x=[r["method"] for r in rows], y=[r[key] for r in rows], showlegend=False),
                      row=1, col=i + 1)
    fig.update_layout(title=f"Cost of recirculated prefill ({res['cost']['config']}, block {res['cost']['block']})")
    _html(fig, out / "cost.html")
    return ["heatmap.html", "dose.html", "temperature.html", "basis.html", "cost.html"] + \
        (["mediation.html"] if isinstance(med, dict) else [])


if __name__ == "__main__":
    main()
