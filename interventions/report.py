"""causal_report.{json,md,html}: the verdict sentence, tables, and Plotly figures (the page loads plotly.min.js
from its folder by default: interventions.run --plotly).

JSON schema {"name": "causal-report", "version": 8}. Version 8 keeps every field of version 7 and adds
model.config_sha256 (models.fingerprint.config_hash: the same tensors under another config are another model),
a fourth results.subspace row class_means_swap (the swap along the class-mean differences of the fed state,
fitted per fold as the probe subspace is) with results.subspace.class_means_rank / class_means_energy_fraction,
and, when run (interventions.run --das / --attribution; absent otherwise):
    config.das                  {ranks, steps, lr, seed, optimizer, loss, parametrization, site} or null
    config.attribution          true / false; config.attribution_ig (M, 0 = the plain gradient)
    results.das                 distributed alignment search at one site (interventions.das): site {site, depth,
                                position, position_name, description}, mode, target, ranks, d (the site's width),
                                n_folds, settings, fit_s, rows [{k, iia, iia_ci, n (held-out rows), train_iia,
                                random_iia, random_iia_ci (a random rank-k subspace), loss_first, loss_last (mean over
                                folds), cos_probe / cos_leace (cosines of the principal angles to the probe / LEACE
                                subspace, mean over folds, largest first)}], probe {rank, iia, iia_ci, n}, leace {rank,
                                iia, iia_ci, n} (the interchange of what LEACE erases), cos_probe_leace, full_swap
                                {iia, iia_ci, n} (the whole swap at the site on the same rows: IIA at k = d equals it)
    results.loop_iterations     a looped model (models.looped) only: mode, iterations (r of the mode), spec, reference,
                                rows [{iteration i = 0..r, depth (of s_i), swap_T / swap_all_positions / mean_T
                                <metrics>, dose_T [{alpha, <metrics>}], lens_accuracy, lens_ld_mean, state_change (|s_i - s_(i-1)| / |s_i| at T,
                                null for i = 0)}]
    results.attribution         attribution patching (interventions.attribution): mode, method, metric, reference,
                                sites ["state", "d0", ..., "dL", "attn0", ..., "mlp0", ...], positions (offsets), position_names, mean_estimate
                                [site][position] (mean estimated LD change; null where no row is real), ci (95%
                                cluster bootstrap), n_rows, metric_clean_mean, chunk, timings_s {gradients, total},
                                vs_position_sweep {n, spearman, top_k, top_overlap, top_estimate, top_exact,
                                sign_agreement, abs_error_mean, exact_abs_mean, positions, estimate, exact, exact_s} and
                                vs_layer_patching {the same, over (depth, position) cells} where the exact patches ran
                                (top_overlap null at 5 cells or fewer); with --attribution-ig, ig_path {n_rows,
                                unresolved_rows, largest_step_share_median, total_change_mean, rule}: how well the
                                path's points resolve each row's change (interventions.attribution.ig_path_resolution).
    results.precision           null in float32; bfloat16 / float16: {dtype, max_abs_label_logit, logit_step,
                                clean_abs_ld_mean, clean_abs_ld_in_steps} (Suite.precision; added without a bump)
Version 7 adds recirculation modes (results.state_words: how the
report names the mechanism's fed state, z_{t-1,s} under recirculation). Version 6 names the two readings of a "flip" apart:
<metrics>.flip_rate is now follows_donor_rate (the prediction is the donor's label, over the n_donor_rows rows
whose donor label differs from their own; formerly n_flip_rows; follows_donor, formerly flips, the count), and
changed_rate / changed are new (the prediction differs from the clean run's, over every row: an identity patch
gives 0). It adds config.budget (quick | full), config.n_pairs (the pairs actually used) beside
config.n_pairs_requested, config.layer_depths, config.sweep_depth, config.leace_all (leace_state_all run), config.device / dtype, dataset.n_pairs,
model.feedback (has a fusion module), results.fed_state (only where the fed-state analyses do not apply: "not
applicable (no feedback): <why>"), results.resid_mean_ablation {mode, site "resid", rows [{name mean_resid_d<l>,
depth, position -1, reference "paired sample", <metrics>}]}, and results.position_sweep.site "resid" with its
depth under standard prefill (the paired sample's residual stream at that depth swapped at each position; no
first_line_after). Layer patching rows follow results.layer_patching.depths (possibly a subset). Version 5 keeps every field of version 4 and splits
results.position_sweep.first_line_after two ways: by_diff_line [{lines [first, last] (the doubling bins [0, 0], [1, 1],
[2, 3], [4, 7], ... of the prompt line index of the pair's first differing token that hold rows), <metrics>}] and
by_answers [{own, donor (label indices), <metrics>}]. Version 4 names fields for what they hold: <metrics>.n_flip
(the rows a flip rate is computed over) is now n_flip_rows, beside the new flips (the flips among them);
model.weights_sha256 is the hash of the tensors, as in probes.json (models.fingerprint.weights_hash), and the
checkpoint file's bytes are model.file_sha256; config.n_boot is the --n-boot in force. Version 3 keeps every
field of version 2 and adds LEACE concept erasure (stats.erasure):
    config.erase_depths, config.erase_positions   the --erase-depths (null = every depth) / --erase-positions
    results.leace               {method, package_version, concept, n_folds, fit, settings, rows, dose} or absent
                                when not run. rows[*]: name (leace_state = fed state at T, leace_state@T-k = at
                                one position, leace_state_all = at every fused position, leace_resid_d<l> = the
                                residual stream at depth l, position T), description, mode, site (state | resid),
                                position (-1, an offset or "all"), depth (resid rows), reference "paired sample",
                                relative_change (mean ||erased - clean|| / mean ||clean||), probe (null for
                                leace_state_all, else {before, after, clean_on_erased: {accuracy, ci,
                                fold_accuracies, n}, chance}), n_positions (leace_state_all), <metrics>;
                                dose {alphas, site "state", rows [{alpha, position -1, <metrics>}]} (null under
                                standard): x + alpha (LEACE(x) - x) of the fed state at T.
Version 2 (interventions in every prefill mode, at every
position, K-class labels) keeps every field of version 1 and adds:
    config.mode                 any canonical mode name (standard, recurrent-K, recurrent-full, fused-N)
    config.max_positions        the sweep / heatmap cover the last this many positions (null = all)
    config.n_classes            K, the number of label words (2, or 3 for shell_game)
    results.interventions[*].position   -1 (= T) for the interventions at T; "all" for gate_bypass_all (e_t fed
                                instead of the fused input at every fused position: the standard prefill)
    results.subspace.rows[*].position, results.dose.rows[*].position   -1
    results.position_sweep      {mode, site "state", reference, positions [offsets, -1 = T], position_names,
                                rows [{position, position_name, n_at_or_before_first_diff, <metrics>}],
                                first_diff [per row offset of the pair's first differing token],
                                by_first_diff [{relative = t - first_diff (+ 1 for the residual site), <metrics>}],
                                by_line [{relative_line = line(t) - line(first differing token), <metrics>}]
                                (lines counted by newline tokens; pooled over the positions of that line),
                                at_or_before_first_diff / after_first_diff <metrics> (pooled cells),
                                max_abs_ld_change_at_or_before_first_diff (0 by construction),
                                diff_line [per row, tracking tasks only],
                                first_line_after {n_positions, <metrics>}: the swap at every row's first position
                                of the line after its first differing token's line, recomputed to T (rows with
                                line indices; not limited to the last P positions)}
    results.layer_patching      positions now every position (names "T-k"), plus offsets (-1 = T) and reference;
                                cells[mode][*] carry position (offset) and position_name; top_depth {mode: L of
                                its stack} (depth L at T is the donor's own output: normalized effect 1)
<metrics> = n, n_groups, n_donor_rows, follows_donor, changed, ld_clean_mean, ld_ref_mean, ld_mean, accuracy,
follows_donor_rate, changed_rate, normalized_effect and their *_ci (interventions.metrics). Standard as the mode under study has no fed state: interventions = [],
subspace / dose = null, and position_sweep is the residual one (site "resid", no first_line_after).
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

REPORT_FILES = ("causal_report.json", "causal_report.md", "causal_report.html")
SCHEMA = {"name": "causal-report", "version": 8}



# Reports written before schema 7 (and the fusion's runs) name the fused state; recirculation reports carry their own.
_FUSION_WORDS = {"state": "h_{T-1}", "noun": "the fused state", "site": "the state entering the fusion at T",
                 "site_t": "the state entering the fusion at t"}


def _task_name(cfg: dict) -> str:
    """The task as the report names it: a task file's own name (its header's), not the path typed."""
    return (cfg.get("task_source") or {}).get("name") or cfg["task"]


def _words(res: dict) -> dict:
    return {**_FUSION_WORDS, **(res.get("state_words") or {})}

def clean_json(x):
    """NaN/inf -> None, numpy/torch scalars -> python, recursively."""
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            x = x.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _f(x, nd=2, pct=False):
    """A rate as the tables print it (2 decimals), or as a percent of that same rounding: 0.975 (stored as
    0.97499...) reads 0.97 and 97%, never 0.97 in the table and 98% in the sentence. A value that rounds to zero
    reads without a sign (-0.001 -> 0.00, not -0.00: a CI [0.00, -0.00] would read lo > hi)."""
    if x is None:
        return "n/a"
    text = f"{100 * float(f'{x:.2f}'):.0f}%" if pct else f"{x:.{nd}f}"
    return text[1:] if text.startswith("-") and not any(c in "123456789" for c in text) else text


def _places(x, bar: float) -> int:
    """2, or 3 where 2 places would round `x` onto the other side of a bar the verdict judges it by (0.5975
    under 0.6 reads 0.598, not 0.60)."""
    return 3 if x is not None and (x < bar) != (float(f"{x:.2f}") < bar) else 2


def _ci(row, key, nd=2, pct=False):
    ci = row.get(key + "_ci")
    if not ci:
        return "[n/a]"
    return f"[{_f(ci[0], nd, pct)}, {_f(ci[1], nd, pct)}]"


def _row(res, name):
    for src in (res["interventions"], (res.get("subspace") or {}).get("rows", [])):
        for r in src:
            if r["name"] == name:
                return r
    return None


def verdict(report: dict) -> tuple[str, str]:
    """(label, one sentence with its numbers) for the task of this report."""
    cfg, res = report["config"], report["results"]
    clean = res["clean"][cfg["mode"]]
    swap, sub = _row(res, "state_swap"), res.get("subspace")
    if swap is None or sub is None:
        why = res.get("fed_state") or "not applicable (no feedback): standard prefill feeds no state"
        return ("not applicable (no feedback)",
                f"{_task_name(cfg)} ({report['model']['name']}, {cfg['mode']}, N={cfg['distractors']}): {why}, so "
                f"the fed-state analyses do not apply (clean accuracy {_f(clean['accuracy'])} "
                f"{_ci(clean, 'accuracy')}, n={clean['n']})" + _resid_clause(res, clean) + _loop_clause(res) + "."
                + _precision_clause(res))
    ne, ci = swap["normalized_effect"], swap["normalized_effect_ci"]
    lo = ci[0] if ci else None
    if clean["accuracy"] is None or clean["accuracy"] < 0.6:
        label = "inconclusive (the model does not solve the task)"
    elif ne is None or not ci:  # no estimate or no interval: nothing to judge by (not "not detectably used")
        label = "inconclusive (the effect has no estimate or no CI)"
    elif ci and ne is not None and not ci[0] - (tol := 1e-9 * max(1.0, abs(ne))) <= ne <= ci[1] + tol:  # a percentile bootstrap of a ratio whose denominator
        # is near 0 in some resamples: its interval judges nothing (seen: 0.51 [0.69, 2.65] at --n-boot 20)
        label = "inconclusive (the effect's bootstrap CI does not contain its estimate)"
    elif lo > 0.5:
        label = "causally used"
    elif lo > 0.05:
        label = "partly used"
    elif ci[1] < -0.05:  # a detected effect away from the donor: the answer moves, the other way
        label = "used in reverse"
    else:
        label = "not detectably used"
    w = _words(res)
    s = (f"{_task_name(cfg)} ({report['model']['name']}, {cfg['mode']}, N={cfg['distractors']}): {w['noun']} is "
         f"{label} (judged by the normalized effect's CI, unrounded: causally used where its lower end exceeds 0.5, "
         f"partly used above 0.05, used in reverse where its upper end is below -0.05, not detectably used otherwise; "
         f"inconclusive at a clean accuracy under 0.6 or a CI that misses its estimate): swapping "
         f"{w['site']} with the "
         f"paired sample's makes {_f(swap['follows_donor_rate'], pct=True)} "
         f"{_ci(swap, 'follows_donor_rate', pct=True)} of predictions follow the donor's label and changes "
         f"{_f(swap['changed_rate'], pct=True)} {_ci(swap, 'changed_rate', pct=True)}, normalized effect {_f(ne)} "
         f"{_ci(swap, 'normalized_effect')} (n={swap['n']}, {swap['n_groups']} groups; clean accuracy "
         f"{_f(clean['accuracy'], _places(clean['accuracy'], 0.6))} {_ci(clean, 'accuracy')}); "
         + _subspace_clause(res, sub, w) + ".")
    return label, s + _path_clause(label, clean, _row(res, "gate_bypass_all")) + _precision_clause(res)


# Below this many rounding steps the clean |LD| (and every effect normalized by differences of LDs) is mostly
# rounding of the low-precision logits
RESOLVED_STEPS = 4


def _precision_clause(res: dict) -> str:
    """A bfloat16 / float16 run's logit resolution (Suite.precision), or ''."""
    p = res.get("precision")
    if not p:
        return ""
    s = (f" Logits are {p['dtype']}: each label-word logit is rounded to a step of up to {p['logit_step']:.3g} "
         f"(largest |label-word logit| {p['max_abs_label_logit']:.3g}); the clean |LD| averages "
         f"{p['clean_abs_ld_mean']:.3g}, {p['clean_abs_ld_in_steps']:.3g} steps")
    if p["clean_abs_ld_in_steps"] < RESOLVED_STEPS:
        return s + (f": LDs and effects at this scale are mostly rounding (fewer than {RESOLVED_STEPS} steps); "
                    "rerun with --dtype float32.")
    return s + "."


