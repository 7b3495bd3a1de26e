"""The training objectives: weighted next-token loss, the multi-pass (Jacobi) loss, the recurrent loss, and
`StepLoss`, one micro-batch's loss as a module forward (what DistributedDataParallel wraps, training.loop).

A micro-batch split over processes (training.data.shard) is normalized by the GLOBAL micro-batch's counts
(`Share`), so the processes' losses add up to the loss of the whole micro-batch: a mean over each process's own
rows would weigh a row by how many targets its process's other rows happen to have.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from common.errors import UserError
from engine.prefill import fixed_point_top, recurrent_logits, shift_state
from training.config import TrainConfig
from training.data import FIXED_POINT, Batch, has_rows, rows_of


class Share(NamedTuple):
    """This process's part of a micro-batch split over processes."""
    rows: slice  # its rows of the global micro-batch
    total: int  # rows of the global micro-batch: the state noise is drawn for all of them, each process takes its own
    targets: torch.Tensor  # the global micro-batch's sum of target weights (ntp_loss) or number of dense targets
    fused: torch.Tensor  # the global micro-batch's number of fused positions (the consistency mean), >= 1
    window: torch.Tensor  # ... and of fused positions in the consistency window, >= 1
    weight: float = 1.0  # 0: a process past the rows of a micro-batch with fewer rows than processes (a repeat row)


