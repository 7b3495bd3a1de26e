"""(e) Cost: the exact sequential prefill against the blockwise (Jacobi) approximation and the plain model."""
from __future__ import annotations

import math

from analysis.recirculation.perplexity import PeakRSS, pct
from analysis.recirculation.study import Study


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
        with PeakRSS() as mem:
            e = st.E_test.run(None if method is None else r, method=method or "sequential", **kw)
        if method == "sequential":
            seq_nll = e.nll
        rows.append({"method": label, "seconds": e.seconds, "tokens_per_s": n_tokens / e.seconds,
                     "peak_rss_increase_mb": mem.peak_mb, "ppl": e.ppl, "ppl_change_pct": pct(e, b),
                     "kl_from_base": e.kl})
    for c in rows:
        c["ppl_gap_vs_sequential_pct"] = 100.0 * (c["ppl"] / math.exp(seq_nll) - 1.0)
        print(f"[e] {c['method']:28s} {c['seconds']:7.2f}s {c['tokens_per_s']:8.1f} tok/s "
              f"peak +{c['peak_rss_increase_mb']:.0f} MB  ppl gap vs sequential "
              f"{c['ppl_gap_vs_sequential_pct']:+.4f}%", flush=True)
    st.res["cost"] = {"config": best_spec.name, "block": block or a.seq_len, "rows": rows}
