"""Write MODEL_CARD.md for a trained checkpoint from its train_log.json and eval.json.

    python -m training.card checkpoints/tiny-fbt --command "python -m training.train --preset tiny-fbt" --notes notes.md
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from pathlib import Path

from common.cli import Parser
from common.errors import UserError, cli_entry
from common.io import atomic_write
from common.jsonio import read_user_json
from engine.modes import EVAL_MODES as DEFAULT_EVAL_MODES
from models.full_bandwidth import FullBandwidthLM
from training.config import most_loop_iterations


def fused_sweep(rows: list[dict]) -> list[int]:
    """[1..K] where the rows hold every fused-k of a sweep 1..K (K >= 2), else []: fused-3 and fused-8 alone are
    two modes, not a sweep (their minimum is no "min fused-1..8")."""
    ks = sorted({int(r["mode"].split("-")[1]) for r in rows if re.fullmatch(r"fused-\d+", r["mode"])})
    return ks if len(ks) >= 2 and ks == list(range(1, ks[-1] + 1)) else []


def eval_table(rows: list[dict], modes: list[str]) -> str:
    keys = list(dict.fromkeys((r["task"], r["n_distractors"]) for r in rows))
    by = {(r["task"], r["n_distractors"], r["mode"]): r for r in rows}
    sweep = fused_sweep(rows)
    head = "| task | N | " + " | ".join(modes) + (f" | min fused-1..{sweep[-1]} |" if sweep else " |")
    lines = [head, "|" + "---|" * (len(modes) + 2 + bool(sweep))]
    for t, n in keys:
        cells = [f"{by[(t, n, m)]['accuracy']:.3f}" if (t, n, m) in by else "-" for m in modes]
        if sweep:
            cells.append(f"{min(by[(t, n, f'fused-{k}')]['accuracy'] for k in sweep):.3f}")
        lines.append(f"| {t} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _layout(tc: dict) -> str:
    if tc.get("packing", True):
        head = f"packed rows of {tc.get('seq_len')} tokens streaming samples of all tasks"
        cur = f"{tc.get('curriculum_seq_len', 256)}-token rows"
    else:
        w = tc.get("task_weights")
        head = "one sample per row, one micro-batch per task per step" + (
            f" (token shares {', '.join(f'{t} {x:g}' for t, x in zip(tc.get('tasks', []), w))})" if w else "")
        cur = "same layout"
    if tc.get("curriculum_steps"):
        head += f"; first {tc.get('curriculum_steps')} steps 1-pass, N <= {tc.get('curriculum_max_n', 8)}, {cur}"
    return head


def _legs(log: dict) -> str:
    """How the cosine was spread: lr_legs in one run, or the --steps of each resumed leg of a chain."""
    legs = log.get("config", {}).get("lr_legs") or \
        [c["step"] for c in log.get("config_changes", []) if c["previous"].get("steps") == c["step"]]
    return f", re-spread at steps {', '.join(map(str, legs))} (legs)" if legs else ""


def _attention(base: dict) -> str:
    types = base.get("layer_types") or []
    n = sum(t == "sliding_attention" for t in types)
    if not n:
        return ""
    where = "every layer" if n == len(types) else f"{n} of {len(types)} layers"
    return f"; sliding-window attention ({base.get('sliding_window')} tokens) in {where}"


def _fused_passes(tc: dict) -> bool:
    """Whether the multi-pass objective ran fused passes (a schedule with weight past one pass)."""
    if tc.get("objective") == "recurrent":
        return False
    try:
        weights = [float(w) for w in str(tc.get("schedule", "1")).split("/")]
    except ValueError:
        return True
    return any(w > 0 for w in weights[1:])


def _objective(tc: dict, loop) -> list[str]:
    """The objective's settings as trained: only those that shaped a batch (a 1-pass or recurrent run lists no
    warm passes, state noise or prefix mixin: its recipe carries their values, unused)."""
    if tc.get("dense_targets"):
        targets = ("loss on the labels and on the running value at the end of every update line"
                   + (" and every column between" if tc.get("dense_every") else ""))
    elif tc.get("targets") == "labels":
        targets = "loss on the label tokens only"
    else:
        targets = f"label-token loss weight {tc.get('label_weight')}"
    if tc.get("objective") == "recurrent":
        parts = ["objective: recurrent (recurrent-full with backpropagation through the whole recurrence; no fused "
                 "passes)", targets]
    elif not _fused_passes(tc):
        parts = [f"pass schedule (1/2/3... passes): {tc.get('schedule')} (one standard pass per batch: no fused "
                 "pass, state noise or warm pass)", targets]
    else:
        fp, wp = tc.get("fixed_point_prob") or 0, tc.get("warm_prob") or 0
        parts = [f"pass schedule (1/2/3... passes): {tc.get('schedule')}", f"lambda {tc.get('lam')}",
                 f"state noise U[-{tc.get('noise')}, {tc.get('noise')}]", f"prefix mixin p={tc.get('prefix_mix')}",
                 targets]
        if tc.get("warm_passes"):
            # drawn first, then replaced by the fixed-point start at its probability (training.data._passes)
            parts.append(f"1-{tc['warm_passes']} warm no-grad passes in {wp * (1 - fp):g} of the multi-pass batches "
                         f"(--warm-prob {wp:g}, less those started from the fixed point)")
        if fp:
            parts.append(f"passes from the fixed point p={fp:g} ("
                         + (f"Jacobi passes to relative change < {tc['fixed_point_tol']:g} where cheaper, else exact)"
                            if tc.get("fixed_point_tol") else "exact)"))
        if tc.get("consistency"):
            parts.append(f"state-consistency loss weight {tc['consistency']}"
                         + (f", window {tc['consistency_window']}" if tc.get("consistency_window") else "")
                         + (", over every block's output" if tc.get("consistency_layers") == "all" else ""))
    if tc.get("length_doubling"):
        parts.append(f"length curriculum N <= {tc.get('length_start', 4)} * 2^(step // {tc['length_doubling']})")
    parts.append(f"depth scaling {tc.get('depth_scale')}")
    if loop:
        r = tc.get("loop_iterations", 1)
        parts.append((f"loop iterations per step 1 + Poisson({r - 1}), at most {most_loop_iterations(r)}" if r > 1
                      else "loop iterations per step 1")
                     + (f", backpropagation through the last {tc['loop_truncate']}" if tc.get("loop_truncate") else ""))
    elif _fused_passes(tc) or tc.get("objective") == "recurrent":
        parts.append(f"fusion gate init {tc.get('gate_init', 'default')}"
                     + (f" (pre-activation std {tc['gate_std']})" if tc.get("gate_std") else ""))
    return parts


# What a card reads of a recipe whatever it holds: a log without them printed "lr None".
CARD_RECIPE = ("steps", "lr", "warmup", "weight_decay", "seed", "tasks", "distractors", "batch_tokens", "schedule")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _recipe(tc, where: str):
    """A TrainConfig of a logged recipe (to_dict's form), or one UserError line naming what is wrong with it."""
    from training.config import TrainConfig

    if not isinstance(tc, dict):
        raise UserError(f"{where} is not a recipe (a JSON object), got {type(tc).__name__}")
    missing = [k for k in CARD_RECIPE if k not in tc]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}")
    try:
        return TrainConfig(**tc)
    except TypeError:  # a field this version does not know
        unknown = sorted(set(tc) - set(asdict(TrainConfig())))
        raise UserError(f"{where} has fields no training run writes ({', '.join(unknown[:5])})") from None
    except (UserError, ValueError) as e:
        raise UserError(f"{where} is not a valid recipe: {e}") from None


