"""The training loop: one process, or several under torchrun with DistributedDataParallel.

Several processes split every step's global batch by rows (training.data.shard), each normalizing its loss by
the global batch's counts (training.loss.Share), and DDP averages their gradients, so a step trains what one
process would: the world size changes the float rounding, not the run (tests/test_ddp.py), except under
`--attn-dropout`, whose masks come from torch's global generator, seeded alike on every rank: each rank draws the
same stream for its own rows, so the masks (not the data) differ from one process's. Rank 0 alone writes
the checkpoints, the log and the progress; every process holds the whole model and optimizer state, so a run can
be resumed on any number of processes.
"""
from __future__ import annotations

import contextlib
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.distributed import Processes
from common.errors import UserError
from tasks import build_tokenizer
from training.checkpoint import load_resume, pending_move, save_checkpoint
from training.config import TrainConfig
from training.data import ROW_FIELDS, longest_sample, make_batches, shard
from training.loss import StepLoss, share_of
from training.model import build_model, context_limit, loop_iterations_at
from training.output import RunOutput
from training.quick_eval import quick_eval, settings


GRAD_CLIP = 1.0  # each step's gradient is clipped to this global norm (docs/usage.md, the optimization row)


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    end = next((e for e in cfg.lr_legs if step < e), cfg.steps)  # the leg this step belongs to
    t = (step - cfg.warmup) / max(1, end - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def noise_generator(cfg: TrainConfig, step: int) -> torch.Generator:
    """The state noise of a step: a CPU stream of (seed, step), the same in every process (each takes its rows)."""
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 97)


def where_it_ran(world: int, device: str, threads: int) -> str:
    """The log's (and card's) "2 processes on cpu, 1 thread each": threads only on cpu."""
    text = f"{world} process{'es' if world != 1 else ''} on {device}"
    return text + (f", {threads} thread{'s' if threads != 1 else ''} each" if device == "cpu" else "")


def _first_nonfinite(model) -> str | None:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return name
    return None


def _wrap(net: StepLoss, procs: Processes):
    """`net` as the module whose forward each process calls: DDP around it when there are several processes.

    find_unused_parameters: a 1-pass step leaves the fusion module out of the graph (every process alike, as the
    pass count is drawn for the global batch); DDP then leaves those gradients as they are, as one process does.
    """
    if procs.world == 1:
        return net
    return DistributedDataParallel(net, device_ids=[procs.device.index] if procs.device.type == "cuda" else None,
                                   find_unused_parameters=True)


def _step_gradients(net, micro, cfg: TrainConfig, gen, procs: Processes):
    """Forward and backward of one step's micro-batches (gradient accumulation: the step's loss is their mean).
    Returns (loss, [per-pass losses], {pass: consistency}) of the global batch."""
    world, loss, parts, cons_sum = procs.world, 0.0, None, {}
    for i, mb in enumerate(micro):
        share = None
        if world > 1:
            share = share_of(mb, cfg, procs.rank, world)
            share = share._replace(targets=share.targets.to(procs.device), fused=share.fused.to(procs.device),
                                   window=share.window.to(procs.device))
            mb = shard(mb, procs.rank, world)
        mb = mb._replace(**{f: getattr(mb, f).to(procs.device) for f in (*ROW_FIELDS, "decoy_donor")
                            if getattr(mb, f) is not None})
        # DDP all-reduces during a backward; the gradients of all micro-batches but the last are only accumulated
        # (no_sync), and the last backward all-reduces their sum. The parameters a step uses are the same in all
        # its micro-batches (one pass count per step), which find_unused_parameters needs under no_sync.
        with net.no_sync() if world > 1 and i < len(micro) - 1 else nullcontext():
            l_mb, p_mb, c_mb = net(mb, gen, share)
            # DDP averages over the processes, and each loss is its process's share of the global batch's
            (l_mb * world / len(micro) if world > 1 else l_mb / len(micro)).backward()
        for j, c in enumerate(c_mb):
            cons_sum[j] = cons_sum.get(j, 0.0) + c.item() / len(micro)
        loss = loss + l_mb.detach() / len(micro)
        parts = [x.detach() / len(micro) for x in p_mb] if parts is None else \
            [a + x.detach() / len(micro) for a, x in zip(parts, p_mb)]
    if world > 1:  # the logged figures (not the gradients): the global batch's, the sum of the processes' shares
        figs = torch.tensor([float(loss), *map(float, parts), *(cons_sum[j] for j in sorted(cons_sum))],
                            dtype=torch.float64, device=procs.device)
        dist.all_reduce(figs)
        loss, parts = figs[0], list(figs[1:1 + len(parts)])
        cons_sum = {j: float(v) for j, v in enumerate(figs[1 + len(parts):])}
    return loss, parts, cons_sum