def _rank_words(sub: dict) -> str:
    """The probe subspace's rank as fitted: the rank asked, and where a fold's training rows gave fewer directions,
    how many each fold found (the swaps then move fewer directions than the rank says)."""
    found = sub.get("fold_ranks") or []
    if not found or all(f == sub["rank"] for f in found):
        return f"{sub['rank']}"
    return f"{sub['rank']} asked, {min(found)}-{max(found)} found per fold ({', '.join(map(str, found))})"


def _subspace_clause(res: dict, sub: dict, w: dict) -> str:
    r, state = sub["rank"], w["state"].split(" ")[0]
    if sub.get("skipped"):
        return f"the rank-{r} probe subspace swaps were not run: {sub['skipped']}"
    parts = {n: _row(res, n) for n in ("subspace_swap", "complement_swap", "random_subspace_swap")}
    fewer = "" if _rank_words(sub) == str(r) else f" (rank {_rank_words(sub)})"
    return (f"the rank-{r} probe subspace{fewer} alone gives "
            f"{_f(parts['subspace_swap']['normalized_effect'])} {_ci(parts['subspace_swap'], 'normalized_effect')}, "
            f"its complement {_f(parts['complement_swap']['normalized_effect'])} "
            f"{_ci(parts['complement_swap'], 'normalized_effect')}, a random rank-{r} subspace "
            f"{_f(parts['random_subspace_swap']['normalized_effect'])} "
            f"{_ci(parts['random_subspace_swap'], 'normalized_effect')} "
            f"(probe held-out accuracy on {state} {_f(sub['probe_heldout_accuracy'])})"
            + (f", the class-mean difference {_f(means['normalized_effect'])} {_ci(means, 'normalized_effect')}"
               if (means := _row(res, "class_means_swap")) is not None else ""))


