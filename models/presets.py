"""Named presets: training recipes for the shipped tiny models, and model loading by name or path."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "checkpoints"


def parse_schedule(s: str) -> tuple[float, ...]:
    """'75/22/3' -> probabilities of 1, 2, 3 passes per batch (normalized)."""
    try:
        parts = [float(x) for x in str(s).split("/")]
    except ValueError:
        raise UserError(f"bad schedule {s!r}: use weights of 1, 2, 3... passes separated by '/', e.g. 75/22/3") from None
    if not parts or any(p < 0 for p in parts) or sum(parts) <= 0 or any(p != p for p in parts):
        raise UserError(f"bad schedule {s!r}: weights must be non-negative with a positive sum, e.g. 75/22/3")
    total = sum(parts)
    return tuple(p / total for p in parts)


# (registers, writes per register) of the multi_register curriculum, easiest first; the task is 8 x {2, 4, 8}.
REGISTER_LEVELS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (8, 4), (8, 8))


# Bounds of a recipe's values, from a preset or a flag alike (models.train shows them in --help).
MAX_STEPS = 10_000_000
MAX_PASSES = 16  # weights in a schedule: every pass keeps its activations for the backward pass
MAX_DISTRACTORS = 1024  # largest N of the distractor mixture (the tasks' grid ends at 256)
INT_LIMITS = {  # name: (lo, hi), inclusive
    "n_layers": (1, 1024), "d_model": (1, 65536), "n_heads": (1, 1024), "n_kv_heads": (1, 1024),
    "d_ff": (1, 1_048_576), "max_len": (1, 1_048_576),
    "steps": (1, MAX_STEPS), "warmup": (0, MAX_STEPS), "eval_every": (1, MAX_STEPS), "save_every": (1, MAX_STEPS),
    "batch_tokens": (1, 1_000_000), "seq_len": (1, 1_048_576), "curriculum_seq_len": (1, 1_048_576),
    "curriculum_steps": (0, MAX_STEPS), "curriculum_max_n": (0, MAX_DISTRACTORS),
    "register_curriculum": (0, MAX_STEPS), "reads": (0, 64), "warm_passes": (0, 256),
    "consistency_window": (0, 4096), "seed": (0, 2**32 - 1), "length_doubling": (0, MAX_STEPS),
    "length_start": (1, MAX_DISTRACTORS),
}
FLOAT_LIMITS = {  # name: (lo, hi, lo_open, hi_open)
    "lam": (0.0, 1000.0, False, False), "noise": (0.0, 10.0, False, False), "prefix_mix": (0.0, 1.0, False, False),
    "label_weight": (0.0, 1000.0, False, False), "gate_std": (0.0, 100.0, True, False),
    "warm_prob": (0.0, 1.0, False, False), "fixed_point_prob": (0.0, 1.0, False, False),
    "fixed_point_tol": (0.0, 1.0, False, True), "consistency": (0.0, 1000.0, False, False),
    "lr": (0.0, 1.0, True, False), "weight_decay": (0.0, 1.0, False, False),
}


@dataclass
class TrainConfig:
    """A training recipe. Validates itself on construction."""
    arch: str = "qwen3"  # qwen3 | gpt2 (ignored when warm-starting from --base)
    n_layers: int = 6
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 256
    max_len: int = 2048
    tie_embeddings: bool = True
    schedule: str = "60/25/15"  # weights of 1, 2, 3... passes per batch
    lam: float = 1.0  # lambda of the multi-pass loss
    noise: float = 0.02  # uniform state noise U[-sigma, sigma] on the carried state
    prefix_mix: float = 0.5  # probability that a row keeps a random-length unfused prefix
    skip_values: bool = False  # no loss on the tasks' random value symbols (see models.train.make_batch)
    label_weight: float = 20.0  # loss weight on label tokens (at 5, labels stalled at chance for 1000+ steps)
    targets: str = "all"  # "labels": the label tokens are the only loss targets (see docs/recipe.md, multi_register)
    depth_scale: bool = False  # scale residual-output init by 1/sqrt(2 L)
    gate_init: str = "default"  # "unit": W_G scaled so sigmoid's input starts at std gate_std (models.train.build_model)
    gate_std: float = 1.0  # with gate_init "unit": the std of sigmoid's input at init (3: a stronger token code)
    warm_passes: int = 4  # up to this many extra no-grad Jacobi passes before the first fused pass
    warm_prob: float = 0.25  # probability of warm passes in a multi-pass batch (exposes near-fixed-point states)
    # probability that a multi-pass batch starts its fused passes from the exact fixed point of the feedback map
    # (the recurrent-full states, no gradient) instead of pass 1 or warm passes; 0 = off (see docs/recipe.md)
    fixed_point_prob: float = 0.0
    # > 0: the fixed-point start first tries up to 16 Jacobi passes and keeps them once the largest relative state
    # change is below this (engine.prefill.fixed_point_top; 2-5x cheaper where the map contracts); 0 = always the
    # exact sequential recurrence
    fixed_point_tol: float = 0.0
    # weight of the state-consistency loss: every fused pass's top state is pulled toward pass 1's (detached) at
    # every position, so the standard states become a fixed point of the feedback map; 0 = off (docs/recipe.md)
    consistency: float = 0.0
    # ... plus the same term over the last `consistency_window` positions before each label target alone, where a
    # standard pass holds the looked-up answer (1 position in ~100-300 of the plain mean); 0 = off
    consistency_window: int = 0
    consistency_layers: str = "top"  # "all": the consistency term is the mean over every block's output, not the top
    distractors: dict = field(default_factory=lambda: {0: 0.3, 8: 0.3, 32: 0.3, 128: 0.1})
    tasks: tuple = ("completion", "memory", "multi_register")
    reads: int = 0  # multi_register training samples carry this many answered queries (unpacked batches only)
    # multi_register curriculum: over the first `register_curriculum` steps its training samples come from the
    # first levels of REGISTER_LEVELS (registers x writes: plain key-value lookups first, then latest-write with
    # ever more overwrites), one more level unlocked every register_curriculum / 8 steps; then the task. 0 = off.
    register_curriculum: int = 0
    task_weights: tuple | None = None  # unpacked: share of each step's tokens per task (default equal)
    batch_tokens: int = 2048
    packing: bool = True  # rows stream several samples; False: one sample per row, one micro-batch per task
    seq_len: int = 1024  # packed row length (a row streams several samples)
    curriculum_steps: int = 600  # first steps: 1 pass, N <= curriculum_max_n, short rows (a standard warm start)
    curriculum_max_n: int = 8
    curriculum_seq_len: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 100
    steps: int = 4000
    # Ends of earlier legs of a resumed run: before lr_legs[i] the cosine decays toward lr_legs[i], as if the run
    # had been started with --steps lr_legs[i] and then resumed with a larger --steps (which re-spreads the cosine
    # over the new total). Reproduces such a chain of resumed runs in one run.
    lr_legs: tuple = ()
    seed: int = 0
    eval_every: int = 250
    save_every: int = 250
    base: str | None = None  # warm start: preset name or checkpoint dir (fresh fusion, fresh optimizer)
    # "recurrent": each batch runs recurrent-full (every position fused with the previous position's top state of
    # the same run) and backpropagates through the whole recurrence; "multipass": the Jacobi objective above.
    objective: str = "multipass"
    # state-tracking tasks (parity, shell_game): the running value is the target at the last token of every update
    # line (a loss target only, never a token of the input), beside the final label
    dense_targets: bool = False
    # length curriculum: N <= length_start * 2**(step // length_doubling) (within `distractors`); 0 = off
    length_doubling: int = 0
    length_start: int = 4

    def __post_init__(self):
        # Every value is checked here, whether it comes from a preset, a flag or a caller, so that a bad one is a
        # one-line error before any work (a NaN weight once trained a NaN checkpoint, a NaN task share looped
        # forever, a huge batch grew memory without bound). The bounds are in LIMITS (and in --help).
        for name, (lo, hi) in INT_LIMITS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise UserError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")
        for name, (lo, hi, lo_open, hi_open) in FLOAT_LIMITS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or v > hi \
                    or (lo_open and v == lo) or (hi_open and v == hi):
                raise UserError(f"{name} must be a finite number in {'(' if lo_open else '['}{lo}, {hi}"
                                f"{')' if hi_open else ']'}, got {v!r}")
        self.probs = parse_schedule(self.schedule)
        if not all(math.isfinite(p) for p in self.probs) or len(self.probs) > MAX_PASSES:
            raise UserError(f"bad schedule {self.schedule!r}: at most {MAX_PASSES} finite weights (of 1, 2, 3... "
                            "passes), e.g. 75/22/3")
        if self.arch not in ("qwen3", "gpt2"):
            raise UserError(f"unknown arch {self.arch!r} (qwen3 or gpt2)")
        if self.seq_len > self.max_len or self.curriculum_seq_len > self.max_len:
            raise UserError(f"seq_len ({self.seq_len}) and curriculum_seq_len ({self.curriculum_seq_len}) must be at "
                            f"most the model's max_len ({self.max_len})")
        if self.consistency_layers not in ("top", "all"):
            raise UserError(f"consistency_layers must be 'top' or 'all', got {self.consistency_layers!r}")
        self.lr_legs = tuple(self.lr_legs)
        ends = (*self.lr_legs, self.steps)
        if any(isinstance(e, bool) or not isinstance(e, int) or e <= self.warmup for e in self.lr_legs) or \
                any(a >= b for a, b in zip(ends, ends[1:])):
            raise UserError(f"lr_legs must be increasing steps after the warm-up ({self.warmup}) and before "
                            f"steps ({self.steps}), got {list(self.lr_legs)}")
        if self.gate_init not in ("default", "unit"):
            raise UserError(f"gate_init must be 'default' or 'unit', got {self.gate_init!r}")
        try:
            self.distractors = {int(k): float(v) for k, v in dict(self.distractors).items()}
        except (TypeError, ValueError):
            raise UserError(f"distractors must map N to a weight, got {self.distractors!r}") from None
        if not self.distractors or any(not 0 <= k <= MAX_DISTRACTORS or not math.isfinite(v) or v < 0
                                       for k, v in self.distractors.items()) or sum(self.distractors.values()) <= 0:
            raise UserError(f"distractors must map N in 0..{MAX_DISTRACTORS} to finite non-negative weights with a "
                            f"positive sum, got {self.distractors}")
        from tasks import ALL_TASKS, TRACKING_TASKS
        self.tasks = tuple(self.tasks)
        bad = [t for t in self.tasks if t not in ALL_TASKS]
        if bad or not self.tasks:
            raise UserError(f"unknown task(s) {', '.join(map(str, bad)) or '(none)'}; valid tasks: {', '.join(ALL_TASKS)}")
        if self.objective not in ("multipass", "recurrent"):
            raise UserError(f"objective must be 'multipass' or 'recurrent', got {self.objective!r}")
        if self.dense_targets and (self.packing or any(t not in TRACKING_TASKS for t in self.tasks)):
            raise UserError("dense_targets needs unpacked batches (--no-packing) and state-tracking tasks only "
                            f"({', '.join(TRACKING_TASKS)})")
        if any(t in TRACKING_TASKS for t in self.tasks) and min(self.distractors) < 1:
            raise UserError("the state-tracking tasks need N >= 1 update lines: drop N = 0 from distractors")
        if self.task_weights is not None:
            try:
                self.task_weights = tuple(float(w) for w in self.task_weights)
            except (TypeError, ValueError):
                raise UserError("task_weights needs one positive weight per task") from None
            if len(self.task_weights) != len(self.tasks) or \
                    any(not math.isfinite(w) or w <= 0 for w in self.task_weights) or \
                    not math.isfinite(sum(self.task_weights)):
                raise UserError(f"task_weights needs one positive weight per task (finite), got {list(self.task_weights)}")
        if self.reads and self.packing:
            raise UserError("reads must be >= 0 and needs unpacked batches (--no-packing)")
        if self.targets not in ("all", "labels"):
            raise UserError(f"targets must be 'all' or 'labels', got {self.targets!r}")

    @property
    def max_passes(self) -> int:
        return len(self.probs)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name, off in (("register_curriculum", 0), ("targets", "all"), ("fixed_point_prob", 0.0),
                          ("fixed_point_tol", 0.0), ("consistency", 0.0), ("consistency_window", 0),
                          ("consistency_layers", "top"), ("gate_std", 1.0), ("objective", "multipass"),
                          ("dense_targets", False), ("length_doubling", 0), ("length_start", 4)):
            if d[name] == off:  # as lr_legs: the configs of runs without these options stay unchanged
                d.pop(name)
        if not self.lr_legs:  # keeps the config of runs without legs (the shipped logs) unchanged
            d.pop("lr_legs")
        # Exactly what train_log.json reads back (tuples -> lists, int keys -> str), so a plain --resume
        # compares equal and records no config change.
        return json.loads(json.dumps(d))


# Two stages, as the paper (warm start from a standard checkpoint). Stage 1, `tiny-base`: 1-pass training, one
# sample per row, loss on the label tokens only; the first 1500 steps on N = 0 only (many short samples:
# completion needed ~1e5 samples to leave its plateau in a small probe run), then the full N mixture, with
# multi_register ramped from a plain lookup over its first 3000 steps (without it the task stayed at chance).
# Stage 2 continues from tiny-base: multi-pass (tiny-fbt, tiny-fbt-no3) or 1-pass (tiny-std, the baseline with
# tiny-fbt's architecture, data and token budget). A feedback fixed point that keeps every task's label needed
# a token-aware gate (gate_init "unit", pre-activation std 3: with nn.Linear's default init sigmoid(W_G e) sat at
# ~0.5 for every token), warm no-grad passes and fused passes started from the fixed point (Jacobi passes to a
# relative change < 1e-3 where that is cheaper, else the exact recurrence: 2-5x cheaper, same start), and a
# state-consistency loss that pulls every fused pass's block outputs toward the standard pass's (the label loss
# alone let fused passes relay pass 1's state, a shortcut gone at the fixed point). docs/recipe.md has each step.
_STAGE = dict(packing=False, skip_values=True, batch_tokens=3000, task_weights=(0.5, 0.15, 0.35), lr=3e-4,
              targets="labels")
# Stage 2 (all three continuations alike): multi_register takes 60% of the tokens and every one of its samples
# carries 8 answered reads ("get X" / "value: v", label targets too), ~8x the lookup's supervision per token.
# Its errors were the long-range cases (latest write 30-40 lines back); docs/recipe.md item 17.
_STAGE2 = dict(_STAGE, task_weights=(0.3, 0.1, 0.6), reads=8)
_FEEDBACK = dict(base="tiny-base", curriculum_steps=0, warmup=50, gate_init="unit", gate_std=3.0, warm_passes=16,
                 warm_prob=0.5, fixed_point_prob=0.5, fixed_point_tol=1e-3, consistency=1.0, consistency_window=5,
                 consistency_layers="all", **_STAGE2)
PRESETS: dict[str, TrainConfig] = {
    "tiny-base": TrainConfig(schedule="1", steps=3000, curriculum_steps=1500, curriculum_max_n=0,
                             register_curriculum=3000, **_STAGE),
    "tiny-fbt": TrainConfig(steps=4000, **_FEEDBACK),
    "tiny-std": TrainConfig(base="tiny-base", schedule="1", steps=4000, curriculum_steps=0, warmup=50, **_STAGE2),
    "tiny-fbt-no3": TrainConfig(schedule="75/25", steps=4000, **_FEEDBACK),
}
# A few-second recipe for tests and smoke runs.
# State tracking past the model's depth (docs/recipe.md, "tracking"): the same data, steps and architecture for
# both; the feedback model trains through its recurrence, the twin is the same network's standard pass.
_TRACK = dict(tasks=("parity", "shell_game"), packing=False, dense_targets=True, targets="labels", schedule="1",
              distractors={n: 1.0 for n in range(1, 65)}, length_doubling=200, length_start=4, curriculum_steps=0,
              task_weights=(0.4, 0.6), batch_tokens=4096, lr=1e-3, warmup=100, steps=1000, gate_init="unit",
              gate_std=3.0, prefix_mix=0.0, noise=0.0, eval_every=100, save_every=100)
PRESETS["tiny-fbt-track"] = TrainConfig(objective="recurrent", **_TRACK)
PRESETS["tiny-std-track"] = TrainConfig(**_TRACK)
PRESETS["smoke"] = replace(TrainConfig(), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64,
                           steps=4, batch_tokens=256, seq_len=128, curriculum_steps=0, eval_every=2, save_every=2,
                           distractors={0: 0.5, 8: 0.5}, warmup=1)


def get_preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name])


def checkpoint_dir(name: str) -> Path:
    return CHECKPOINTS / name


def load_model(name_or_path: str):
    """Load a model by shipped preset name, full-bandwidth checkpoint dir, or plain HF model dir.

    Returns (FullBandwidthLM, tokenizer or None, name). A plain HF LM is wrapped without a fusion module.
    Anything unreadable or inconsistent (config, weights, NaN/inf weights, tokenizer) is one UserError line.
    """
    from models.full_bandwidth import FullBandwidthLM, check_finite_weights

    p = Path(name_or_path)
    # --- optional real pretrained model (SPEC section 6), owned by models/smollm2.py ---
    if not p.exists() and name_or_path == "smollm2-135m":
        from models.smollm2 import load_smollm2

        model, tok, name = load_smollm2()
        check_finite_weights(model, name)
        return model, tok, name
    # ---
    if not p.exists() and name_or_path in PRESETS:
        p = checkpoint_dir(name_or_path)
        if not p.exists():
            raise UserError(f"preset {name_or_path!r} has no shipped checkpoint at {p}; train it with "
                            f"`python -m models.train --preset {name_or_path}`")
    if not p.exists():
        raise UserError(f"unknown model {name_or_path!r}: not a preset ({', '.join(k for k in PRESETS if k != 'smoke')}) "
                        f"nor an existing directory")
    if not p.is_dir():
        raise UserError(f"model {name_or_path!r}: {p} is a file, not a model directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{p} is not a model directory: it has no config.json")
    if '"full-bandwidth-lm"' in cfg_file.read_text(errors="replace"):
        model = FullBandwidthLM.from_pretrained(p)
    else:
        model = FullBandwidthLM(_load_hf_lm(p), fusion=False).eval()
    return model, _load_tokenizer(p, model), p.name


def _load_hf_lm(p: Path):
    """A plain HF causal LM from `p`; UserError if it cannot be read, has missing/mis-shaped weights or NaN/inf."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from models.full_bandwidth import check_finite_weights, one_line

    hf_logging.disable_progress_bar()  # a per-shard bar is noise for the small models loaded here
    try:
        lm, info = AutoModelForCausalLM.from_pretrained(str(p), output_loading_info=True)
    except Exception as e:  # OSError/ValueError, HF config validation errors, safetensors errors on corrupt files
        raise UserError(f"cannot load a model from {p}: {one_line(e)}") from None
    # HF fills missing or mis-shaped weights with fresh random init and only warns: refuse them here.
    missing = sorted(set(info.get("missing_keys") or ()))
    mismatched = list(info.get("mismatched_keys") or ())
    if missing or mismatched:
        what = f"{len(missing)} missing weights, first {missing[0]}" if missing else \
            f"{len(mismatched)} weights of the wrong shape, first {mismatched[0][0]}"
        raise UserError(f"corrupt model weights in {p}: {what}")
    check_finite_weights(lm, str(p))
    return lm


def _load_tokenizer(p: Path, model):
    """The tokenizer saved beside the model (None if there is no tokenizer.json); UserError if it is unreadable or
    holds token ids the model's embedding does not have."""
    if not (p / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    from models.full_bandwidth import one_line

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(p))
        ids = list(tok.get_vocab().values())
    except Exception as e:  # JSONDecodeError, KeyError, TypeError, tokenizers' own Exception for wrong structure
        raise UserError(f"corrupt tokenizer in {p}: {one_line(e, 200)}") from None
    vocab = model.lm.get_input_embeddings().weight.shape[0]
    if not ids or max(ids) >= vocab:
        raise UserError(f"tokenizer in {p} does not fit its model: token ids up to {max(ids, default=None)}, "
                        f"the model's embedding has {vocab} rows")
    return tok