def _shape_error(log: dict) -> str | None:
    """What is wrong with a training log's history, config_changes, wall_s or device, or None."""
    hist = log.get("history", [])
    if not isinstance(hist, list) or not all(isinstance(h, dict) and _number(h.get("loss")) for h in hist):
        return "history must be a list of steps, each with a finite loss"
    changes = log.get("config_changes", [])
    if not isinstance(changes, list) or not all(
            isinstance(c, dict) and _count(c.get("step")) and isinstance(c.get("previous"), dict) for c in changes):
        return "config_changes must be a list of {step, previous recipe}"
    if not _number(log.get("wall_s", 0)) or not isinstance(log.get("device", ""), str):
        return "wall_s must be a number and device a text"
    return None


def read_log(path: Path) -> dict:
    """train_log.json ({} without one), its shapes checked: a malformed log is one line, not a traceback."""
    f = path / "train_log.json"
    if not f.is_file():
        return {}
    log = read_user_json(f, "training log")
    if not isinstance(log, dict):
        raise UserError(f"training log {f} is not a JSON object (config, history...), got {type(log).__name__}")
    if "config" in log:
        _recipe(log["config"], f"the config of training log {f}")
    bad = _shape_error(log)
    if bad:
        raise UserError(f"training log {f}: {bad}")
    return log


def _row_ok(r) -> bool:
    return isinstance(r, dict) and isinstance(r.get("task"), str) and isinstance(r.get("mode"), str) and \
        _count(r.get("n_distractors")) and _count(r.get("n_samples")) and _number(r.get("accuracy"))