def _loop_clause(res: dict) -> str:
    """A looped model's feedback in depth: from which iteration its loop state carries the answer (the swap with
    the paired sample's makes most predictions follow the donor), at T only and at every position (from iteration 1:
    s_0 is the prelude's output, so swapping it everywhere swaps the whole input)."""
    lp = res.get("loop_iterations")
    if not lp or not lp.get("rows"):
        return ""

    def first(key):
        rows = [r for r in lp["rows"] if key == "swap_T" or r["iteration"] > 0]
        most = [(r[key]["follows_donor_rate"] or 0) > 0.5 for r in rows]
        top = f"at most {_f(max(r[key]['follows_donor_rate'] or 0 for r in rows))}"
        if not any(most):
            return f"at no iteration ({top})"
        if most[-1]:  # from the first iteration after which every one holds
            r = rows[next(i for i in range(len(rows)) if all(most[i:]))]
            v = r[key]["follows_donor_rate"]
            return f"from iteration {r['iteration']} ({_f(v)} {_ci(r[key], 'follows_donor_rate')})"
        its = [str(r["iteration"]) for r, m in zip(rows, most) if m]
        return f"at iteration{'s' if len(its) > 1 else ''} {', '.join(its)} only, not the last ({top})"

    return (f"; the loop state ({lp['mode']}, {lp['iterations']} iterations) makes most predictions follow the "
            f"donor when swapped at T {first('swap_T')}, at every position {first('swap_all_positions')}")


def _resid_clause(res: dict, clean: dict | None = None) -> str:
    """What the residual analyses found, for a report without a fed state: where swapping the paired sample's
    residual stream moves the answer most (layer patching, with its CI) and what the position sweep saw before the
    pair's first differing token (exactly nothing, by causal attention). A model that does not solve the task
    (clean accuracy under 0.6, the verdict's bar) gets no "largest effect": its normalized effects divide by a
    clean logit difference near 0 (0.83 [-6.06, 19.47] was quoted for a model at chance)."""
    out = []
    lp = res.get("layer_patching")
    unsolved = clean is not None and (clean.get("accuracy") is None or clean["accuracy"] < 0.6)
    if lp and lp.get("modes") and unsolved:
        out.append(f"; layer patching is not summarized: the model does not solve the task (clean accuracy "
                   f"{_f(clean.get('accuracy'))}), so its normalized effects divide by a logit difference near 0")
    elif lp and lp.get("modes"):
        m = lp["modes"][0]
        top = (lp.get("top_depth") or {}).get(m)
        best = None
        for i, d in enumerate(lp["depths"]):
            for j, name in enumerate(lp["positions"]):
                v = lp[m]["normalized_effect"][i][j]
                if d == top and name == "T":  # the donor's own last residual at T: its answer, 1 by construction
                    continue
                if v is not None and (best is None or v > best[0]):
                    best = (v, d, name)
        if best is not None:
            cell = next((c for c in (lp.get("cells") or {}).get(m, [])
                         if c.get("depth") == best[1] and c.get("position_name") == best[2]), None)
            ci = f" {_ci(cell, 'normalized_effect')}" if cell is not None else ""
            out.append(f"; layer patching: the largest normalized effect is {_f(best[0])}{ci} at depth {best[1]}, "
                       f"position {best[2]}" + (f" (leaving out depth {top} at T, the donor's own output there)"
                                                if top is not None else ""))
    sw = res.get("position_sweep")
    if sw and sw.get("after_first_diff"):
        a = sw["after_first_diff"]
        out.append(f"; the residual swap at depth {sw.get('depth')} after the pair's first differing token "
                   f"changes {_f(a['changed_rate'], pct=True)} {_ci(a, 'changed_rate', pct=True)} of predictions "
                   f"(max |LD change| at or before it {_f(sw['max_abs_ld_change_at_or_before_first_diff'], 3)})")
    return "".join(out)


