"""The default battery of interventions (docs/design.md, Interventions), every one a call of `CausalContext.run`, in the mode
under study (`ctx.mode`: standard, recurrent-k, recurrent-full or fused-n).

Reference for the normalized effect and the flip rate: the donor when there is one (swap, dose, subspace and
layer patches: the paired sample; resample: the random donor), otherwise (bypass, mean, zero, random state)
the paired sample (a different label), so "1" always means "behaves like the other answer's clean run".

Position-specific parts (rows carry `position`, a negative offset from the end: -1 = T):
    position_sweep   the state swap at every fused position t (the paired sample's state at t into row i's
                     run at t, the rest recomputed), effect on the answer at T, as a curve over t; rows are the
                     samples whose own and paired column t-1, t are real tokens. Also aligned to each pair's
                     first differing token (`first_diff`, offset from the end): `by_first_diff` pools, per
                     relative offset rel = t - first_diff, the rows whose swap is rel columns after it; rel <= 0
                     (the states of the two samples are identical there) must give exactly zero effect.
                     `by_line` pools the same cells by line instead: line(t) - line(first differing token)
                     (lines counted by newline tokens, Batch.line_index); tracking tasks also record diff_line.
    layer_patching   the paired sample's residual stream at (depth, t) for every depth and position, in the
                     mode under study and in standard, side by side (TransformerLens-style heatmap); rows are
                     those whose own and paired column t are real tokens.
Both cover the last `max_positions` positions (None = all).
    leace            LEACE erasure of the label (interventions.erasure; eraser per grouped fold, fitted on the
                     training rows, applied to the held-out ones, the subspace swaps' folds): the fed state at T
                     (with a dose), at each chosen position, at every fused position at once (one eraser per
                     position, each applied to the clean run's state there: every fed state is replaced, so
                     nothing the patched run recomputes is fed unerased), and the residual stream at T at each
                     chosen depth. Reference: the paired sample. Rows carry the held-out probe accuracy before and
                     after (the guarantee: chance) and how far the erasure moved the representation.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from common.cli import derived_seed
from common.errors import UserError
from engine.modes import parse_mode
from stats.linear import ProbeConfig

from .batch import Batch, pos_name
from .core import CausalContext
from .metrics import changed, decisions, label_ld, summarize
from .subspace import NoDirection, class_mean_subspaces, energy_fraction, fold_ranks, fold_subspaces, per_fold_states

DOSE_GRID = tuple(round(a / 10, 1) for a in range(11))
LOOP_DOSE = (0.25, 0.5, 0.75)  # the per-iteration dose of a looped model's loop state at T (a = 0 and 1: clean, swap)
METRIC_KEYS = ("ld_mean", "accuracy", "follows_donor_rate", "changed_rate", "normalized_effect")

DESCRIPTIONS = {
    "clean": "no intervention",
    "gate_bypass": "e_T fed to block 0 instead of the fused input",
    "gate_bypass_all": "e_t fed to block 0 instead of the fused input at every position (= standard prefill)",
    "state_swap": "h_{T-1} from the paired sample (different label)",
    "resample": "h_{T-1} from a random sample of another pair",
    "mean": "h_{T-1} replaced by its mean over the batch",
    "zero": "h_{T-1} replaced by zeros",
    "random_state": "h_{T-1} replaced by a Gaussian vector of the same norm",
    "subspace_swap": "only the probe-subspace component of h_{T-1} from the paired sample",
    "complement_swap": "only the component orthogonal to the probe subspace from the paired sample",
    "random_subspace_swap": "only a random subspace (same rank) component from the paired sample",
    "class_means_swap": "only the component along the class-mean differences of h_{T-1} (training folds) from the "
                        "paired sample",
    "leace_state": "the label erased from h_{T-1} by LEACE (fitted on the training groups, applied held out)",
    "leace_state_all": "the label erased by LEACE from the fed state at every fused position (one eraser per "
                       "position, each applied to the clean run's state there)",
    "leace_state_at": "the label erased by LEACE from the fed state at this position only",
    "leace_resid": "the label erased by LEACE from the residual stream at this depth, position T",
    "mean_resid": "the residual stream at this depth, position T, replaced by its mean over the batch",
}

NO_FEEDBACK = "not applicable (no feedback)"


def describe(name: str, ctx: CausalContext, mode: str | None = None) -> str:
    """DESCRIPTIONS[name] in the words of the mode's mechanism (its fed state and its bypass)."""
    words = ctx.words(mode)
    if name in ("gate_bypass", "gate_bypass_all"):
        return words[name]
    return DESCRIPTIONS[name].replace("h_{T-1}", words["state"])


def cap_positions(positions, max_positions):
    positions = list(positions)
    return positions if not max_positions else positions[-max_positions:]


def first_diff_lines(b: Batch) -> np.ndarray | None:
    """Per row: the line index of the pair's first differing token (None without line indices), found from
    the prompts' starts: two prompts of different lengths (an s5 `swap` line against a `cycle` line) share
    their prefix, not their columns, so the end-aligned `Batch.first_diff` would name the longer row's
    first token. The lines after it are the same text in both rows, hence at the same end offsets."""
    if b.line_index is None:
        return None
    T = b.input_ids.shape[1]
    mask = b.attention_mask.bool()
    out = np.empty(b.size, dtype=np.int64)
    for i, j in enumerate(b.pair.tolist()):
        own, other = b.input_ids[i][mask[i]], b.input_ids[j][mask[j]]  # [len] the real tokens
        n = min(len(own), len(other))
        diff = (own[:n] != other[:n]).nonzero()
        k = int(diff[0, 0]) if len(diff) else n  # one prompt a prefix of the other: where the shorter ends
        out[i] = b.line_index[i, T - len(own) + min(k, len(own) - 1)]
    return out


