"""(e) Cost: the exact sequential prefill against the blockwise (Jacobi) approximation and the plain model."""
from __future__ import annotations

import math
import time

import torch

from analysis.recirculation.perplexity import PeakRSS, pct
from analysis.recirculation.study import Study


@torch.no_grad()
def _prefill_cost(E, rlm, method, kw) -> tuple[float, float, int]:
    """(seconds, peak RSS increase in MB, torch threads) of the prefill alone over E's chunks. The exact sequential
    engine runs its one-token steps at sequential_threads (common.cpus: 1 thread); the others at --threads."""
    from common.cpus import sequential_thread_count

    threads = torch.get_num_threads()
    if method == "sequential" and rlm is not None:
        threads = sequential_thread_count() or threads
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        for _, ids in E._batches():
            mask = torch.ones_like(ids)
            out = E.model(ids, mask) if rlm is None else rlm.prefill(ids, mask, method=method, **kw)
            del out
        seconds = time.perf_counter() - t0
    return seconds, mem.peak_mb, threads


def cost(st: Study, best_spec) -> None:
    """(e) wall time, peak RSS increase, tokens/s and perplexity gap on the held-out split at the tuned config."""
    a, b = st.a, st.E_test.base
    n_tokens = len(st.E_test.data) * a.seq_len
    rows = []
    r = st.rlm(best_spec)
    block = a.cost_block or None
    runs = [("standard (no recirculation)", None, {}), ("sequential (exact)", "sequential", {})]
    runs += [(f"blockwise {p} pass{'es' if p > 1 else ''}", "blockwise", {"passes": p, "block": block})
             for p in st.passes_list]
    seq_nll = None
    for label, method, kw in runs:
        # the prefill alone, timed and memory-sampled in a pass of its own: the scoring pass after it (log-softmax
        # over the vocabulary at every temperature, KL against the base) cost as much as SmolLM2's forward
        seconds, peak_mb, threads = _prefill_cost(st.E_test, None if method is None else r, method, kw)
        e = st.E_test.run(None if method is None else r, method=method or "sequential", **kw)
        if method == "sequential":
            seq_nll = e.nll
        rows.append({"method": label, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
                     "peak_rss_increase_mb": peak_mb, "threads": threads, "ppl": e.ppl, "ppl_change_pct": pct(e, b),
                     "kl_from_base": e.kl})
    for c in rows:
        c["ppl_gap_vs_sequential_pct"] = 100.0 * (c["ppl"] / math.exp(seq_nll) - 1.0)
        print(f"[e] {c['method']:28s} {c['seconds']:7.2f}s {c['tokens_per_s']:8.1f} tok/s ({c['threads']} thr) "
              f"peak +{c['peak_rss_increase_mb']:.0f} MB  ppl gap vs sequential "
              f"{c['ppl_gap_vs_sequential_pct']:+.4f}%", flush=True)
    st.res["cost"] = {"config": best_spec.name, "block": block or a.seq_len, "rows": rows}