def _path_clause(label: str, clean: dict, bypass: dict | None) -> str:
    """A swap at T that decides little next to a feedback path that is needed: a model can carry its running
    value in the cached columns (each computed from its own fed state) rather than in the one fed vector, and
    then the swap reads "not used" where the bypass shows that the model depends on its fused inputs (the
    all-position bypass is the standard prefill, which a recurrently trained model may never have seen: it shows
    that dependence, not by itself which information flows through the feedback); say so in the verdict."""
    if label not in ("not detectably used", "partly used") or bypass is None:
        return ""
    clean_ci, bypass_ci = clean.get("accuracy_ci") or (None, None), bypass.get("accuracy_ci") or (None, None)
    if clean_ci[0] is None or bypass_ci[1] is None or not bypass_ci[1] < clean_ci[0] - 0.1:
        return ""
    return (f" But feeding token embeddings instead of the fused input at every position drops accuracy to "
            f"{_f(bypass['accuracy'])} {_ci(bypass, 'accuracy')}: the model depends on its fused inputs, and what "
            f"decides the answer is not the fed state at T alone (a model can carry the value in its cached "
            f"columns, which a swap at one position leaves in place).")


def control_sentence(report: dict) -> str:
    c = report.get("control")
    if not c:
        return "Control model: not run."
    if c.get("skipped"):
        return f"Control model: skipped ({c['skipped']})."
    if not c.get("interventions"):
        return f"{c.get('role', 'control').capitalize()} {c['model']}: {c.get('note', 'no interventions')}."
    sw = next(r for r in c["interventions"] if r["name"] == "state_swap")
    cl = c["clean"].get(report["config"]["mode"]) or c["clean"]["standard"]
    about = f" ({c['about']})" if c.get("about") else ""
    return (f"{c.get('role', 'control').capitalize()} {c['model']}{about}: the same swap gives normalized effect "
            f"{_f(sw['normalized_effect'])} {_ci(sw, 'normalized_effect')}, follows donor "
            f"{_f(sw['follows_donor_rate'], pct=True)} {_ci(sw, 'follows_donor_rate', pct=True)}, changed "
            f"{_f(sw['changed_rate'], pct=True)} {_ci(sw, 'changed_rate', pct=True)} (clean accuracy "
            f"{_f(cl['accuracy'])}, n={sw['n']}).")


def _lines_label(first: int, last: int) -> str:
    return f"line {first}" if first == last else f"lines {first}-{last}"


def _table(rows, first="intervention"):
    out = [f"| {first} | LD mean | accuracy | follows donor | changed | normalized effect | n |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.get('label', r.get('name'))} | {_f(r['ld_mean'])} {_ci(r, 'ld_mean')} | "
                   f"{_f(r['accuracy'])} {_ci(r, 'accuracy')} | {_f(r['follows_donor_rate'])} "
                   f"{_ci(r, 'follows_donor_rate')} | {_f(r['changed_rate'])} {_ci(r, 'changed_rate')} | "
                   f"{_f(r['normalized_effect'])} {_ci(r, 'normalized_effect')} | {r['n']} |")
    return "\n".join(out)


def _leace_rows(res, site=None) -> list[dict]:
    rows = (res.get("leace") or {}).get("rows") or []
    return [r for r in rows if site is None or r.get("site") == site]


