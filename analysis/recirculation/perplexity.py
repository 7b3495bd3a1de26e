"""Perplexity and KL of recirculated runs against the base model on fixed chunks, and the model under study."""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from analysis.recirculation.text import ByteTokenizer
from common.errors import UserError
from engine.inputs import check_inputs


TINY = ("tiny-random-qwen3", "tiny-random-gpt2")


def load(name: str, placement=None):
    """(FullBandwidthLM without fusion, tokenizer, name). `tiny-random-*`: random tiny models for smoke tests.
    `placement` (common.placement.Placement; default float32 on the CPU): the dtype of the weights."""
    from common.placement import CPU

    placement = placement or CPU
    if name in TINY:
        from models.configs import gpt2_config, qwen3_config
        from models.full_bandwidth import FullBandwidthLM

        build = qwen3_config if name.endswith("qwen3") else gpt2_config
        cfg = build(64, n_layers=4, d_model=32, n_heads=2, **({"n_kv_heads": 1} if name.endswith("qwen3") else {}))
        return placement.place(FullBandwidthLM.from_config(cfg, fusion=False, seed=0)), ByteTokenizer(64), name
    from models.loading import load_model

    model, tok, mname = load_model(name, placement)
    if model.has_fusion:
        # Recirculation never fuses: it runs the plain (standard-prefill) path, so a checkpoint's fusion module
        # is simply unused. For a 1-pass-trained checkpoint (tiny-base) that IS the model it was trained as.
        from models.full_bandwidth import FullBandwidthLM
        print(f"note: {mname} has a fusion module; recirculation runs its plain path and never uses it", flush=True)
        model = FullBandwidthLM(model.lm, fusion=False).eval()  # model.lm is already placed
    if tok is None:
        raise UserError(f"{name} has no tokenizer (tokenizer.json) next to it")
    return model, tok, mname


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
        # the base model's log-probs are kept for the KL: [chunks, T - 1, vocab] float32, refused where they
        # would take a large share of the machine (1000 chunks of 4096 tokens under SmolLM2: about 19 GB a split;
        # two splits, a quarter each)
        head = getattr(model, "lm", model).get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
        need = data.shape[0] * (data.shape[-1] - 1) * vocab * 4
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > 0.25 * total:
            raise UserError(f"{data.shape[0]} chunks of {data.shape[-1]} tokens: the base model's log-probs kept for "
                            f"the KL would need {need / 2**30:.1f} GiB, more than a quarter of this machine's "
                            f"{total / 2**30:.0f} GiB: lower --seq-len, --n-tune or --n-test")
        # chunks past the context (GPT-2's position table: an IndexError) are refused before the baseline runs
        try:
            check_inputs(model, data, torch.ones_like(data))
        except UserError as e:
            raise UserError(f"text chunks of {data.shape[-1]} tokens (--seq-len): {e}") from None
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