def first_line_after_positions(batch: Batch, fline: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pos [B], has [B]): each row's first column of the line after line `fline[row]`, as an offset from the
    end (-1 = T), and whether the row has such a line (`pos` 0 where not)."""
    T = batch.input_ids.shape[1]
    after = batch.line_index == (fline + 1)[:, None]  # [B, T]
    has = after.any(1)
    return np.where(has, after.argmax(1) - T, 0), has


def line_bins(n_lines: int) -> list[int]:
    """Lower ends of the doubling bins [0], [1], [2, 3], [4, 7], ... that cover line indices 0 .. n_lines - 1."""
    out, lo = [0], 1
    while lo < n_lines:
        out.append(lo)
        lo *= 2
    return out


class Suite:
    def __init__(self, ctx: CausalContext, n_boot: int = 1000, seed: int = 0, max_positions: int | None = None):
        self.ctx, self.n_boot, self.seed, self.max_positions = ctx, n_boot, seed, max_positions
        self.mode = ctx.mode
        self.fed = parse_mode(self.mode).feeds_state  # a state from earlier positions (not standard, not loop-R)
        b = ctx.batch
        self.y = b.labels
        self.timings: dict[str, float] = {}

    # -- metrics ---------------------------------------------------------------------------------------------
    def arrays(self, logits, mode=None, donor=None) -> dict:
        """Per-row arrays of one run: LD patched / clean / reference against (own label, other label)."""
        b = self.ctx.batch
        mode = mode or self.mode
        donor = b.pair if donor is None else donor
        y, r = self.y, self.y[donor]
        other = torch.where(r != y, r, y[b.pair])  # binary: always 1 - y
        clean = self.ctx.clean[mode].logits
        out = {"ld": label_ld(logits, y, b.label_ids, other), "ldc": label_ld(clean, y, b.label_ids, other),
               "ref": label_ld(clean[donor], y, b.label_ids, other), "y": y.numpy(), "r": r.numpy(),
               "groups": b.groups}
        if b.n_classes > 2:
            out["correct"], out["follow"] = decisions(logits, y, r, b.label_ids)
            out["changed"] = changed(logits, clean, b.label_ids)
        return out

    def summary(self, a: dict, rows=None) -> dict:
        if rows is not None:
            a = {k: v[rows] for k, v in a.items()}
        if len(a["ld"]) == 0:
            # every key of a non-empty summary (interventions.metrics.summarize), so readers need no special case
            return {"n": 0, "n_groups": 0, "n_donor_rows": 0, "follows_donor": 0.0, "changed": 0.0,
                    "ld_clean_mean": None, "ld_ref_mean": None,
                    **{k: None for k in METRIC_KEYS}, **{k + "_ci": None for k in METRIC_KEYS}}
        return summarize(a["ld"], a["ldc"], a["ref"], a["y"], a["r"], a["groups"], self.n_boot, self.seed,
                         a.get("correct"), a.get("follow"), a.get("changed"))

    def metrics(self, logits, mode=None, donor=None, rows=None) -> dict:
        return self.summary(self.arrays(logits, mode, donor), rows)

    def precision(self) -> dict | None:
        """Where the model computes in bfloat16 / float16 (None otherwise): the step each label-word logit is rounded
        to (the dtype's spacing at the largest |label-word logit| of the clean run under study) beside the clean
        |LD|. LDs and the effects normalized by them are differences of rounded logits: finer than the step, they
        are rounding (SmolLM2 in bfloat16: logits near 16-32, steps of 0.125-0.25, an unsolved task's LDs near 0.01
        came back as multiples of the step)."""
        dt = self.ctx.dtype
        if not dt.is_floating_point or torch.finfo(dt).bits >= 32:
            return None
        clean = self.ctx.clean[self.mode].logits
        top = float(clean[:, list(self.ctx.batch.label_ids)].abs().max())
        step = torch.finfo(dt).eps * 2.0 ** math.floor(math.log2(top)) if top > 0 else torch.finfo(dt).tiny
        ld = float(np.abs(self.arrays(clean)["ldc"]).mean())
        return {"dtype": str(dt).removeprefix("torch."), "max_abs_label_logit": top, "logit_step": step,
                "clean_abs_ld_mean": ld, "clean_abs_ld_in_steps": ld / step}

    def _timed(self, name, fn):
        t = time.perf_counter()
        out = fn()
        self.timings[name] = time.perf_counter() - t
        return out

    def _real(self, pos: int, fused: bool) -> np.ndarray:
        """Rows whose own and paired column (and, for a fused site, the column before) are real tokens."""
        b = self.ctx.batch
        m = b.attention_mask.bool()
        T = m.shape[1]
        c = T + pos
        ok = m[:, c] & m[b.pair, c]
        if fused:
            ok = ok & m[:, c - 1] & m[b.pair, c - 1]
        return ok.numpy()

    # ---------------------------------------------------------------------------------------------------
    def clean(self) -> dict:
        return {m: self.metrics(self.ctx.clean[m].logits, m, donor=torch.arange(self.ctx.batch.size))
                for m in self.ctx.clean}

    def state_interventions(self) -> list[dict]:
        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        if not self.fed:
            return []
        h = ctx.h_prev
        B = b.size
        g = torch.Generator().manual_seed(self.seed)
        # resample: a uniformly random row of another pair
        rs = torch.randint(0, B - 2, (B,), generator=g)
        pair_lo = torch.minimum(torch.arange(B), b.pair)
        pair_hi = torch.maximum(torch.arange(B), b.pair)
        rs = rs + (rs >= pair_lo).long()
        rs = rs + (rs >= pair_hi).long()
        rnd = torch.randn(h.shape, generator=g, dtype=h.dtype)
        rnd = rnd * (h.norm(dim=-1, keepdim=True) / rnd.norm(dim=-1, keepdim=True))
        runs = [
            ("gate_bypass", lambda: ctx.gate_bypass(mode), None),
            ("state_swap", lambda: ctx.swap_state(b.pair, mode), None),
            ("resample", lambda: ctx.swap_state(rs, mode), rs),
            ("mean", lambda: ctx.patch_state(h.mean(0, keepdim=True).expand_as(h).clone(), mode), None),
            ("zero", lambda: ctx.patch_state(torch.zeros_like(h), mode), None),
            ("random_state", lambda: ctx.patch_state(rnd, mode), None),
            ("gate_bypass_all", lambda: ctx.gate_bypass(mode, "all"), None),
        ]
        out = []
        for name, fn, donor in runs:
            logits = self._timed(name, fn)
            out.append({"name": name, "description": describe(name, self.ctx, mode), "mode": mode,
                        "position": "all" if name == "gate_bypass_all" else -1,
                        "reference": "donor" if donor is not None else "paired sample",
                        **self.metrics(logits, donor=donor)})
        return out

    def subspace(self, rank: int = 1, probe_config: ProbeConfig | None = None) -> dict | None:
        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        if not self.fed:
            return None
        h, donor = ctx.h_prev, ctx.h_prev[b.pair]
        t = time.perf_counter()
        try:
            folds = fold_subspaces(h, b.probe_labels.numpy(), b.groups, rank, probe_config)
            means = class_mean_subspaces(h, b.probe_labels.numpy(), folds)  # the same folds, the plainest direction
        except NoDirection as e:  # no direction to swap along (a state without the label); the rest of the battery
            return {"rank": rank, "skipped": str(e), "rows": []}  # stands, and the report says why these are missing
        self.timings["probe_fit"] = time.perf_counter() - t
        rows = []
        for name, part, rseed, fs in (("subspace_swap", "subspace", None, folds),
                                      ("complement_swap", "complement", None, folds),
                                      ("random_subspace_swap", "subspace", derived_seed(self.seed, 1000), folds),
                                      ("class_means_swap", "subspace", None, means)):
            states = per_fold_states(h, donor, fs, part, rseed)
            logits = self._timed(name, lambda: ctx.patch_state(states, mode))
            rows.append({"name": name, "description": describe(name, self.ctx, mode), "mode": mode, "position": -1,
                         "reference": "donor", **self.metrics(logits)})
        n = sum(len(f.test) for f in folds)
        probe_acc = sum(f.probe_accuracy * len(f.test) for f in folds) / n
        return {"rank": rank, "fold_ranks": fold_ranks(folds), "n_folds": len(folds), "probe_heldout_accuracy": probe_acc,
                "probe_fold_accuracies": [f.probe_accuracy for f in folds],
                "energy_fraction": energy_fraction(h, donor, folds),
                "class_means_rank": int(means[0].U.shape[1]),
                "class_means_energy_fraction": energy_fraction(h, donor, means),
                "rows": rows}

    def leace(self, probe_config: ProbeConfig | None = None, depths=None, positions=(), grid=DOSE_GRID,
              every_position: bool = True) -> dict:
        """LEACE erasure of the label (interventions.erasure): fed state at T (with a dose), at every fused
        position at once, at each of `positions`, and from the residual stream at T at each of `depths`
        (None = every depth). Reference: the paired sample (erasing the label entirely lands near 0.5 on the
        normalized-effect scale of a binary task: LD ~ 0 is halfway between own and paired)."""
        from .core import Patch
        from stats.erasure import FoldErasers, grouped_folds, package_version, probe_check, relative_change

        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        cfg = probe_config or ProbeConfig()
        y, groups = b.probe_labels.numpy(), b.groups
        K = b.n_classes if b.probe_labels is b.labels else int(b.probe_labels.max()) + 1
        t0 = time.perf_counter()
        folds = grouped_folds(y, groups, cfg)
        mask = b.attention_mask.bool()
        T = mask.shape[1]
        rows, dose = [], None

        def row(name, kind, position, logits, check, change, rows_ok=None, **extra):
            return {"name": name, "description": describe(kind, self.ctx, mode), "mode": mode, "position": position,
                    "reference": "paired sample", **extra, "relative_change": change, "probe": check,
                    **self.metrics(logits, rows=rows_ok)}

        if self.fed:
            h = ctx.h_prev
            fe = FoldErasers(h, y, folds, K)
            erased = fe.heldout(h)
            logits = self._timed("leace_state", lambda: ctx.patch_state(erased, mode))
            rows.append(row("leace_state", "leace_state", -1, logits, probe_check(h, y, groups, fe, cfg),
                            relative_change(h, erased), site="state"))
            drows = []
            for a in grid:
                drows.append({"alpha": float(a), "position": -1,
                              **self.metrics(ctx.patch_state(fe.heldout(h, a), mode))})
            dose = {"alphas": [float(a) for a in grid], "site": "state", "rows": drows}
            for pos in positions:
                if pos == -1:
                    continue
                X = ctx.state(mode, pos)
                c = T + pos
                real = (mask[:, c - 1] & mask[:, c]).numpy()  # the row fuses at c: its state there is real
                fp = FoldErasers(X, y, folds, K, fit_mask=real)
                er = fp.heldout(X)
                logits = ctx.patch_state(er, mode, pos)
                rows.append(row(f"leace_state@{pos_name(pos)}", "leace_state_at", pos, logits,
                                probe_check(X, y, groups, fp, cfg, rows=real), relative_change(X, er, real),
                                rows_ok=real, site="state"))
            patches, change_num, change_den = [], 0.0, 0.0
            for pos in (ctx.fused_positions(mode) if every_position else ()):
                X = ctx.state(mode, pos)
                c = T + pos
                real = (mask[:, c - 1] & mask[:, c]).numpy()
                er = FoldErasers(X, y, folds, K, fit_mask=real).heldout(X)
                patches.append(Patch("state", er, pos=pos))
                r = torch.as_tensor(real)
                change_num += float((er - X)[r].double().norm(dim=-1).sum())
                change_den += float(X[r].double().norm(dim=-1).sum())
            if patches:  # one eraser fitted per fused position: the costliest row (--leace-all)
                logits = self._timed("leace_state_all", lambda: ctx.run(mode, patches).logits)
                rows.append(row("leace_state_all", "leace_state_all", "all", logits, None,
                                change_num / change_den if change_den > 0 else None, site="state",
                                n_positions=len(patches)))
        resid = ctx.resid(mode)  # [B, T, L+1, D]
        for d in (range(ctx.n_layers + 1) if depths is None else depths):
            X = resid[:, -1, d]
            fe = FoldErasers(X, y, folds, K)
            er = fe.heldout(X)
            logits = ctx.run(mode, [Patch("resid", er, depth=d, pos=-1)]).logits
            rows.append(row(f"leace_resid_d{d}", "leace_resid", -1, logits, probe_check(X, y, groups, fe, cfg),
                            relative_change(X, er), site="resid", depth=int(d)))
        self.timings["leace"] = time.perf_counter() - t0
        return {"method": "LEACE (Belrose et al. 2023), concept-erasure package", "package_version":
                package_version(), "concept": "one-hot label", "n_folds": len(folds),
                "fit": "each fold's eraser on its training groups, applied to its held-out rows",
                "settings": {"constrain_cov_trace": False, "shrinkage": True, "affine": True},
                "rows": rows, "dose": dose}

    def das(self, config, site: str = "state", depth: int = 0, pos: int = -1, rank: int = 1,
            probe_config: ProbeConfig | None = None, on_fit=None) -> dict:
        """Distributed alignment search at one site (interventions.das): IIA vs rank on held-out groups, beside the
        probe subspace (rank `rank`), LEACE's and a random one, on the same grouped folds and rows. Base: every row;
        source: its paired sample; counterfactual label: the paired sample's."""
        from stats.erasure import FoldErasers, grouped_folds

        from .core import Patch
        from .das import das_battery

        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        cfg = probe_config or ProbeConfig()
        T = b.input_ids.shape[1]
        if site == "state":
            X, ok = ctx.state(mode, pos), self._real(pos, fused=True)
        else:
            X, ok = ctx.resid(mode)[:, T + pos, depth], self._real(pos, fused=False)
        y = b.probe_labels.numpy()
        K = b.n_classes if b.probe_labels is b.labels else int(b.probe_labels.max()) + 1
        folds = grouped_folds(y, b.groups, cfg)
        try:  # fitted on the rows where the site is real, as LEACE's erasers and the scores
            what = "the fed state" if site == "state" else f"the residual at depth {depth}"
            probe_folds, probe_skipped = fold_subspaces(X, y, b.groups, rank, cfg, fit_mask=ok, what=what), None
        except UserError as e:  # too few real rows at this position for the probe's grouped CV
            probe_folds, probe_skipped = None, str(e)
        erasers = FoldErasers(X, y, folds, K, fit_mask=ok)
        donor = X[b.pair]
        full = ctx.run(mode, [Patch(site, donor, depth=depth, pos=pos)]).logits  # the whole swap at the site

        def run(edit):
            return ctx.run_grad(mode, [Patch(site, edit, depth=depth, pos=pos)])

        t = time.perf_counter()
        out = das_battery(run, X, donor, b.labels[b.pair], b.label_ids, b.groups, folds, ok, config, probe_folds,
                          erasers, full, self.n_boot, on_fit)
        self.timings["das"] = time.perf_counter() - t
        # the state entering at pos is the previous column's: h_{T-1} at T, h_{T-43} at T-42
        where = (ctx.words(mode)["state"].replace("T-1", pos_name(pos - 1)) if site == "state"
                 else f"the residual stream at depth {depth}")
        if probe_skipped:
            out["probe_skipped"] = probe_skipped
        return {"site": {"site": site, "depth": depth if site == "resid" else None, "position": pos,
                         "position_name": pos_name(pos), "description": where}, "mode": mode,
                "target": "the paired sample's label (the donor's)", **out}

    def attribution(self, sweep: dict | None = None, layers: dict | None = None, chunk: int = 32,
                    ig_steps: int = 0) -> dict:
        """Attribution patching over every (site, position) (interventions.attribution), checked against the exact
        sweep / layer patching when they ran."""
        from .attribution import attribution

        if sweep is not None:
            sweep = {**sweep, "seconds": self.timings.get("position_sweep")}
        out = attribution(self.ctx, self.n_boot, self.seed, self.max_positions, sweep, layers, chunk, ig_steps)
        self.timings["attribution"] = out["timings_s"]["total"]
        return out

    def loop_iterations(self) -> dict | None:
        """A looped model (models.looped): per iteration i = 0..r of the mode under study, its loop state s_i (the
        residual at depth P + R i; s_0 = e) swapped with the paired sample's at T only and at every position (the
        rest recomputed; with injection every iteration also reads the row's own e), replaced by its batch mean at
        T, a dose at T ((1 - a) s_i + a s_i(donor), a in LOOP_DOSE), the logit lens on it (final norm and head), and
        its relative change from s_{i-1} at T (the fixed-point diagnostic). None for other models."""
        from .core import Patch
        from .metrics import label_ld

        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        spec = getattr(ctx.model, "spec", None)
        if spec is None or not hasattr(ctx.model, "iterations"):
            return None
        m = parse_mode(mode)
        r = m.loop_iterations or spec.iterations
        resid = ctx.resid(mode)  # [B, T, L+1, D]
        runner = ctx.runner(mode)
        # a recirculated mode's own second stream (RecircPatcher.rresid: [B, T, L+1, D], column T-1 never run)
        rresid = runner.rresid().float().cpu() if hasattr(runner, "rresid") else None
        T = b.input_ids.shape[1]
        real = b.attention_mask.bool()
        rows, prev = [], None
        t0 = time.perf_counter()
        for i in range(r + 1):
            d = spec.prelude + spec.core * i
            s_T = resid[:, -1, d]
            swap_T = ctx.run(mode, [Patch("resid", s_T[b.pair], depth=d, pos=-1)]).logits
            donor_all = resid[b.pair][:, :, d]  # [B, T, D]: the paired sample's s_i at every column
            both = (real & real[b.pair]).numpy()
            every = [Patch("resid", torch.where(torch.as_tensor(both[:, c])[:, None], donor_all[:, c], resid[:, c, d]),
                           depth=d, pos=c - T) for c in range(T)]
            if rresid is not None and d > runner.spec.target:
                # under recirculation, later tokens read each earlier column's recirculation branch, which a resid
                # patch above the target depth does not reach (it is the normal branch's): swap that branch too,
                # or "every position" is the swap at T again
                own_r, donor_r = rresid[:, :, d], rresid[b.pair][:, :, d]
                every += [Patch("rresid", torch.where(torch.as_tensor(both[:, c])[:, None], donor_r[:, c], own_r[:, c]),
                                depth=d, pos=c - T) for c in range(T - 1)]
            swap_all = ctx.run(mode, every).logits
            mean_T = ctx.run(mode, [Patch("resid", s_T.mean(0, keepdim=True).expand_as(s_T).clone(), depth=d,
                                          pos=-1)]).logits
            dose_T = [{"alpha": a, **self.metrics(ctx.run(mode, [Patch("resid", (1 - a) * s_T + a * s_T[b.pair],
                                                                       depth=d, pos=-1)]).logits)}
                      for a in LOOP_DOSE]
            with torch.no_grad():
                w = next(ctx.model.parameters())
                lens = ctx.model.head(ctx.model.family.final_norm(ctx.model.lm)(s_T.to(w.device, w.dtype))).float().cpu()
            other = b.labels[b.pair]
            ld_lens = label_ld(lens, b.labels, b.label_ids, other)
            change = None if prev is None else float(((s_T - prev).norm(dim=-1) / s_T.norm(dim=-1).clamp_min(1e-12))
                                                     .mean())
            prev = s_T
            rows.append({"iteration": i, "depth": d, "swap_T": self.metrics(swap_T),
                         "swap_all_positions": self.metrics(swap_all), "mean_T": self.metrics(mean_T),
                         "dose_T": dose_T,
                         "lens_accuracy": float((ld_lens > 0).mean() + 0.5 * (ld_lens == 0).mean()),
                         "lens_ld_mean": float(ld_lens.mean()), "state_change": change})
        self.timings["loop_iterations"] = time.perf_counter() - t0
        return {"mode": mode, "iterations": r, "spec": spec.to_dict(), "reference": "donor (swaps), paired sample "
                "(mean)", "rows": rows}

    def dose(self, grid=DOSE_GRID) -> dict | None:
        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        if not self.fed:
            return None
        h, donor = ctx.h_prev, ctx.h_prev[b.pair]
        rows = []
        t = time.perf_counter()
        for a in grid:
            logits = ctx.patch_state((1 - a) * h + a * donor, mode)
            rows.append({"alpha": float(a), "position": -1, **self.metrics(logits)})
        self.timings["dose"] = time.perf_counter() - t
        self.timings["dose_per_point"] = self.timings["dose"] / max(1, len(grid))
        return {"alphas": [float(a) for a in grid], "rows": rows}

    def sweep_positions(self) -> list[int]:
        """The positions the sweep patches: every fused position (fed modes) or every column (standard), capped."""
        if not self.fed:
            return cap_positions(range(-self.ctx.batch.input_ids.shape[1], 0), self.max_positions)
        return cap_positions(self.ctx.fused_positions(self.mode), self.max_positions)

    def sweep_depth(self, depth: int | None = None) -> int:
        """The residual sweep's depth under standard prefill: `depth`, default the middle of the stack (depth 0
        is the token embedding, which a one-token pair changes only at the differing token itself)."""
        return self.ctx.n_layers // 2 if depth is None else int(depth)

    def position_sweep(self, depth: int | None = None) -> dict | None:
        """The swap at every position t, effect on the answer at T: of the fed state (feedback modes), or of the
        residual stream at `depth` (standard prefill: any model, no feedback needed)."""
        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        fed = self.fed
        depth = None if fed else self.sweep_depth(depth)
        positions = self.sweep_positions()
        first = b.first_diff
        rows, cells = [], []
        t0 = time.perf_counter()
        for pos in positions:
            logits = ctx.swap_state(b.pair, mode, pos) if fed else ctx.patch_resid(mode, depth, pos, b.pair)
            a = self.arrays(logits, mode)
            ok = self._real(pos, fused=fed)
            # the swapped vector is computed from columns before the pair's first differing token (so equal in
            # both rows): the state at t is column t-1's top state (t <= first_diff); the residual at t is
            # column t's own (t < first_diff). Shifting the residual's offset by one gives both one rule, rel <= 0.
            rel = pos - first + (0 if fed else 1)
            rows.append({"position": pos, "position_name": pos_name(pos),
                         "n_at_or_before_first_diff": int((ok & (rel <= 0)).sum()), **self.summary(a, ok)})
            cells.append((a, ok, rel, pos))
        dt = time.perf_counter() - t0
        self.timings["position_sweep"] = dt
        self.timings["position_sweep/per_position"] = dt / max(1, len(positions))

        def pool(select):
            parts = [(a, ok & select(rel)) for a, ok, rel, _ in cells]
            return {k: np.concatenate([a[k][s] for a, s in parts]) for k in cells[0][0]} if cells else None

        by_rel = []
        rels = sorted({int(r) for _, ok, rel, _ in cells for r in rel[ok]})
        for r in rels:
            by_rel.append({"relative": r, **self.summary(pool(lambda rel, r=r: rel == r))})
        before, after = pool(lambda rel: rel <= 0), pool(lambda rel: rel > 0)
        max_before = float(np.abs(before["ld"] - before["ldc"]).max()) if before is not None and len(
            before["ld"]) else None
        out = {"mode": mode, "site": "state" if fed else "resid", "depth": depth, "reference": "donor",
               "positions": positions,
               "position_names": [pos_name(p) for p in positions], "rows": rows,
               "first_diff": first.tolist(), "by_first_diff": by_rel,
               "at_or_before_first_diff": self.summary(before) if before is not None else None,
               "after_first_diff": self.summary(after) if after is not None else None,
               "max_abs_ld_change_at_or_before_first_diff": max_before}
        if b.diff_line is not None:
            out["diff_line"] = b.diff_line.tolist()
        if b.line_index is not None and cells:
            # line of the swapped position relative to the line holding the pair's first differing token
            T = b.input_ids.shape[1]
            fline = self._first_diff_lines()
            rel_line = [b.line_index[:, T + pos] - fline for *_, pos in cells]
            lines = sorted({int(v) for (_, ok, _, _), rl in zip(cells, rel_line) for v in rl[ok]})
            by_line = []
            for v in lines:
                parts = [(a, ok & (rl == v)) for (a, ok, _, _), rl in zip(cells, rel_line)]
                pooled = {k: np.concatenate([a[k][s] for a, s in parts]) for k in cells[0][0]}
                by_line.append({"relative_line": v, **self.summary(pooled)})
            out["by_line"] = by_line
            if fed:  # the swap carried by the recurrence from the next line to T
                out["first_line_after"] = self._first_line_after(fline)
        return out

    def _first_diff_lines(self) -> np.ndarray | None:
        return first_diff_lines(self.ctx.batch)

    def first_line_extra_runs(self) -> int:
        """Patched runs `_first_line_after` adds (one, every row at its own position), for the progress plan."""
        fline = self._first_diff_lines()
        if fline is None or not self.fed:
            return 0
        pos, has = first_line_after_positions(self.ctx.batch, fline)
        return int(bool({int(v) for v in pos[has]} & set(self.ctx.fused_positions(self.mode))))

    def _first_line_after(self, fline: np.ndarray) -> dict | None:
        """The state swap at each row's own first position of the line after its first differing token's line
        (the swap the recurrence must carry from there to T), every row at once: ONE run in which each row is
        patched at its own position (Patch.rows; rows are independent, so this is each row's own swap run),
        whether or not the sweep's last-P window reaches it."""
        from .core import Patch

        b, mode, ctx = self.ctx.batch, self.mode, self.ctx
        pos, has = first_line_after_positions(b, fline)
        fused = set(ctx.fused_positions(mode))
        patches, select = [], np.zeros(b.size, dtype=bool)
        for p in sorted({int(v) for v in pos[has]} & fused):
            rows = has & (pos == p) & self._real(p, fused=True)
            if rows.any():
                patches.append(Patch("state", ctx.state(mode, p)[b.pair], pos=p, rows=torch.as_tensor(rows)))
                select |= rows
        if not patches:
            return None
        a = self.arrays(ctx.run(mode, patches).logits, mode)
        parts = [(a, select)]
        pooled = {k: np.concatenate([a[k][r] for a, r in parts]) for k in parts[0][0]}
        line = np.concatenate([fline[r] for _, r in parts])  # [rows] the pair's differing line
        # Where the answer follows the swap, split two ways: by how deep in the prompt the pair differs (early
        # lines lie within the standard pass's reach, so a model can recompute them without the fed state) and
        # by the (own, donor) answers (a K-way label can follow some donors less than others).
        by_line = []
        for lo in line_bins(int(line.max()) + 1):
            hi = max(1, 2 * lo)
            sel = (line >= lo) & (line < hi)
            if sel.any():  # bins without rows are left out
                by_line.append({"lines": [lo, hi - 1], **self.summary(pooled, sel)})
        by_answers = [{"own": int(y), "donor": int(r), **self.summary(pooled, (pooled["y"] == y) & (pooled["r"] == r))}
                      for y, r in sorted({(int(y), int(r)) for y, r in zip(pooled["y"], pooled["r"])})]
        return {"n_positions": len(patches), **self.summary(pooled), "by_diff_line": by_line, "by_answers": by_answers}

    def resid_mean_ablation(self) -> dict:
        """The residual stream at (depth, T) replaced by its mean over the batch, one run per depth (every mode,
        any model): where along the stack the answer at T stops being recoverable from the rest."""
        ctx, b, mode = self.ctx, self.ctx.batch, self.mode
        from .core import Patch

        resid = ctx.resid(mode)  # [B, T, L+1, D]
        rows = []
        t = time.perf_counter()
        for d in range(ctx.n_layers + 1):
            mean = resid[:, -1, d].mean(0, keepdim=True).expand(b.size, -1).clone()
            logits = ctx.run(mode, [Patch("resid", mean, depth=d, pos=-1)]).logits
            rows.append({"name": f"mean_resid_d{d}", "description": DESCRIPTIONS["mean_resid"], "mode": mode,
                         "depth": d, "position": -1, "reference": "paired sample", **self.metrics(logits)})
        self.timings["resid_mean_ablation"] = time.perf_counter() - t
        return {"mode": mode, "site": "resid", "rows": rows}

    def layer_patching(self, modes=None, depths=None) -> dict:
        ctx, b = self.ctx, self.ctx.batch
        L = ctx.n_layers
        T = b.input_ids.shape[1]
        modes = [m for m in (modes or ctx.modes) if m in ctx.clean]
        positions = cap_positions(range(-T, 0), self.max_positions)
        depths = list(range(L + 1)) if depths is None else list(depths)
        out = {"modes": modes, "positions": [pos_name(p) for p in positions], "offsets": positions,
               "depths": depths, "reference": "donor", "cells": {},
               "top_depth": {m: ctx.runners[m].L for m in modes}}
        for mode in modes:
            if max(depths) > ctx.runners[mode].L:  # a loop-R mode's stack is deeper than standard's (trained r)
                raise UserError(f"layer patching depth {max(depths)} is beyond {mode}'s depth 0..{ctx.runners[mode].L}")
            grid = {k: [[None] * len(positions) for _ in depths] for k in METRIC_KEYS}
            cells = []
            t = time.perf_counter()
            for j, pos in enumerate(positions):
                ok = self._real(pos, fused=False)
                for i, d in enumerate(depths):
                    m = self.metrics(ctx.patch_resid(mode, d, pos, b.pair), mode, rows=ok)
                    for k in grid:
                        grid[k][i][j] = m[k]
                    cells.append({"depth": d, "position": pos, "position_name": pos_name(pos), **m})
            self.timings[f"layer_patching/{mode}"] = time.perf_counter() - t
            self.timings[f"layer_patching/{mode}/per_cell"] = self.timings[f"layer_patching/{mode}"] / len(cells)
            out[mode] = grid
            out["cells"][mode] = cells
        return out


def evenly(values, k: int | None) -> list:
    """At most k of `values`, evenly spaced, first and last kept (None = all)."""
    values = list(values)
    if k is None or len(values) <= k:
        return values
    ix = np.unique(np.round(np.linspace(0, len(values) - 1, k)).astype(int))
    return [values[i] for i in ix]


def run_suite(ctx: CausalContext, rank: int = 1, n_boot: int = 1000, seed: int = 0, dose_grid=DOSE_GRID,
              layers: bool = True, probe_config: ProbeConfig | None = None, progress=None,
              max_positions: int | None = None, sweep: bool = True, leace: bool = True, erase_depths=None,
              erase_positions=(), layer_depths=None, sweep_depth: int | None = None, ablation: bool = True,
              leace_all: bool = True, das=None, das_site: tuple = ("state", 0, -1),
              attribution: bool = False, attribution_ig: int = 0) -> dict:
    """Every intervention of the report on one context; returns the JSON-ready result dict.

    Under standard prefill, or on a model without feedback (any HF causal LM), the fed-state analyses are
    marked not applicable (`results["fed_state"]`) and what needs no fed state runs: layer patching, the
    position sweep of residual swaps (at `sweep_depth`) and mean ablation by depth.
    `erase_depths` (None = all) and `erase_positions` configure the LEACE rows (Suite.leace); `layer_depths`
    (None = all) the heatmap's rows. `progress` (interventions.progress.Progress or None) is told each stage and
    its planned number of patched runs, and every patched run (CausalContext.on_run).
    `das` (interventions.das.DasConfig or None): distributed alignment search at `das_site` = (site, depth, pos)
    (progress: one step per fitted rotation); `attribution`: attribution patching over every site and position,
    compared with the exact sweep and layer patching of the same run (one step)."""
    s = Suite(ctx, n_boot, seed, max_positions)
    fed = s.fed
    L, grid = ctx.n_layers, list(dose_grid)
    steps = [("clean", s.clean, 0)]
    if fed:
        steps += [("interventions", s.state_interventions, 7), ("subspace", lambda: s.subspace(rank, probe_config), 4),
                  ("dose", lambda: s.dose(dose_grid), len(grid))]
    if leace:
        n_depths = L + 1 if erase_depths is None else len(erase_depths)
        n_leace = n_depths + ((1 + int(leace_all) + len(grid) + len([p for p in erase_positions if p != -1]))
                              if fed else 0)
        steps.append(("leace", lambda: s.leace(probe_config, erase_depths, erase_positions, dose_grid, leace_all),
                      n_leace))
    if ablation:
        steps.append(("resid_mean_ablation", s.resid_mean_ablation, L + 1))
    if getattr(ctx.model, "spec", None) is not None and hasattr(ctx.model, "iterations"):  # a looped model
        m = parse_mode(ctx.mode)
        r = m.loop_iterations or ctx.model.spec.iterations
        steps.append(("loop_iterations", s.loop_iterations, (3 + len(LOOP_DOSE)) * (r + 1)))
    if sweep:
        steps.append(("position_sweep", lambda: s.position_sweep(sweep_depth),
                      len(s.sweep_positions()) + (s.first_line_extra_runs() if fed else 0)))
    if layers:
        depths = list(range(L + 1)) if layer_depths is None else list(layer_depths)
        n_pos = len(cap_positions(range(ctx.batch.input_ids.shape[1]), max_positions))
        steps.append(("layer_patching", lambda: s.layer_patching(depths=depths),
                      n_pos * len(depths) * len(ctx.modes)))
    if das is not None:
        from stats.erasure import grouped_folds

        n_fits = len(set(das.ranks)) * len(grouped_folds(ctx.batch.probe_labels.numpy(), ctx.batch.groups,
                                                         probe_config or ProbeConfig()))
        site, depth, pos = das_site
        steps.append(("das", lambda: s.das(das, site, depth, pos, rank, probe_config,
                                           progress.step if progress is not None else None), n_fits + 1))
    if attribution:
        steps.append(("attribution", lambda: s.attribution(res.get("position_sweep"), res.get("layer_patching"),
                                                           ig_steps=attribution_ig), 0))
    if progress is not None:
        progress.plan(sum(n for *_, n in steps))
        ctx.on_run = progress.step
    res = {}
    try:
        for name, fn, n in steps:
            if progress is not None:
                progress.stage(name, n)
            res[name] = fn()
    finally:
        ctx.on_run = None
    if not fed:
        why = ("standard prefill feeds no state" if ctx.model.has_fusion else "the model has no fusion module")
        if parse_mode(ctx.mode).loop_iterations is not None:
            why = f"{ctx.mode} feeds no state across positions (its feedback is in depth)"
        res["fed_state"] = f"{NO_FEEDBACK}: {why}"
        res.setdefault("interventions", [])
        for k in ("subspace", "dose"):
            res.setdefault(k, None)
    if fed:
        res["state_words"] = ctx.words()  # how the report names this mechanism's fed state
    res["precision"] = s.precision()
    res["timings_s"] = s.timings
    return res


def run_control(ctx: CausalContext, n_boot: int = 1000, seed: int = 0) -> dict:
    """The negative control: clean, state swap, gate bypass and zero on another model (same batch, same mode)."""
    s = Suite(ctx, n_boot, seed)
    if not ctx.fused_positions():
        why = ("the control model has no fusion module: the fed state does not exist there"
               if ctx.mode == "standard" and not ctx.model.has_fusion else "standard prefill has no fed state")
        return {"clean": s.clean(), "interventions": [], "note": why}
    rows = []
    for name, fn in (("state_swap", lambda: ctx.swap_state(ctx.batch.pair)), ("gate_bypass", ctx.gate_bypass),
                     ("zero", lambda: ctx.patch_state(torch.zeros_like(ctx.h_prev)))):
        rows.append({"name": name, "description": describe(name, ctx), "mode": ctx.mode, "position": -1,
                     "reference": "paired sample", **s.metrics(fn())})
    return {"clean": s.clean(), "interventions": rows}