def _leace_markdown(res) -> list[str]:
    le = res.get("leace")
    if not le or not le.get("rows"):  # nothing erased (e.g. no fed state and no --erase-depths): no empty table
        return []
    out = ["", "## Concept erasure (LEACE)", "",
           f"{le['method']} {le.get('package_version') or ''}: the concept ({le['concept']}) erased by the least-squares "
           f"affine map after which no linear classifier beats a constant one; {le['fit']} ({le['n_folds']} grouped "
           "folds, the subspace swaps' folds). Reference: the paired sample, so erasing the label to 'no "
           "information' (LD ~ 0) reads about 0.5 as normalized effect on a binary task. Probe accuracies held out: "
           "before = clean probe on clean rows; after = probe refitted on erased training rows (chance by the "
           "guarantee); clean on erased = the clean probe on the erased held-out rows. Relative change = mean "
           "||erased - clean|| / mean ||clean||.", "",
           "| erasure | position | probe before / after / clean on erased | relative change | LD mean | accuracy | "
           "follows donor | changed | normalized effect | n |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in le["rows"]:
        pr = r.get("probe")
        probe = (" / ".join(_f((pr.get(k) or {}).get("accuracy")) for k in ("before", "after", "clean_on_erased"))
                 if pr else "n/a")
        pos = "all" if r["position"] == "all" else ("T" if r["position"] == -1 else f"T{r['position'] + 1}")
        out.append(f"| {r['name']} | {pos} | {probe} | {_f(r.get('relative_change'))} | {_f(r['ld_mean'])} "
                   f"{_ci(r, 'ld_mean')} | {_f(r['accuracy'])} {_ci(r, 'accuracy')} | {_f(r['follows_donor_rate'])} "
                   f"{_ci(r, 'follows_donor_rate')} | {_f(r['changed_rate'])} {_ci(r, 'changed_rate')} | "
                   f"{_f(r['normalized_effect'])} {_ci(r, 'normalized_effect')} | {r['n']} |")
    if le.get("dose"):
        out += ["", "Dose: h = h + a (LEACE(h) - h) of the fed state at T:", ""]
        out.append(_table([{**r, "label": f"a = {r['alpha']:.1f}"} for r in le["dose"]["rows"]], "alpha"))
    return out


def _cis(x, nd=2):
    return "[n/a]" if not x else f"[{x[0]:.{nd}f}, {x[1]:.{nd}f}]"  # no interval is said, not left blank


def _cos(xs) -> str:
    return "n/a" if not xs else ", ".join(f"{v:.2f}" for v in xs[:4]) + (" ..." if len(xs) > 4 else "")


def _loop_markdown(res) -> list[str]:
    lp = res.get("loop_iterations")
    if not lp:
        return []
    sp = lp["spec"]
    out = ["", f"## Per iteration of the loop ({lp['mode']}: prelude {sp['prelude']}, core {sp['core']} x "
           f"{lp['iterations']}, coda {sp['coda']}{', injection' if sp['inject'] else ''})", "",
           "The loop state s_i (the residual after iteration i; s_0 = the prelude's output e) from the paired sample, "
           "at T only and at every position (the rest recomputed; with injection each iteration still reads the "
           "row's own e), its batch mean at T, a dose at T ((1 - a) s_i + a s_i(donor)), the logit lens on s_i at T, and "
           "|s_i - s_(i-1)| / |s_i| at T.", "",
           "| iteration | depth | swap at T: follows donor | swap everywhere: follows donor | mean at T: accuracy | "
           "dose at T (a = " + " / ".join(f"{d['alpha']:g}" for d in lp["rows"][0].get("dose_T", [])) + "): follows "
           "donor | lens accuracy | change |", "|---|---|---|---|---|---|---|---|"]
    for r in lp["rows"]:
        out.append(f"| {r['iteration']} | {r['depth']} | {_f(r['swap_T']['follows_donor_rate'])} "
                   f"{_ci(r['swap_T'], 'follows_donor_rate')} | {_f(r['swap_all_positions']['follows_donor_rate'])} "
                   f"{_ci(r['swap_all_positions'], 'follows_donor_rate')} | {_f(r['mean_T']['accuracy'])} | "
                   f"{' / '.join(_f(d['follows_donor_rate']) for d in r.get('dose_T', [])) or 'n/a'} | "
                   f"{_f(r['lens_accuracy'])} | {_f(r['state_change'], 3)} |")
    return out


def _das_markdown(res) -> list[str]:
    das = res.get("das")
    if not das:
        return []
    site = das["site"]
    out = ["", f"## Distributed alignment search: {site['description']} at {site['position_name']} ({das['mode']})", "",
           f"A rank-k subspace R (orthonormal, {das['settings']['parametrization']}) trained so that interchanging it "
           f"with the paired sample's makes the answer follow {das['target']}: {das['settings']['steps']} full-batch "
           f"Adam steps (lr {das['settings']['lr']}) per fold on the training groups, scored on the held-out groups "
           f"of {das['n_folds']} grouped folds. IIA = interchange-intervention accuracy (the prediction is the "
           "donor's label); random = a random rank-k subspace; cos = cosines of the principal angles to the probe / "
           "LEACE subspaces (1 = a shared direction).", "",
           "| k | IIA | 95% CI | train IIA | random k | cos to probe | cos to LEACE | loss first -> last |",
           "|---|---|---|---|---|---|---|---|"]
    for r in das["rows"]:
        out.append(f"| {r['k']} | {_f(r['iia'])} | {_cis(r['iia_ci'])} | {_f(r['train_iia'])} | {_f(r['random_iia'])} "
                   f"| {_cos(r.get('cos_probe'))} | {_cos(r.get('cos_leace'))} | {_f(r['loss_first'])} -> "
                   f"{_f(r['loss_last'], 3)} |")
    falling = [r["k"] for r in das["rows"] if r.get("still_falling")]
    if falling:
        out += ["", f"**Not converged** at k = {', '.join(map(str, falling))}: in some folds the loss still fell by "
                "more than 5% over the last tenth of the steps, so these IIAs are lower bounds; rerun with more "
                "--das-steps (or a larger --das-lr)."]
    extra = []
    for key, what in (("probe", "the probe subspace"), ("leace", "LEACE's subspace"), ("full_swap", "the whole swap")):
        v = das.get(key)
        if v:
            rank = f" (rank {_rank_words(v)})" if "rank" in v else ""
            extra.append(f"{what}{rank} IIA {_f(v['iia'])} {_cis(v['iia_ci'])}")
    if extra:
        out += ["", "On the same rows: " + "; ".join(extra) + (f"; probe vs LEACE cos {_cos(das['cos_probe_leace'])}"
                                                               if das.get("cos_probe_leace") else "") + "."]
    return out


def _ig_path_sentence(at) -> str:
    """Integrated gradients' resolution warning (interventions.attribution.ig_path_resolution), or ''."""
    p = at.get("ig_path")
    if not p or not p["unresolved_rows"]:
        return ""
    return (f" **The {at['ig_steps']} path points did not resolve {p['unresolved_rows']} of {p['n_rows']} rows**: "
            "more than half of the metric's change along the path happens between two adjacent points (a flip in a "
            f"sliver of the path; the mean total change is {_f(p['total_change_mean'])}), where no point's gradient "
            "sees it, so the estimates miss that change; read the exact patches (position sweep, layer patching).")


def _attribution_markdown(res) -> list[str]:
    at = res.get("attribution")
    if not at:
        return []
    out = ["", f"## Attribution patching ({at['mode']}): estimated LD change per (site, position)", "",
           f"{at['method']}; {at['metric']}. {max(1, at.get('ig_steps', 0))} forward and backward pass"
           f"{'es' if at.get('ig_steps', 0) > 1 else ''} per batch chunk ({at['timings_s']['gradients']:.1f} s). "
           "Mean over real rows; 95% CI by a bootstrap over groups." + _ig_path_sentence(at), "",
           "| site | " + " | ".join(at["position_names"]) + " |", "|---" * (len(at["positions"]) + 1) + "|"]
    for site, row in zip(at["sites"], at["mean_estimate"]):
        out.append(f"| {site} | " + " | ".join(_f(v) for v in row) + " |")
    sw = at.get("vs_position_sweep") or {}
    swept = (f"the exact residual sweep at depth {sw['depth']} (per position)" if sw.get("site") == "resid" else
             "the exact state sweep (per position)")
    for key, what in (("vs_position_sweep", swept),
                      ("vs_layer_patching", "exact layer patching (per depth x position cell)")):
        v = at.get(key)
        if v:
            spear = ("undefined (fewer than 3 cells, or one side constant)" if v["spearman"] is None
                     else f"{v['spearman']:.3f}")  # 3 places: 0.897 is below the 0.9 bar, and reads so
            verdict = ""
            if v["spearman"] is not None and v["spearman"] < 0.9:
                verdict = (" Below the 0.9 agreement bar: the first-order estimate does not rank these cells as the "
                           "exact patches do. It is wrong wherever the metric is not linear between the two values, "
                           "e.g. a saturated answer that flips only far from the clean value (see the dose table).")
            if v["spearman"] is None and v["n"]:
                verdict = " With no Spearman the ranking is not checked."
            top = (f"top-{v['top_k']} |effect| overlap {v['top_overlap']}/{v['top_k']}, "
                   if v.get("top_overlap") is not None else
                   f"no top-|effect| overlap check (only {v['n']} cells: each is in both tops), ")
            out += ["", f"Against {what}: Spearman {spear} over {v['n']} cells, {top}sign agreement "
                    f"{_f(v['sign_agreement'])}, mean |estimate - exact| "
                    f"{_f(v['abs_error_mean'])} against a mean |exact| of {_f(v['exact_abs_mean'])}." + verdict]
    return out


def markdown(report: dict) -> str:
    cfg, res = report["config"], report["results"]
    sentence = report["verdict"]["sentence"]
    lines = [f"# Causal-ablation report: {_task_name(cfg)} on {report['model']['name']}", "",
             f"**Verdict.** {sentence}", "", control_sentence(report), "",
             f"Model `{report['model']['path']}` (weights sha256 {report['model']['weights_sha256'][:12]}), "
             f"mode `{cfg['mode']}`, {cfg['n_pairs']} pairs ({report['dataset']['n_samples']} samples, "
             f"{report['dataset']['n_groups']} groups), N = {cfg['distractors']} distractors, seed "
             f"{cfg['seed']}, budget {cfg.get('budget', 'full')}, dataset fingerprint "
             f"{report['dataset']['fingerprint'][:12]}. "
             "Metrics at the probed position T: LD = logit(true) - logit(other) label word; accuracy = "
             + ("LD > 0 (a tie counts 1/2); " if cfg.get("n_classes", 2) <= 2 else
                f"the true word is the argmax of the {cfg['n_classes']} label words (an m-way tie counts 1/m); ") +
             "follows donor = the prediction is the donor's (or, without a donor, the paired sample's) label, "
             "over rows whose donor label differs from their own (on a model that is often wrong, rows follow "
             "the donor with no intervention at all); changed = the prediction differs from the clean run's; "
             "normalized effect = (LD_patched - LD_clean) / (LD_ref - LD_clean) as a ratio of means; 95% CIs "
             "by a bootstrap over groups.", "", "## Clean runs", ""]
    lines.append(_table([{**v, "label": k} for k, v in res["clean"].items()], "mode"))
    sub = res.get("subspace")
    if sub is None:
        lines += ["", f"Fed state: {res.get('fed_state') or 'not applicable (no feedback)'}: no state "
                  "interventions, subspace swaps or dose-response.", ""]
    else:
        lines += ["", f"## Interventions on {_words(res)['noun']} at T", ""]
        lines.append(_table(res["interventions"] + sub["rows"]
                            + [r for r in _leace_rows(res, "state") if r["position"] == -1]))  # others: LEACE table
    if sub is not None:
        if sub.get("skipped"):
            lines += ["", f"Probe subspace (rank {sub['rank']}): not run: {sub['skipped']}.", ""]
        else:
            lines += ["", f"Probe subspace: rank {_rank_words(sub)}, fitted on {_words(res)['state'].split(' ')[0]} of the "
                      f"training folds only ({sub['n_folds']} grouped folds); held-out probe accuracy "
                      f"{_f(sub['probe_heldout_accuracy'])}; share of ||h_donor - h_own||^2 inside it "
                      f"{_f(sub['energy_fraction'], 3)}"
                      + (f"; inside the class-mean differences (rank {sub['class_means_rank']}) "
                         f"{_f(sub['class_means_energy_fraction'], 3)}" if "class_means_energy_fraction" in sub else "")
                      + ". The probe fits standardized features: its direction (coefficient over each coordinate's "
                      "spread) can sit on coordinates that barely vary, so read its swap beside the class means' "
                      "(docs/results.md).", ""]
        lines += ["## Dose-response: h = (1 - a) own + a donor", ""]
        lines.append(_table([{**r, "label": f"a = {r['alpha']:.1f}"} for r in res["dose"]["rows"]], "alpha"))
    lines += _leace_markdown(res)
    ab = res.get("resid_mean_ablation")
    if ab:
        lines += ["", f"## Mean ablation by depth ({ab['mode']}): the residual stream at (depth, T) replaced by its "
                  "batch mean", ""]
        lines.append(_table([{**r, "label": f"depth {r['depth']}"} for r in ab["rows"]], "depth"))
    sw = res.get("position_sweep")
    if sw:
        state = sw.get("site", "state") == "state"
        what = _words(res)["site_t"] if state else f"the residual stream at depth {sw.get('depth')}, position t,"
        # the state at t is column t-1's (identical in both rows while t <= first_diff); the residual at t is column
        # t's own (identical while t < first_diff): `relative` counts from the last identical position either way
        lines += ["", f"## Position sweep: {'state' if state else 'residual'} swap "
                  f"at position t ({sw['mode']}), effect on the answer at T", "",
                  f"{what[0].upper() + what[1:]} of the paired sample replaces the row's own, the rest of the run "
                  "is recomputed from it. Positions aligned from the end; rows whose own or paired columns "
                  "are padding are left out. `at/before diff` = rows whose pair's first differing token is "
                  + ("at or after t (their two states are identical there)." if state else
                     "after t (their two residuals, column t's own, are identical there)."), ""]
        lines.append(_table([{**r, "label": f"{r['position_name']} ({r['n_at_or_before_first_diff']} at/before "
                                             f"diff)"} for r in sw["rows"]], "position"))
        b, a = sw.get("at_or_before_first_diff"), sw.get("after_first_diff")
        lines += ["", "Aligned to the pair's first differing token (relative = t - first differing position"
                  + ("" if state else " + 1: 0 is the last position before it") + "):", ""]
        lines.append(_table([{**r, "label": f"{r['relative']:+d}"} for r in sw["by_first_diff"]], "relative"))
        if sw.get("by_line"):
            lines += ["", "Aligned by line (relative line = line of t - line of the first differing token; "
                      "cells pooled over the line's positions):", ""]
            lines.append(_table([{**r, "label": f"{r['relative_line']:+d}"} for r in sw["by_line"]], "line"))
        if b and a:
            lines += ["", f"Pooled: at or before the first differing token normalized effect "
                      f"{_f(b['normalized_effect'])} (n={b['n']} cells; max |LD change| "
                      f"{_f(sw['max_abs_ld_change_at_or_before_first_diff'], 3)}); after it "
                      f"{_f(a['normalized_effect'])} {_ci(a, 'normalized_effect')} (n={a['n']} cells)."]
        fl = sw.get("first_line_after")
        if fl:
            lines += ["", f"Swap at each row's first position of the line after its first differing token's line, "
                      f"recomputed to T (every row, {fl['n_positions']} distinct positions): follows donor "
                      f"{_f(fl['follows_donor_rate'])} {_ci(fl, 'follows_donor_rate')}, changed "
                      f"{_f(fl['changed_rate'])} {_ci(fl, 'changed_rate')}, normalized effect {_f(fl['normalized_effect'])} "
                      f"{_ci(fl, 'normalized_effect')} (n={fl['n']})."]
            if fl.get("by_diff_line"):
                lines += ["", "The same swap by the prompt line of the pair's first differing token, and by the (own, "
                          "donor) answers:", ""]
                lines.append(_table([{**r, "label": _lines_label(*r["lines"])}
                                     for r in fl["by_diff_line"]], "differing line"))
                lines += [""]
                lines.append(_table([{**r, "label": f"{r['own']} -> {r['donor']}"} for r in fl["by_answers"]],
                                    "own -> donor"))
    lp = res.get("layer_patching")
    if lp:
        lines += ["", "## Layer patching (residual stream from the paired sample): normalized effect", ""]
        for mode in lp["modes"]:
            if mode not in lp:
                continue
            lines += [f"**{mode}**", "", "| depth | " + " | ".join(lp["positions"]) + " |",
                      "|---" * (len(lp["positions"]) + 1) + "|"]
            for i, d in enumerate(lp["depths"]):
                lines.append(f"| {d} | " + " | ".join(_f(v) for v in lp[mode]["normalized_effect"][i]) + " |")
            lines.append("")
    lines += _loop_markdown(res) + _das_markdown(res) + _attribution_markdown(res)
    c = report.get("control")
    if c and c.get("interventions"):
        lines += [f"## {c.get('role', 'control').capitalize()}: {c['model']}", "", _table(c["interventions"]), ""]
    lines += ["", f"Wall time {report['timings_s']['total']:.1f} s."]
    return "\n".join(lines) + "\n"


def html_report(report: dict, plotly: str = "directory") -> str:
    """The report page. plotly.js as `plotly` says (common.plotlyjs.PLOTLY_CHOICES): "directory" loads
    plotly.min.js from the page's folder (write_report stages it there), "inline" embeds it, "cdn" loads it from
    cdn.plot.ly."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    res = report["results"]
    figs = []

    def err(rows, key):  # no interval (null CI): no bar, not a bar of width 0 (which reads as certainty)
        lo = [r[key] - r[key + "_ci"][0] if r.get(key + "_ci") and r[key] is not None else None for r in rows]
        hi = [r[key + "_ci"][1] - r[key] if r.get(key + "_ci") and r[key] is not None else None for r in rows]
        return dict(type="data", symmetric=False, array=hi, arrayminus=lo)

    rows = res["interventions"] + ((res.get("subspace") or {}).get("rows") or []) + _leace_rows(res)
    c = report.get("control")
    crow = [dict(r, name=f"control: {r['name']}") for r in (c.get("interventions") or [])] if c else []
    allrows = rows + crow
    if allrows:  # a model without a fed state and without erasures has no row here: no empty figure
        fig = make_subplots(rows=1, cols=4, subplot_titles=("normalized effect", "accuracy", "follows donor", "changed"))
        for j, key in enumerate(("normalized_effect", "accuracy", "follows_donor_rate", "changed_rate")):
            fig.add_trace(go.Bar(x=[r["name"] for r in allrows], y=[r[key] for r in allrows],
                                 error_y=err(allrows, key), name=key, showlegend=False), row=1, col=j + 1)
        parts = ([_words(res)["noun"]] if res["interventions"] else []) + \
            (["LEACE on the residual stream (leace_resid_d*)"] if _leace_rows(res, "resid") else [])
        fig.update_layout(title=f"Interventions at T: {' and '.join(parts) or 'the rows computed'} "
                                "(bars: 95% bootstrap CI)", height=480)
        figs.append(fig)

    if res.get("dose"):
        dose = res["dose"]["rows"]
        fig = go.Figure()
        for key in ("normalized_effect", "follows_donor_rate", "changed_rate", "accuracy"):
            fig.add_trace(go.Scatter(x=[r["alpha"] for r in dose], y=[r[key] for r in dose],
                                     error_y=err(dose, key), mode="lines+markers", name=key))
        fig.update_layout(title="Dose-response: h = (1 - a) own + a paired donor", xaxis_title="a", height=420)
        figs.append(fig)

    le = res.get("leace") or {}
    if le.get("dose"):
        dose = le["dose"]["rows"]
        fig = go.Figure()
        for key in ("normalized_effect", "follows_donor_rate", "changed_rate", "accuracy"):
            fig.add_trace(go.Scatter(x=[r["alpha"] for r in dose], y=[r[key] for r in dose],
                                     error_y=err(dose, key), mode="lines+markers", name=key))
        fig.update_layout(title="LEACE dose: h + a (LEACE(h) - h), fed state at T (reference: paired sample)",
                          xaxis_title="a", height=420)
        figs.append(fig)

    sw = res.get("position_sweep")
    if sw:
        fig = make_subplots(rows=1, cols=2, subplot_titles=(
            "by position t - T", "by t - first differing token" + ("" if sw.get("site", "state") == "state" else " + 1")))
        for key in ("normalized_effect", "changed_rate"):
            rs = [r for r in sw["rows"] if r[key] is not None]
            fig.add_trace(go.Scatter(x=[r["position"] + 1 for r in rs], y=[r[key] for r in rs],  # offset -1 is T: t - T = 0
                                     error_y=err(rs, key),
                                     mode="lines+markers", name=key), row=1, col=1)
            rs = [r for r in sw["by_first_diff"] if r[key] is not None]
            fig.add_trace(go.Scatter(x=[r["relative"] for r in rs], y=[r[key] for r in rs], error_y=err(rs, key),
                                     mode="lines+markers", name=f"{key} (aligned)"), row=1, col=2)
        site = "State" if sw.get("site", "state") == "state" else f"Residual (depth {sw.get('depth')})"
        fig.update_layout(title=f"{site} swap at position t ({sw['mode']}): effect on the answer at T "
                                "(bars: 95% bootstrap CI)", height=440)
        figs.append(fig)

    lp = res.get("layer_patching")
    if lp:
        modes = [m for m in lp["modes"] if m in lp]
        fig = make_subplots(rows=1, cols=len(modes), subplot_titles=modes)
        for j, m in enumerate(modes):
            z = lp[m]["normalized_effect"]
            fig.add_trace(go.Heatmap(z=z, x=lp["positions"], y=lp["depths"], zmin=-0.2, zmax=1.2,
                                     colorscale="RdBu_r", showscale=j == 0,
                                     text=[[_f(v) for v in row] for row in z], texttemplate="%{text}"),
                          row=1, col=j + 1)
            fig.update_yaxes(title_text="depth", row=1, col=j + 1)
        fig.update_layout(title="Layer patching from the paired sample: normalized effect (depth x position)",
                          height=480)
        figs.append(fig)

    das = res.get("das")
    if das:
        fig = go.Figure()
        rs = das["rows"]
        fig.add_trace(go.Scatter(x=[r["k"] for r in rs], y=[r["iia"] for r in rs], error_y=err(
            [{"iia": r["iia"], "iia_ci": r["iia_ci"]} for r in rs], "iia"), mode="lines+markers", name="DAS"))
        fig.add_trace(go.Scatter(x=[r["k"] for r in rs], y=[r["random_iia"] for r in rs], mode="lines+markers",
                                 name="random subspace"))
        for key, name in (("probe", "probe"), ("leace", "LEACE"), ("full_swap", "whole swap")):
            if das.get(key):
                fig.add_trace(go.Scatter(x=[das[key].get("rank", das["d"])], y=[das[key]["iia"]], mode="markers",
                                         marker=dict(size=12, symbol="diamond"), name=name,
                                         error_y=err([das[key]], "iia")))
        fig.update_layout(title=f"DAS: IIA vs rank k at {das['site']['description']} ({das['mode']}; held-out groups, "
                                "bars: 95% bootstrap CI)", xaxis_type="log", xaxis_title="k", yaxis_title="IIA",
                          height=420)
        figs.append(fig)
    at = res.get("attribution")
    if at:
        z = at["mean_estimate"]
        fig = go.Figure(go.Heatmap(z=z, x=at["position_names"], y=at["sites"], colorscale="RdBu_r", zmid=0,
                                   text=[[_f(v) if v is not None else "" for v in row] for row in z],
                                   texttemplate="%{text}",
                                   customdata=[[_cis(c) for c in row] for row in at["ci"]],
                                   hovertemplate="%{y} at %{x}: %{z:.3f} %{customdata}<extra></extra>"))
        fig.update_layout(title=f"Attribution patching ({at['mode']}): estimated LD change, site x position "
                                "(hover: 95% bootstrap CI)", height=480)
        figs.append(fig)

    from common.plotlyjs import include_plotlyjs

    js = include_plotlyjs(plotly)
    body = []
    for i, f in enumerate(figs):
        body.append(f.to_html(full_html=False, include_plotlyjs=js if i == 0 else False))
    title = f"Causal-ablation report: {_task_name(report['config'])} on {report['model']['name']}"
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title></head><body>"
            f"<h1>{html.escape(title)}</h1><p><b>Verdict.</b> {html.escape(report['verdict']['sentence'])}</p>"
            f"<p>{html.escape(control_sentence(report))}</p>" + "".join(body) + "</body></html>")


def existing_results(out: Path) -> list[str]:
    return [n for n in REPORT_FILES if (out / n).exists()]


def check_no_results(out: Path, overwrite: bool) -> None:
    """UserError when `out` holds an earlier run's causal_report.* and --overwrite was not given."""
    from common.errors import UserError

    found = existing_results(out) if out.is_dir() else []
    if found and not overwrite:
        raise UserError(f"{out} already holds results of an earlier run ({', '.join(found)}{_earlier_mode(out)}); "
                        "pass --overwrite or choose another --out (one folder per mode: e.g. "
                        f"--out {out.as_posix().rstrip('/')}-MODE)")


def _earlier_mode(out: Path) -> str:
    """', mode M' of the earlier report in `out` (a second mode's run into the default folder is the usual cause of
    the refusal), or '' where it cannot be read."""
    try:
        mode = json.loads((out / "causal_report.json").read_text())["config"]["mode"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f", mode {mode}" if isinstance(mode, str) else ""


def write_report(report: dict, out: Path, overwrite: bool, plotly: str = "directory") -> list[Path]:
    """Write the three files to temporaries, then rename them all into place (common.staged): an earlier run's
    files are replaced only once every new one is complete, and no temporary survives an error or interrupt.
    Never replaces results without overwrite; never touches another file in `out` (probes.json, ...)."""
    from common.staged import Staged

    out.mkdir(parents=True, exist_ok=True)
    check_no_results(out, overwrite)
    report = clean_json(report)
    texts = {"causal_report.md": markdown(report), "causal_report.html": html_report(report, plotly),
             "causal_report.json": json.dumps(report, indent=2, allow_nan=False)}  # committed last: marks a complete run
    with Staged(out) as st:
        from common.plotlyjs import stage_plotly_js

        stage_plotly_js(st, plotly)  # plotly.min.js beside the page (shared with depth_curves.html) when needed
        for name, text in texts.items():
            st.file(name, text)
        st.commit()
    return [out / n for n in texts]