def dense_loss(logits: torch.Tensor, dense: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits at the columns that have a dense target (`total`: divide the sum by the
    global micro-batch's number of dense targets instead)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if total is None:
        return F.cross_entropy(flat, dense.reshape(-1), ignore_index=-100)
    return F.cross_entropy(flat, dense.reshape(-1), ignore_index=-100, reduction="sum") / total


def target_weights(ids, mask, label_weight: float, label_pos=None, skip_pos=None, labels_only: bool = False):
    """[batch, pos - 1] loss weight of each next-token target (see ntp_loss)."""
    valid = (mask[:, 1:] * mask[:, :-1]).float()
    w = valid.clone()
    is_label = torch.zeros_like(w, dtype=torch.bool)
    if label_pos is None:
        is_label[:, -1] = True
    else:
        is_label = label_pos[:, 1:]
    w = w * is_label if labels_only else torch.where(is_label, w * label_weight, w)
    if skip_pos is not None:
        w = w.masked_fill(skip_pos[:, 1:], 0.0)
    return w


def ntp_loss(logits, ids, mask, label_weight: float, label_pos=None, skip_pos=None, labels_only: bool = False,
             total: torch.Tensor | None = None):
    """Weighted next-token loss; label-word targets get `label_weight` (default: each row's last token);
    targets at `skip_pos` get weight 0; `labels_only`: the label targets alone (each weight 1). `total`: divide
    by the global micro-batch's sum of weights instead of this batch's."""
    w = target_weights(ids, mask, label_weight, label_pos, skip_pos, labels_only)
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                          reduction="none")
    den = w.sum() if total is None else total
    if not bool(den > 0):  # 0 / 0 would stop the run as "diverged"
        raise UserError("a training batch holds no loss target (rows too short to hold a whole sample, e.g. "
                        "--seq-len below one prompt under --targets labels): lengthen --seq-len")
    return (nll.view_as(w) * w).sum() / den


def fuse_positions(mask, fuse_from=None) -> torch.Tensor:
    """[batch, pos] bool: where a fused pass fuses (the previous column real, prefix mixin: not before fuse_from)."""
    fuse = shift_state(mask[..., None].float(), mask)[1]
    return fuse if fuse_from is None else fuse & (torch.arange(mask.shape[1], device=mask.device)[None] >=
                                                  fuse_from[:, None])


def window_positions(label_pos, mask, fuse_mask, width: int) -> torch.Tensor:
    """[batch, pos] bool: the fused columns whose states predict a label target or sit < `width` before one."""
    if label_pos is None:  # as ntp_loss: each row's last token is its label
        label_pos = torch.zeros_like(mask, dtype=torch.bool)
        label_pos[:, -1] = True
    window = torch.zeros_like(label_pos)
    for j in range(1, width + 1):
        window[:, :-j] |= label_pos[:, j:]
    return window & fuse_mask


def _largest_everywhere(device):
    """float -> its largest value over the processes (one process: itself), for a decision every process makes alike."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None

    def reduce(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    return reduce


def share_of(mb: Batch, cfg: TrainConfig, rank: int, world: int) -> Share:
    """The normalizers of process `rank`'s rows of the global micro-batch `mb` (computed from `mb` itself: every
    process holds the global batch, so no communication is needed)."""
    if mb.dense is not None:
        targets = (mb.dense != -100).sum().float()
    else:
        targets = target_weights(mb.ids, mb.mask, cfg.label_weight, mb.label_pos, mb.skip_pos,
                                 cfg.targets == "labels").sum()
    fuse = fuse_positions(mb.mask, mb.fuse_from)
    window = window_positions(mb.label_pos, mb.mask, fuse, cfg.consistency_window)
    n = mb.ids.shape[0]
    return Share(rows_of(n, rank, world), n, targets, fuse.sum().clamp_min(1), window.sum().clamp_min(1),
                 1.0 if has_rows(n, rank, world) else 0.0)


def multipass_loss(model, ids, mask, k: int, cfg: TrainConfig, fuse_from=None, generator=None, warm: int = 0,
                   label_pos=None, skip_pos=None, extras: dict | None = None, dense=None, share: Share | None = None):
    """Returns (total loss, [per-pass NTP losses]); `extras`, if given, receives the per-pass consistency terms.
    `dense` [batch, pos]: target ids at each column (dense_loss) instead of the next-token targets. `share`: these
    rows are one process's part of a larger micro-batch (normalized as that batch; its noise drawn for all rows).

    `warm` > 0 (recipe option, off in the paper's objective): before pass 2, run that many extra Jacobi passes
    without gradient starting from pass 1's states, so pass 2 sees states closer to the recurrent fixed point
    that `recurrent-full` and long `fused-n` produce at inference. `warm` = FIXED_POINT: pass 2 starts from that
    fixed point itself (no gradient through it: pass 2's loss trains one step of the map at its fixed point,
    as a deep-equilibrium model's one-step gradient), computed for this batch's fuse mask without noise.
    `cfg.consistency` > 0 (recipe option): adds consistency/(K-1) * sum_k C_k, C_k = mean over fused positions of
    ||top_k - sg(top_1)||^2 / ||sg(top_1)||^2, pulling every fused pass toward the standard pass's states at
    every position (the label NTP alone lets a fused pass relay what pass 1 computed instead of reading its token
    through the gate, a shortcut that is gone at the fixed point; docs/recipe.md). `cfg.consistency_window` = W > 0
    adds to C_k the same mean over the fused positions among the W before each label target alone.
    """
    def loss_of(logits):
        if dense is not None:
            return dense_loss(logits, dense, None if share is None else share.targets)
        return ntp_loss(logits, ids, mask, cfg.label_weight, label_pos, skip_pos, cfg.targets == "labels",
                        None if share is None else share.targets)

    deep = k > 1 and cfg.consistency > 0 and cfg.consistency_layers == "all"
    out = model(ids, mask, hidden_states=deep)
    losses = [loss_of(out.logits)]
    cols = torch.arange(ids.shape[1], device=ids.device)[None]
    # sigmoid(W_G e) depends on the tokens only: computed once per batch, its gradient summed over the passes.
    gate = model.token_gate(ids) if k > 1 else None

    def shifted(top):  # the carried state and where it is fused (prefix mixin: not before fuse_from)
        state, fuse = shift_state(top, mask)
        return state, fuse if fuse_from is None else fuse & (cols >= fuse_from[:, None])

    def fused_pass(top, hidden=deep):
        state, fuse = shifted(top)
        if cfg.noise > 0:
            # Drawn on the CPU for the whole micro-batch, so the noise does not depend on the device or on how
            # the rows are split over processes; each process adds its rows' part.
            shape = state.shape if share is None else (share.total, *state.shape[1:])
            noise = torch.rand(shape, generator=generator, dtype=state.dtype)
            noise = (noise if share is None else noise[share.rows]).to(state.device) * 2 - 1
            state = state + cfg.noise * noise
        return model(ids, mask, state=state, fuse_mask=fuse, gate=gate, hidden_states=hidden)

    def states(o):  # the states compared by the consistency term: the top, or every block's output
        return o.hidden[1:] if deep else (o.top,)

    top, cons = out.top, []
    if k > 1 and cfg.consistency > 0:
        target = [h.detach() for h in states(out)]  # [batch, pos, d_model] each: the standard pass's, no gradient
        fuse_mask = shifted(top)[1]  # [batch, pos]
        if cfg.consistency_window > 0:
            window = window_positions(label_pos, mask, fuse_mask, cfg.consistency_window)
        n_fused = fuse_mask.sum().clamp_min(1) if share is None else share.fused
        n_window = (window.sum().clamp_min(1) if share is None else share.window) if cfg.consistency_window else None
    if k > 1 and warm == FIXED_POINT:
        top = fixed_point_top(model, ids, mask, shifted(top)[1], gate.detach(), tol=cfg.fixed_point_tol or None,
                              start=top.detach(), rows=None if share is None else share.total,
                              reduce_max=None if share is None else _largest_everywhere(ids.device))
    elif k > 1 and warm > 0:
        with torch.no_grad():
            for _ in range(warm):
                top = fused_pass(top, hidden=False).top
    for _ in range(2, k + 1):
        out = fused_pass(top)
        top = out.top
        losses.append(loss_of(out.logits))
        if cfg.consistency > 0:
            rel = sum((h - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)
                      for h, t in zip(states(out), target)) / len(target)  # [batch, pos]
            c = (rel * fuse_mask).sum() / n_fused
            if cfg.consistency_window > 0:
                c = c + (rel * window).sum() / n_window
            cons.append(c)
    total = losses[0] + (cfg.lam / (k - 1)) * sum(losses[1:]) if k > 1 else losses[0]
    if cons:
        total = total + (cfg.consistency / (k - 1)) * sum(cons)
    if extras is not None:
        extras["consistency"] = cons
    return total, losses


class StepLoss(torch.nn.Module):
    """One micro-batch's loss as the forward of a module that owns the model.

    DistributedDataParallel all-reduces the gradients from hooks that its forward prepares, and expects ONE
    forward per backward, from whose outputs it finds the parameters the backward will reach. The trainer runs the
    model several times per micro-batch (K passes, warm and fixed-point passes, the cached recurrence, through
    engine functions that call the model directly) and its gate through token_gate, not forward. DDP around the
    model would see several forwards per backward, and the engine's direct calls would bypass it; DDP around this
    module sees one forward, whose output (the loss) the whole backward starts from.
    """

    def __init__(self, model, cfg: TrainConfig):
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, mb: Batch, generator=None, share: Share | None = None):
        """(loss, [per-pass losses], [per-pass consistency terms]) of the micro-batch `mb` (these rows' share of
        the global micro-batch's loss when `share` is given)."""
        cfg = self.cfg
        if cfg.objective == "recurrent":  # backpropagation through the whole recurrence
            swap = None
            if mb.swap is not None:  # interchange training: rows 2i and 2i + 1 are each other's donors
                rows = torch.arange(mb.ids.shape[0], device=mb.ids.device)
                swap = (mb.swap, rows ^ 1)
            decoy = None if mb.decoy is None else (mb.decoy, mb.decoy_donor)
            logits = recurrent_logits(self.model, mb.ids, mb.mask, swap, decoy)
            total = None if share is None else share.targets
            loss = dense_loss(logits, mb.dense, total) if mb.dense is not None else \
                ntp_loss(logits, mb.ids, mb.mask, cfg.label_weight, mb.label_pos, mb.skip_pos, cfg.targets == "labels",
                         total)
            parts, cons = [loss], []
        else:
            ex: dict = {}
            loss, parts = multipass_loss(self.model, mb.ids, mb.mask, mb.k, cfg, mb.fuse_from, generator, mb.warm,
                                         mb.label_pos, mb.skip_pos, extras=ex, dense=mb.dense, share=share)
            cons = ex["consistency"]
        if share is not None and share.weight != 1.0:  # a repeat row: run (DDP needs every process), count nothing
            loss, parts, cons = loss * share.weight, [x * share.weight for x in parts], [c * share.weight for c in cons]
        return loss, parts, cons
