"""What probes.run adds beside each depth's probe score: the logit lens, the online code (MDL) and the
LEACE-erased depth curve of one run (docs/methods.md)."""
from __future__ import annotations

class MethodFields:
    """The logit lens, the online code and the LEACE-erased depth curve of one run (docs/methods.md)."""

    def __init__(self, model, label_ids, config, mdl: bool, no_lens: str | None = None):
        self.model, self.label_ids, self.config, self.mdl = model, label_ids, config, mdl
        self.no_lens = no_lens  # why the label words have no token ids here (the lens fields are then null)

    def add(self, rows, acts, y, groups, answers=None):
        """rows of one (mode, N[, writes]) + logit_lens_* and mdl_* per depth. `y`: what the probes fit (the MDL
        code too); `answers` (default `y`): the label indices the lens reads as words (they differ where the
        probes fit the pair role, tasks.probe_labels)."""
        from threadpoolctl import threadpool_limits

        from probes.lens import LENS_FIELDS, depth_lens
        from probes.mdl import MDL_FIELDS, depth_mdl

        lens = [dict.fromkeys(LENS_FIELDS)] * acts.shape[1] if self.label_ids is None else \
            depth_lens(self.model, acts, y if answers is None else answers, self.label_ids, groups,
                       self.config.n_boot, self.config.random_state)
        with threadpool_limits(limits=1, user_api="blas"):  # probe-sized fits: one BLAS thread (_score_depths)
            mdl = [m.fields() for m in depth_mdl(acts, y, groups, self.config)] if self.mdl else None
        for d, r in enumerate(rows):
            r.update(lens[d])
            r.update(mdl[d] if mdl else dict.fromkeys(MDL_FIELDS))
        return rows

    def fed_state(self, task, model_name, mode, n, ids, y, groups, pad_id, batch_size):
        """[row] of the lens on the state fed into T (feedback modes), else []."""
        from probes.lens import fed_state_mode, fed_states, lens_logits, lens_summary

        if fed_state_mode(mode) is None or self.label_ids is None:
            return []
        logits = lens_logits(self.model, fed_states(self.model, ids, mode, pad_id, batch_size), normed=True)
        return [{"task": task, "model": model_name, "mode": mode, "n_distractors": n, "writes": None,
                 "state": "h_{T-1}", "n_samples": int(len(y)),
                 **lens_summary(logits, y, self.label_ids, groups, self.config.n_boot, self.config.random_state)}]

    def erased(self, task, model_name, mode, n, ids, samples, acts, depth, batch_size, pad_id, y=None):
        """Rows of the depth curve after LEACE at (depth, T) (probes.erase), [] for recirc modes; `y`: the labels the
        clean curve's probes fit (default the answers; the pair roles where tasks.probe_labels says so)."""
        from engine.modes import parse_mode
        from probes.erase import erased_depth_rows

        if parse_mode(mode).is_recirculation:
            return []
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):  # as _score_depths: exactly repeatable probe fits
            rows = erased_depth_rows(self.model, ids, samples, self.label_ids, mode, depth, acts, self.config,
                                     batch_pairs=max(1, batch_size // 2), pad_id=pad_id, y=y)
        return [{"task": task, "model": model_name, "mode": mode, "n_distractors": n, "writes": None, **r}
                for r in rows]

    def meta(self, erase):
        from probes.lens import LENS_META
        from probes.mdl import mdl_meta

        out = {"lens": LENS_META if self.no_lens is None else {**LENS_META, "enabled": False,
                                                               "reason": self.no_lens},
               "mdl": mdl_meta(self.mdl)}
        if erase is not None:
            from probes.erase import erase_meta

            out["erase"] = erase_meta(erase)
        return out
