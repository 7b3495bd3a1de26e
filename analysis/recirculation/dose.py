"""(a) source x target heatmap, (b) dose-response of alpha, (c) temperature additivity: how much to recirculate.
Every choice is made on the tuning split; every reported number is held out."""
from __future__ import annotations

import math

from analysis.recirculation.perplexity import pct
from analysis.recirculation.study import Study


def heatmap(st: Study) -> tuple[str, int, int]:
    """(a) perplexity change of every pair x mode at --alpha on the tuning split; returns the best cell."""
    a, E_tune = st.a, st.E_tune
    heat = {}
    for mode in ("convex", "residual"):
        for s, d in st.pairs:
            e = E_tune.run(st.rlm(st.spec(s, d, a.alpha, mode)))
            heat[(mode, s, d)] = pct(e, E_tune.base)
            print(f"[a] {mode:8s} s={s:2d} d={d:2d} alpha={a.alpha}: tune ppl change {heat[(mode, s, d)]:+.2f}% "
                  f"({e.seconds:.1f}s)", flush=True)
    st.res["heatmap"] = {"alpha": a.alpha, "split": "tune",
                         "cells": [{"mode": m, "source": s, "target": d, "ppl_change_pct": v}
                                   for (m, s, d), v in heat.items()]}
    return min(heat, key=heat.get)


def dose_response(st: Study, best_mode: str, best_s: int, best_d: int) -> dict:
    """(b) alpha tuned on the tuning split, the curve and the failure point on the held-out split; returns the
    held-out point of the tuned alpha (with its Eval)."""
    a, E_tune, E_test = st.a, st.E_tune, st.E_test
    dose_tune = {al: (0.0 if al == 0 else pct(E_tune.run(st.rlm(st.spec(best_s, best_d, al, best_mode))),
                                              E_tune.base))
                 for al in st.alphas}
    best_alpha = min((al for al in st.alphas if al > 0), key=lambda al: dose_tune[al])
    dose = []
    for al in st.alphas:
        e = E_test.base if al == 0 else E_test.run(st.rlm(st.spec(best_s, best_d, al, best_mode)))
        dose.append({"alpha": al, "tune_ppl_change_pct": dose_tune[al], "test_ppl_change_pct": pct(e, E_test.base),
                     "test_kl": 0.0 if al == 0 else e.kl, "test_eval": e})
        print(f"[b] alpha={al:<5g} tune {dose_tune[al]:+.2f}%  held-out {dose[-1]['test_ppl_change_pct']:+.2f}% "
              f"KL {dose[-1]['test_kl']:.2e}", flush=True)
    fail = next((r["alpha"] for r in dose if r["test_ppl_change_pct"] > a.fail), None)
    best_test = next(r for r in dose if r["alpha"] == best_alpha)
    best_spec = st.spec(best_s, best_d, best_alpha, best_mode)
    st.res["best"] = {"mode": best_mode, "source": best_s, "target": best_d, "alpha": best_alpha,
                      "name": best_spec.name, "tune_ppl_change_pct": dose_tune[best_alpha],
                      "test_ppl_change_pct": best_test["test_ppl_change_pct"], "test_kl": best_test["test_kl"],
                      "test_ppl": best_test["test_eval"].ppl}
    st.res["dose"] = {"pair": [best_s, best_d], "mode": best_mode, "fail_threshold_pct": a.fail,
                      "failure_alpha": fail,
                      "points": [{k: v for k, v in r.items() if k != "test_eval"} for r in dose]}
    print(f"best (tuned): {best_spec.name}: held-out ppl change {best_test['test_ppl_change_pct']:+.3f}%",
          flush=True)
    return best_test


def temperature(st: Study, best_spec, best_test: dict) -> None:
    """(c) temperature-only vs recirculation-only vs both, temperatures tuned on the tuning split."""
    temps, E_tune = st.temps, st.E_tune
    rec_tune = E_tune.run(st.rlm(best_spec))
    t_base = min(temps, key=lambda t: E_tune.base.nll_t[t])
    t_both = min(temps, key=lambda t: rec_tune.nll_t[t])
    rec_test = best_test["test_eval"]
    b = st.E_test.base

    def chg(nll):
        return 100.0 * (math.exp(nll - b.nll) - 1.0)

    temp = {"t_temperature_only": t_base, "t_both": t_both,
            "temperature_only_pct": chg(b.nll_t[t_base]), "recirculation_only_pct": chg(rec_test.nll),
            "both_pct": chg(rec_test.nll_t[t_both])}
    temp["sum_of_parts_pct"] = temp["temperature_only_pct"] + temp["recirculation_only_pct"]
    st.res["temperature"] = temp
    print(f"[c] temperature-only (T={t_base}) {temp['temperature_only_pct']:+.3f}%, recirculation-only "
          f"{temp['recirculation_only_pct']:+.3f}%, both (T={t_both}) {temp['both_pct']:+.3f}% "
          f"(sum {temp['sum_of_parts_pct']:+.3f}%)", flush=True)
