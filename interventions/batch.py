"""What the patching routine works on: a paired batch (Batch), a patch (Patch: site, value, depth, position,
pass) and a run's output (RunOut), the last two from engine.patching, where sites and positions are described."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.errors import UserError
from engine.patching import BLOCK_SITES, SITES, Patch, RunOut, pos_name  # noqa: F401  (the routine's arguments)

MODES = ("standard", "recurrent-1")  # the default modes of a CausalContext
POSITIONS = (-2, -1)  # T-1, T (kept for callers of the first version)


POS_NAMES = {-2: "T-1", -1: "T"}


@dataclass
class Batch:
    """One evaluation set, left-padded so that T is the last column of every row.

    Labels are indices into `label_ids` (K >= 2 label words); every row's pair has a DIFFERENT label (not
    necessarily the "opposite" one when K > 2). `diff_line` (optional, tracking tasks): the update line where
    the pair members differ.
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B] long, 0..K-1
    pair: torch.Tensor  # [B] long: row index of the paired sample (different label)
    groups: np.ndarray  # [B] cross-validation / bootstrap cluster ids
    label_ids: tuple  # (token id of the label-0 word, ..., label-(K-1) word)
    diff_line: np.ndarray | None = None  # [B] or None
    line_index: np.ndarray | None = None  # [B, T] line (0-based, newlines counted before the column); -1 = pad
    probe_labels: torch.Tensor | None = None  # [B] long: what the probes (subspace, LEACE) fit; None = `labels`
    #   (tasks.pair_roles where the answer has too many classes for grouped CV: interventions.run)

    def __post_init__(self):
        B = self.input_ids.shape[0]
        if self.input_ids.ndim != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise UserError("input_ids and attention_mask must both be [batch, T]")
        if B < 2 or self.input_ids.shape[1] < 2:
            raise UserError("interventions need at least 2 samples of at least 2 tokens")
        if not bool(self.attention_mask[:, -2:].all()):
            raise UserError("prompts must be left-padded with at least 2 real tokens (T-1 and T) per row")
        self.labels = torch.as_tensor(self.labels, dtype=torch.long)
        self.pair = torch.as_tensor(self.pair, dtype=torch.long)
        self.groups = np.asarray(self.groups)
        if self.labels.shape != (B,) or self.pair.shape != (B,) or self.groups.shape != (B,):
            raise UserError("labels, pair and groups need one entry per row")
        self.label_ids = tuple(int(i) for i in self.label_ids)
        K = len(self.label_ids)
        if K < 2 or len(set(self.label_ids)) != K:
            raise UserError("label_ids must be at least two distinct token ids")
        if bool((self.labels < 0).any()) or bool((self.labels >= K).any()):
            raise UserError(f"labels must be in 0..{K - 1} (one per label word)")
        if bool((self.pair < 0).any()) or bool((self.pair >= B).any()):
            raise UserError("pair indices out of range")
        if not bool((self.labels[self.pair] != self.labels).all()):
            raise UserError("every row's pair must have a different label")
        self.probe_labels = self.labels if self.probe_labels is None else \
            torch.as_tensor(self.probe_labels, dtype=torch.long)
        if self.probe_labels.shape != (B,) or len(torch.unique(self.probe_labels)) < 2:
            raise UserError("probe_labels need one entry per row and at least 2 classes")
        if self.diff_line is not None:
            self.diff_line = np.asarray(self.diff_line)
            if self.diff_line.shape != (B,):
                raise UserError("diff_line needs one entry per row")
        if self.line_index is not None:
            self.line_index = np.asarray(self.line_index)
            if self.line_index.shape != tuple(self.input_ids.shape):
                raise UserError("line_index needs one entry per column of every row")

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_classes(self) -> int:
        return len(self.label_ids)

    @property
    def first_diff(self) -> np.ndarray:
        """[B] column offset from the end (-1 = T) of the first column where the row and its pair differ (token
        or padding). The states entering the fusion at every column <= it are identical in the two rows."""
        ids, mask, p = self.input_ids, self.attention_mask, self.pair
        diff = (ids != ids[p]) | (mask != mask[p])  # [B, T]
        T = ids.shape[1]
        first = torch.where(diff.any(1), diff.float().argmax(1), torch.full_like(p, T))
        return (first - T).numpy()

    @classmethod
    def from_samples(cls, samples, tokenizer, task, probe_labels=None) -> "Batch":
        """Tokenize `tasks` samples (pairs share a pair_id and have different labels) into a Batch.

        `task`: a built-in task name or a `tasks.custom.TaskSource` (a researcher's own task); `probe_labels`
        (one per sample, default the labels): what the probes fit."""
        from engine.prefill import pad_left
        from tasks import resolve_task

        src = task if hasattr(task, "label_token_ids") else resolve_task(task)
        ids, samples = src.tokenize(samples, tokenizer)
        input_ids, mask = pad_left(ids, tokenizer.pad_token_id or 0)
        members: dict = {}
        for i, s in enumerate(samples):
            members.setdefault(s.pair_id, []).append(i)
        pair = [-1] * len(samples)
        for m in members.values():
            if len(m) != 2 or samples[m[0]].label == samples[m[1]].label:
                raise UserError("every sample needs its pair (same pair_id, different label) in the dataset")
            pair[m[0]], pair[m[1]] = m[1], m[0]
        dl = [s.diff_line for s in samples]
        newline = {int(i): "\n" in tokenizer.decode([int(i)]) for i in torch.unique(input_ids).tolist()}
        nl = torch.tensor([[newline[int(i)] for i in row] for row in input_ids.tolist()]) & mask.bool()
        line = (torch.cumsum(nl.long(), 1) - nl.long()).masked_fill(~mask.bool(), -1)  # newlines before col
        return cls(input_ids, mask, torch.tensor([s.label for s in samples]), torch.tensor(pair),
                   np.array([s.group_id for s in samples]), tuple(src.label_token_ids(tokenizer, samples[0].text)),
                   None if any(d is None for d in dl) else np.array(dl), line.numpy(), probe_labels)