def read_eval(path: Path) -> dict | None:
    """eval.json (None without one), as analysis.evaluate writes it: a malformed one is one line."""
    f = path / "eval.json"
    if not f.is_file():
        return None
    ev = read_user_json(f, "evaluation")
    rows = ev.get("results") if isinstance(ev, dict) else None
    meta = ev.get("meta") if isinstance(ev, dict) else None
    if not isinstance(rows, list) or not rows or not all(map(_row_ok, rows)):
        raise UserError(f"evaluation {f}: results must be a non-empty list of rows with task, n_distractors, mode, "
                        "n_samples and accuracy (as analysis.evaluate writes them)")
    if not isinstance(meta, dict) or not _count(meta.get("seed")) or \
            not (meta.get("n_pairs") is None or _count(meta["n_pairs"])) or \
            not isinstance(meta.get("modes", ""), (str, type(None))):
        raise UserError(f"evaluation {f}: meta must hold the eval seed (and n_pairs, modes as analysis.evaluate "
                        "writes them)")
    return ev


def _n_params(path: Path) -> int:
    from safetensors.torch import load_file

    try:
        return sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    except Exception as e:  # SafetensorError, OSError...: a truncated or foreign file
        raise UserError(f"{path / 'model.safetensors'} cannot be read as safetensors weights "
                        f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None


def _device(text: str) -> str:
    """The log's device line; "1 threads each" as logs before the singular wrote it."""
    return re.sub(r"\b1 threads each\b", "1 thread each", text)


def _text(v) -> str:
    if isinstance(v, list):
        return ",".join(map(str, v))
    return json.dumps(v, separators=(",", ":")) if isinstance(v, dict) else str(v)


def _whole(tc: dict) -> dict:
    """Every field of a logged recipe (to_dict leaves out the options that are off); as logged if not rebuildable."""
    from training.config import TrainConfig

    try:
        return json.loads(json.dumps(asdict(TrainConfig(**tc))))
    except Exception:  # an earlier segment's recipe from another version: its own fields only
        return tc


def recipe_changes(log: dict) -> list[str]:
    """One line per resumed segment whose recipe changed (config_changes): the card's recipe is the last one, and
    a run resumed with another lr, seed or steps trained its earlier steps under the earlier values."""
    changes = log.get("config_changes", [])
    recipes = [_whole(c["previous"]) for c in changes] + [_whole(log.get("config", {}))]
    lines = []
    for c, old, new in zip(changes, recipes, recipes[1:]):
        diff = [f"{k} {_text(old.get(k))} -> {_text(new.get(k))}" for k in dict.fromkeys([*old, *new])
                if old.get(k) != new.get(k)]
        lines.append(f"- resumed at step {c['step']} under a changed recipe: " + (", ".join(diff) or "no field"))
    return lines


def write_card(path: Path, command: str, notes: str = "") -> str:
    cfg = FullBandwidthLM.read_config(path)
    log = read_log(path)
    ev = read_eval(path)
    tc = log.get("config", {})
    base = cfg["base_config"]
    loop = cfg.get("loop")  # a looped checkpoint (models.looped)
    n_params = _n_params(path)
    hist = log.get("history", [])
    lines = [f"# {path.name}", "",
             (f"Looped checkpoint (format {cfg['format']} v{cfg['format_version']}, models.looped): a prelude of "
              f"{loop['prelude']} blocks, a core of {loop['core']} blocks iterated {loop['iterations']} times "
              f"({'with Huginn input injection' if loop['inject'] else 'plain iteration'}), a coda of "
              f"{loop['coda']}; no fusion: the feedback is in depth only." if loop else
              f"Full-bandwidth checkpoint (format {cfg['format']} v{cfg['format_version']}); fusion "
              f"{'enabled' if cfg['fusion']['enabled'] else 'disabled'}."), "",
             "## Reproduce", "", "```bash", command, "```", "",
             "## Architecture", "",
             f"- base: {base.get('model_type')}-style decoder, "
             f"{base.get('num_hidden_layers', base.get('n_layer'))} layers, d_model {base.get('hidden_size', base.get('n_embd'))}, "
             f"{base.get('num_attention_heads', base.get('n_head'))} heads / {base.get('num_key_value_heads', '-')} KV heads, "
             f"d_ff {base.get('intermediate_size', '-')}, vocab {base.get('vocab_size')}, tied embeddings: "
             f"{base.get('tie_word_embeddings')}" + _attention(base),
             f"- parameters: {n_params:,}", "",
             "## Training", ""]
    if tc:
        lines += [f"- steps: {len(hist)} of {tc.get('steps')}, wall time {log.get('wall_s', 0) / 60:.1f} min"
                  + (f" ({_device(log['device'])})" if log.get("device") else ""),
                  "- " + "; ".join(_objective(tc, loop)),
                  f"- data: tasks {', '.join(tc.get('tasks', []))} ({_layout(tc)}), "
                  f"N mixture {tc.get('distractors')}, ~{tc.get('batch_tokens')} tokens per step"
                  + ("; random value symbols (digits, register names) not loss targets" if tc.get('skip_values') else "")
                  + (f"; {tc['reads']} answered reads per multi_register sample" if tc.get('reads') else "")
                  + (f"; multi_register curriculum over the first {tc['register_curriculum']} steps (2 registers "
                     f"written once -> the task)" if tc.get('register_curriculum') else "")
                  + ("; update lines drawn " + ", ".join(f"{v} {w:g}" for v, w in tc["variants"].items())
                     + " (tasks.tracking)" if tc.get("variants") else "")
                  + ("; no held-out transition pair in any prompt (heldout_split)" if tc.get("heldout_split") else ""),
                  f"- warm start: {tc['base']} (fresh fusion and optimizer)" if tc.get("base") else
                  "- initialization: random (from scratch)",
                  f"- optimizer: AdamW lr {tc.get('lr')} (warm-up {tc.get('warmup')}, cosine to 10%{_legs(log)}), "
                  f"weight decay {tc.get('weight_decay')}, seed {tc.get('seed')}"
                  + (" (the last segment's; changes below)" if log.get("config_changes") else "")]
        lines += recipe_changes(log)
        if hist:
            last = hist[-50:]
            lines.append(f"- final training loss (mean of last {len(last)} steps): "
                         f"{sum(h['loss'] for h in last) / len(last):.4f}")
    if ev:
        swept = {f"fused-{k}" for k in fused_sweep(ev["results"]) if k > 1}  # shown as their minimum
        modes = [m for m in dict.fromkeys(r["mode"] for r in ev["results"]) if m not in swept]
        lines += ["", "## Label accuracy", "",
                  f"`python -m analysis.evaluate --model {path}"
                  + (f" --n-pairs {ev['meta']['n_pairs']}" if ev['meta'].get('n_pairs') is not None else "")
                  + (f" --tasks {','.join(dict.fromkeys(r['task'] for r in ev['results']))}"
                     if list(dict.fromkeys(r['task'] for r in ev['results'])) != ["completion", "memory", "multi_register"]
                     else "")
                  + (f" --modes {ev['meta']['modes']}" if ev['meta'].get('modes') and ev['meta']['modes'] != DEFAULT_EVAL_MODES else "")
                  + (f" --distractors {','.join(map(str, sorted({r['n_distractors'] for r in ev['results']})))}"
                     if sorted({r['n_distractors'] for r in ev['results']}) != [0, 8, 32, 128, 256] else "")
                  + f"` (n = {_cell_sizes(ev['results'])} samples per cell, "
                  f"eval seed {ev['meta']['seed']}, greedy full-vocabulary argmax at the final prompt token; "
                  f"std = standard, soft = recurrent-1, fused = fused-1):", "", eval_table(ev["results"], modes)]
    if notes:
        lines += ["", "## Notes", "", notes.strip()]
    text = "\n".join(lines) + "\n"
    atomic_write(path / "MODEL_CARD.md", text)  # a card cut short never replaces the earlier one
    return text


def _cell_sizes(rows) -> str:
    """The samples per cell of eval.json's rows, as counted there: "100", or "20-100" where they differ (a task
    file used whole)."""
    sizes = sorted({r["n_samples"] for r in rows})
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"


def own_notes(card: Path) -> str:
    """The Notes section of an existing card (what write_card appends after '## Notes'), or ''."""
    if not card.is_file():
        return ""
    text = card.read_text(encoding="utf-8", errors="replace")
    head = "\n## Notes\n"
    if head not in text:
        return ""
    rest = text.split(head, 1)[1]
    return rest.split("\n## ", 1)[0].strip()


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m training.card", description=__doc__)
    p.add_argument("path", help="checkpoint dir")
    p.add_argument("--command", required=True, help="the exact command that reproduces the checkpoint")
    p.add_argument("--notes", help="markdown file with recipe notes to append (default: the card's own Notes "
                                   "section, kept as it is)")
    a = p.parse_args(argv)
    if not a.command.strip():
        raise UserError("--command is empty: give the command that reproduces the checkpoint")
    if a.notes is not None:
        if not Path(a.notes).is_file():
            raise UserError(f"--notes {a.notes}: no such file")
        try:
            notes = Path(a.notes).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--notes {a.notes}: cannot read it as UTF-8 text ({e})") from None
    else:  # rewriting the card kept nothing of its notes before (65 lines of tiny-fbt's gone)
        notes = own_notes(Path(a.path) / "MODEL_CARD.md")
    print(write_card(Path(a.path), a.command, notes))


if __name__ == "__main__":
    main()
