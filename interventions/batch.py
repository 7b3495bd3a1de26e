"""What the patching routine works on: a paired batch (Batch), a patch (Patch: site, value, depth, position,
pass) and a run's output (RunOut). Sites and positions are described in interventions/core.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.errors import UserError

SITES = ("state", "fused", "resid", "attn_out", "mlp_out", "head")
BLOCK_SITES = ("attn_out", "mlp_out", "head")  # inside block `layer` (engine.hooks.on_block)
MODES = ("standard", "recurrent-1")  # the default modes of a CausalContext
POSITIONS = (-2, -1)  # T-1, T (kept for callers of the first version)


def pos_name(pos: int) -> str:
    """-1 -> 'T', -3 -> 'T-2'."""
    return "T" if pos == -1 else f"T{pos + 1}"


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
    def from_samples(cls, samples, tokenizer, task) -> "Batch":
        """Tokenize `tasks` samples (pairs share a pair_id and have different labels) into a Batch.

        `task`: a built-in task name or a `tasks.custom.TaskSource` (a researcher's own task)."""
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
                   None if any(d is None for d in dl) else np.array(dl), line.numpy())


@dataclass(frozen=True)
class Patch:
    """Replace the activation at `site` (and `depth` for resid), column `pos`, by `value` [B, D], row by row.

    Block sites (`attn_out`, `mlp_out`, `head`) name block `layer` (0-based, TransformerLens' blocks.{layer});
    `head` the head whose output (value [B, head_dim], before the output projection) is replaced.
    `pass_`: fused-n only, the Jacobi pass (None = the last); ignored by the other modes. `rows` (state patches
    only): a bool [B] mask of the rows patched, the others left as the run has them (several patches at
    different positions then patch each row at its own position in one run)."""

    site: str
    value: torch.Tensor
    depth: int = 0
    pos: int = -1
    pass_: int | None = None
    rows: torch.Tensor | None = None
    layer: int | None = None
    head: int | None = None

    def __post_init__(self):
        if self.site not in SITES:
            raise UserError(f"unknown patch site {self.site!r} (use one of {', '.join(SITES)})")
        if isinstance(self.pos, bool) or not isinstance(self.pos, int) or self.pos >= 0:
            raise UserError(f"patch position must be a negative column offset (-1 = T), got {self.pos!r}")
        if self.pass_ is not None and (not isinstance(self.pass_, int) or self.pass_ < 0):
            raise UserError(f"patch pass must be a non-negative integer, got {self.pass_!r}")
        if (self.site in BLOCK_SITES) != (self.layer is not None) or (self.site == "head") != (self.head is not None):
            raise UserError("attn_out / mlp_out / head patches need `layer` (head patches also `head`); other "
                            "sites take neither")
        if self.rows is not None and (self.site != "state" or self.rows.dtype != torch.bool
                                      or tuple(self.rows.shape) != (self.value.shape[0],)):
            raise UserError("patch rows must be a bool [batch] mask, and only on state patches")


@dataclass
class RunOut:
    logits: torch.Tensor  # [B, V] at T
    top: torch.Tensor | None = None  # clean runs: [B, T, D] top state at every column (last pass for fused-n)
    resid: torch.Tensor | None = None  # clean runs: [B, T, L+1, D] residual stream (last pass for fused-n)
    reads: dict = field(default_factory=dict)