def train(cfg: TrainConfig, out: Path, staged: bool, *, resume: bool, stop: int, progress: bool = True,
          device: str = "cpu", overwrite: bool = False) -> None:
    """Train `cfg` into `out` up to step `stop` (checked by training.cli: every refusal comes before this)."""
    procs = Processes.start(device)
    try:
        _train(cfg, out, staged, resume, stop, progress, procs, overwrite)
    finally:
        procs.end()


def _train(cfg: TrainConfig, out: Path, staged: bool, resume: bool, stop: int, progress: bool, procs: Processes,
           overwrite: bool = False):
    rank = procs.rank
    cfg.check_world(procs.world)  # the CLI refuses this first; a caller of train() may not
    tok = build_tokenizer()
    if cfg.base:
        from models.loading import load_model
        from models.looped import LoopedLM

        base, tok, _ = load_model(cfg.base)
        if tok is None:
            raise UserError(f"--base {cfg.base}: no tokenizer found beside the model")
        if isinstance(base, LoopedLM):  # its blocks are not the inner LM's parameters: the fusion would wrap a shell
            raise UserError(f"--base {cfg.base}: a looped model (prelude / core x r / coda) takes no fusion; give a "
                            "plain HF causal LM or a feedback checkpoint")
        limit = context_limit(base.lm)
        # packed rows are seq_len tokens (the curriculum's min(seq_len, curriculum_seq_len): never longer; checking
        # curriculum_seq_len refused runs with no curriculum, whose flag for it is refused as doing nothing)
        if limit and cfg.packing and cfg.seq_len > limit:
            raise UserError(f"seq_len ({cfg.seq_len}) must be at most the context of --base {cfg.base} ({limit})")
        # a row past the context: an index error (learned positions) or silent training past it (RoPE)
        rows = longest_sample(cfg, tok) if limit and not cfg.packing else 0
        if limit and rows > limit:
            raise UserError(f"--base {cfg.base}: its training samples at N = {max(cfg.distractors)} are {rows} tokens "
                            f"(one per row without packing), longer than its context ({limit}): lower --distractors, "
                            "or take a base with a longer context")
        for task, n, tokens in settings(tok, cfg, limit)[1] if rank == 0 else []:
            print(f"note: the quick evaluations leave out {task} N={n}: its prompts ({tokens} tokens) are longer "
                  f"than the context of --base {cfg.base} ({limit})")
        del base
    else:
        limit = None
    model = build_model(cfg, len(tok), cfg.base).to(procs.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    with contextlib.ExitStack() as held:
        dest = RunOutput(out, staged, active=rank == 0, resume=resume, overwrite=overwrite)  # the others' write
        #                                                                                        nothing
        procs.together(lambda: held.enter_context(dest))  # a refusal at rank 0's lock is every process's
        if not procs.is_main:
            held.enter_context(dest)
        step, log = 0, {"config": cfg.to_dict(), "history": [], "evals": []}
        if resume:  # every process loads the whole state, whatever the number of processes that saved it
            # rank 0 looks before any process gets past the broadcast to move it: every process agrees
            finishing = procs.broadcast(pending_move(out))
            step, log = load_resume(model, opt, cfg, out, tok)
            if step >= stop and finishing:  # the last save's move, cut short by a kill, was all that was left
                if rank == 0:
                    print(f"--resume: completed the move of step {step}'s checkpoint into {out}, which a kill had "
                          "cut short")
            elif step >= stop:  # nothing to train: one line, not a silent "done"
                raise UserError(f"--resume: the run in {out} is at step {step} already, and --steps / --stop-at ask "
                                f"for {stop}: nothing to train (raise --steps to continue it)")
            if log.get("config") != cfg.to_dict():
                # Continuing under another recipe (e.g. a 1-pass phase shared by several presets, whose batches
                # are identical by construction): keep a record of what ran when.
                log.setdefault("config_changes", []).append({"step": step, "previous": log.get("config")})
                log["config"] = cfg.to_dict()
        net = _wrap(StepLoss(model, cfg), procs)
        saved = step if resume else None
        t0 = time.time() - log.get("wall_s", 0.0)
        # where it ran (the card's wall time means little without it); a resumed run records its last segment's
        log["device"] = where_it_ran(procs.world, procs.device.type, torch.get_num_threads())
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, disable=not progress or rank != 0, dynamic_ncols=True)
        run_loss: dict[int, float] = {}
        tokens_seen, tick = 0, time.time()
        try:
            while step < stop:
                micro = make_batches(cfg, tok, step)
                if limit and max(mb.ids.shape[1] for mb in micro) > limit:  # what longest_sample's draw missed
                    raise UserError(f"step {step}: a training row of {max(mb.ids.shape[1] for mb in micro)} tokens "
                                    f"is longer than the context of --base {cfg.base} ({limit}); lower --distractors")
                gen = noise_generator(cfg, step)
                for g in opt.param_groups:
                    g["lr"] = lr_at(cfg, step)
                opt.zero_grad(set_to_none=False)
                loop_r = loop_iterations_at(cfg, step) if cfg.loop_core else None
                if loop_r is not None:  # this step's iterations (and the truncation of their backward)
                    model.set_iterations(loop_r)
                    model.frozen_iterations = max(0, loop_r - cfg.loop_truncate) if cfg.loop_truncate else 0
                try:
                    loss, parts, cons_sum = _step_gradients(net, micro, cfg, gen, procs)
                finally:
                    if loop_r is not None:
                        model.set_iterations(cfg.loop_iterations)
                        model.frozen_iterations = 0
                k, n = micro[0].k, "; ".join(mb.desc for mb in micro)
                mask = torch.cat([mb.mask.flatten() for mb in micro])
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP))
                lv = float(loss)
                bad = None if math.isfinite(lv) and math.isfinite(grad_norm) else \
                    f"loss {lv}, gradient norm {grad_norm}"
                if bad is None:
                    opt.step()
                    name = _first_nonfinite(model)
                    bad = None if name is None else f"parameter {name} after the update"
                if bad is not None:  # a NaN/inf run is stopped, never saved
                    kept = (f"{out} still holds the earlier run" if staged else
                            f"the last checkpoint in {out} is step {saved}" if saved else "nothing was saved")
                    raise UserError(f"training diverged at step {step + 1}: non-finite {bad}; stopped ({kept})")
                step += 1
                tokens_seen += int(mask.sum()) * k
                run_loss[k] = 0.9 * run_loss.get(k, lv) + 0.1 * lv
                if rank == 0:
                    log["history"].append({"step": step, "passes": k, "batch": n, "loss": round(lv, 5),
                                           **({"loop_iterations": loop_r} if loop_r is not None else {}),
                                           "pass_losses": [round(x.item(), 5) for x in parts],
                                           **({"consistency": [round(cons_sum[j], 5) for j in sorted(cons_sum)]}
                                              if cons_sum else {})})
                    el = time.time() - tick
                    bar.set_postfix({**{f"loss{kk}": f"{v:.3f}" for kk, v in sorted(run_loss.items())},
                                     "tok/s": f"{tokens_seen / max(el, 1e-9):.0f}"})
                    bar.update(1)
                    if step % cfg.eval_every == 0 or step == cfg.steps:
                        ev = quick_eval(model, tok, cfg, limit)
                        log["evals"].append({"step": step, "wall_s": round(time.time() - t0, 1), "label_acc": ev})
                        bar.write(f"step {step}: " + "; ".join(
                            f"{t} " + " ".join(f"{m}={a:.2f}" for m, a in r.items()) for t, r in ev.items()))
                    if step % cfg.save_every == 0 or step in (cfg.steps, stop):
                        log["wall_s"] = round(time.time() - t0, 1)
                        save_checkpoint(model, tok, opt, cfg, step, log, dest.path)
                        saved = step
        finally:
            bar.close()
        dest.commit()
    if rank == 0:
        print(f"done: {step} steps in {time.time() - t0:.0f}s -> {out}")
