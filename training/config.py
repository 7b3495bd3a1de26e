"""A training recipe: the TrainConfig dataclass, its bounds, and how its text form (a flag's value) is read.

Every field is also a flag of `python -m training.train`: training.cli derives the flags from the fields (help from
the field's metadata, integer and float bounds from INT_LIMITS / FLOAT_LIMITS, the allowed words from CHOICES), so
a new recipe option is one field here.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field

from common.cli import MAX_SEED, ascii_int, float_in, int_in
from common.errors import UserError


def parse_schedule(s: str) -> tuple[float, ...]:
    """'75/22/3' -> probabilities of 1, 2, 3 passes per batch (normalized)."""
    try:
        parts = [float(x) for x in str(s).split("/")]
    except ValueError:
        raise UserError(f"bad schedule {s!r}: use weights of 1, 2, 3... passes separated by '/', e.g. 75/22/3") from None
    if not parts or any(p < 0 for p in parts) or not 0 < sum(parts) < math.inf or any(p != p for p in parts):
        raise UserError(f"bad schedule {s!r}: weights must be non-negative with a positive, finite sum, e.g. 75/22/3")
    total = sum(parts)
    return tuple(p / total for p in parts)


# (registers, writes per register) of the multi_register curriculum, easiest first; the task is 8 x {2, 4, 8}.
REGISTER_LEVELS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (8, 4), (8, 8))


# Bounds of a recipe's values, from a preset or a flag alike (training.cli shows them in --help).
MAX_STEPS = 10_000_000
MAX_PASSES = 16  # weights in a schedule: every pass keeps its activations for the backward pass
MAX_DISTRACTORS = 1024  # largest N of the distractor mixture (the tasks' grid ends at 256)
INT_LIMITS = {  # name: (lo, hi), inclusive
    "n_layers": (1, 1024), "d_model": (1, 65536), "n_heads": (1, 1024), "n_kv_heads": (1, 1024),
    "d_ff": (1, 1_048_576), "max_len": (1, 1_048_576), "attn_window": (0, 1_048_576),
    "steps": (1, MAX_STEPS), "warmup": (0, MAX_STEPS), "eval_every": (1, MAX_STEPS), "save_every": (1, MAX_STEPS),
    "batch_tokens": (1, 1_000_000), "seq_len": (1, 1_048_576), "curriculum_seq_len": (1, 1_048_576),
    "curriculum_steps": (0, MAX_STEPS), "curriculum_max_n": (0, MAX_DISTRACTORS),
    "register_curriculum": (0, MAX_STEPS), "reads": (0, 64), "warm_passes": (0, 256),
    "consistency_window": (0, 4096), "seed": (0, MAX_SEED), "init_offset": (0, 2**31),
    "length_doubling": (0, MAX_STEPS), "length_start": (1, MAX_DISTRACTORS),
    # a step draws up to 2r iterations, and a looped model runs at most models.looped.MAX_ITERATIONS (256)
    "loop_core": (0, 1024), "loop_prelude": (0, 1024), "loop_iterations": (1, 128), "loop_truncate": (0, 256),
}
FLOAT_LIMITS = {  # name: (lo, hi, lo_open, hi_open)
    "lam": (0.0, 1000.0, False, False), "attn_dropout": (0.0, 1.0, False, True), "decoy": (0.0, 1.0, False, True),
    "noise": (0.0, 10.0, False, False), "prefix_mix": (0.0, 1.0, False, False),
    "label_weight": (0.0, 1000.0, False, False), "gate_std": (0.0, 100.0, True, False),
    "warm_prob": (0.0, 1.0, False, False), "fixed_point_prob": (0.0, 1.0, False, False),
    "fixed_point_tol": (0.0, 1.0, False, True), "consistency": (0.0, 1000.0, False, False),
    "interchange": (0.0, 1.0, False, False),
    "lr": (0.0, 1.0, True, False), "weight_decay": (0.0, 1.0, False, False),
}
CHOICES = {  # name: the allowed words
    "arch": ("qwen3", "gpt2"), "targets": ("all", "labels"), "gate_init": ("default", "unit"),
    "consistency_layers": ("top", "all"), "objective": ("multipass", "recurrent"),
}


def most_loop_iterations(r: int) -> int:
    """The largest r a looped model's training step can draw at --loop-iterations r: 1 + Poisson(r - 1) capped at
    2r, so 1 at r = 1 (Poisson(0) is always 0)."""
    return 1 if r == 1 else 2 * r


def int_flag(name: str):
    """argparse `type=` of an integer field: within INT_LIMITS."""
    return int_in(*INT_LIMITS[name])


def float_flag(name: str):
    """argparse `type=` of a float field: finite, within FLOAT_LIMITS."""
    lo, hi, lo_open, hi_open = FLOAT_LIMITS[name]
    return float_in(lo, hi, lo_open=lo_open, hi_open=hi_open)


def bounds_text(name: str) -> str:
    """The bound of a field as --help shows it, e.g. '1..10000000' or '[0, 1]'."""
    if name in INT_LIMITS:
        return "%d..%d" % INT_LIMITS[name]
    lo, hi, lo_open, hi_open = FLOAT_LIMITS[name]
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


# ----- the text form of the fields that are not a plain number, word or switch (their flags' values) -----------
def parse_mixture(s: str) -> dict:
    """'0:0.3,8:0.7' -> {0: 0.3, 8: 0.7}: N in 0..MAX_DISTRACTORS, finite weights >= 0."""
    n_of, w_of = int_in(0, MAX_DISTRACTORS), float_in(0.0)
    try:
        pairs = [(n_of(k), w_of(v)) for k, v in (part.split(":") for part in s.split(",") if part.strip())]
    except (ValueError, argparse.ArgumentTypeError):
        raise UserError(f"bad --distractors {s!r}: use N:weight pairs, N in 0..{MAX_DISTRACTORS} and finite weights "
                        ">= 0, e.g. 0:0.3,8:0.3,32:0.3,128:0.1") from None
    return _once(pairs, "--distractors", s)


def _once(pairs, flag: str, s: str) -> dict:
    """{key: weight} of key:weight pairs, each key once: a repeated key kept only its last weight."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
    if twice:
        raise UserError(f"bad {flag} {s!r}: {', '.join(map(str, twice))} given more than once; give each once "
                        "with its whole weight")
    return dict(pairs)


def parse_variants(s: str) -> dict:
    """'uniform:0.6,hold:0.2,periodic:0.2' -> {variant: weight} (tasks.tracking.VARIANTS, finite weights >= 0)."""
    from tasks.tracking import VARIANTS

    try:
        pairs = [(k.strip(), float(v)) for k, v in (part.split(":") for part in s.split(",") if part.strip())]
    except ValueError:
        pairs = None
    out = None if pairs is None else _once(pairs, "--variants", s)
    if not out or any(k not in VARIANTS or not math.isfinite(v) or v < 0 for k, v in out.items()) \
            or not 0 < sum(out.values()) < math.inf:
        raise UserError(f"bad --variants {s!r}: use variant:weight pairs, variants {', '.join(VARIANTS)}, finite "
                        "weights >= 0 with a positive, finite sum, e.g. uniform:0.6,hold:0.2,periodic:0.2")
    return out


def parse_tasks(s: str) -> tuple:
    return tuple(t.strip() for t in s.split(",") if t.strip())


def parse_task_weights(s: str) -> tuple:
    try:
        return tuple(float(x) for x in s.split(","))
    except ValueError:
        raise UserError(f"bad --task-weights {s!r}: use one number per task, e.g. 0.3,0.1,0.6") from None


def parse_lr_legs(s: str) -> tuple:
    try:
        return tuple(ascii_int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--lr-legs must be comma-separated integers, got {s!r}") from None


def parse_base(s: str) -> str | None:
    if not s.strip():  # read as "the preset's base" before: a user asking for none got one
        raise UserError("--base is empty: give a model folder or preset name (leave the flag out for the preset's)")
    return s


def opt(default=None, help: str = "", *, factory=None, parse=None):
    """A field with its --help text and, for a field whose flag takes text, the function that reads the text."""
    meta = {"help": help, **({"parse": parse} if parse else {})}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """A training recipe. Validates itself on construction."""
    arch: str = opt("qwen3", "architecture of a model trained from scratch (refused with --base)")
    n_layers: int = opt(6, "decoder blocks (from scratch)")
    d_model: int = opt(128, "model width (from scratch)")
    n_heads: int = opt(4, "attention heads (from scratch)")
    n_kv_heads: int = opt(2, "key/value heads, qwen3 only (from scratch)")
    d_ff: int = opt(256, "MLP width, qwen3 only (from scratch)")
    max_len: int = opt(2048, "the model's context in tokens (from scratch)")
    attn_window: int = opt(0, "sliding attention window in tokens for every layer, qwen3 only (from scratch; 0 = "
                              "full causal attention)")
    attn_dropout: float = opt(0.0, "dropout on the attention probabilities while training, qwen3 built by the "
                                   "trainer (refused with --base); evaluation runs without; saved in the "
                                   "checkpoint's config (a later --base from it keeps it)")
    tie_embeddings: bool = opt(True, "tied input and output embeddings (--no-tie-embeddings: separate ones)")
    schedule: str = opt("60/25/15", f"pass-count weights of 1, 2, 3... passes per batch, e.g. 75/22/3; finite, at "
                                    f"most {MAX_PASSES}")
    lam: float = opt(1.0, "lambda, weight of the later passes")
    noise: float = opt(0.02, "uniform state noise sigma: U[-sigma, sigma] on the carried state")
    prefix_mix: float = opt(0.5, "probability of an unfused prefix per row")
    skip_values: bool = opt(False, "no loss on the random value symbols (digits, register names); labels stay "
                                   "targets (training.data.value_token_ids)")
    # at 5, labels stalled at chance for 1000+ steps
    label_weight: float = opt(20.0, "loss weight of the label token")
    targets: str = opt("all", "loss targets: every token (labels weighted by --label-weight) or the label tokens "
                              "alone (docs/recipe.md, multi_register)")
    depth_scale: bool = opt(False, "scale residual-output init by 1/sqrt(2L)")
    gate_init: str = opt("default", "init of the fusion gate W_G: nn.Linear's default, or scaled so sigmoid's input "
                                    "starts at std --gate-std (training.model.build_model)")
    gate_std: float = opt(1.0, "with --gate-init unit: std of the gate's pre-activation at init (larger = a stronger "
                               "token code in the fused input)")
    warm_passes: int = opt(4, "max extra no-grad Jacobi passes before pass 2 (exposes near-fixed-point states)")
    warm_prob: float = opt(0.25, "probability of warm passes in a multi-pass batch, drawn before the fixed-point "
                                 "start, which replaces them in --fixed-point-prob of the batches (so warm passes run "
                                 "in warm_prob * (1 - fixed_point_prob) of them)")
    fixed_point_prob: float = opt(0.0, "probability that a multi-pass batch starts its fused passes from the exact "
                                       "fixed point of the feedback map (the recurrent-full states; no gradient "
                                       "through it); 0 = off (docs/recipe.md)")
    fixed_point_tol: float = opt(0.0, "fixed-point start: try up to 16 Jacobi passes first and keep them once the "
                                      "largest relative state change is below this (engine.prefill.fixed_point_top; "
                                      "5.4x cheaper at two threads where the map contracts, in "
                                      "benchmarks/fixed_point.py); "
                                      "0 = always the exact one-token-step recurrence")
    consistency: float = opt(0.0, "weight of the state-consistency loss: each fused pass's top state is pulled toward "
                                  "the standard pass's (detached) at every fused position, relative squared error, "
                                  "so the standard states become a fixed point of the feedback map; 0 = off")
    consistency_window: int = opt(0, "add the consistency term again over the last W positions before each label "
                                     "target alone (where a standard pass holds the answer: 1 position in ~100-300 "
                                     "of the plain mean); 0 = off")
    consistency_layers: str = opt("top", "states the consistency term compares: the top state or every block's "
                                         "output (mean of the per-block relative errors)")
    distractors: dict = opt(help=f"N mixture as N:weight pairs, e.g. 0:0.3,8:0.3,32:0.3,128:0.1; N in "
                                 f"0..{MAX_DISTRACTORS}, finite weights >= 0 with a positive sum",
                            factory=lambda: {0: 0.3, 8: 0.3, 32: 0.3, 128: 0.1}, parse=parse_mixture)
    tasks: tuple = opt(("completion", "memory", "multi_register"), "comma-separated training tasks",
                       parse=parse_tasks)
    reads: int = opt(0, "answered queries inserted into each multi_register training sample (dense supervision of "
                        "the latest-write lookup; unpacked only)")
    # multi_register curriculum: over the first `register_curriculum` steps its training samples come from the
    # first levels of REGISTER_LEVELS (registers x writes: plain key-value lookups first, then latest-write with
    # ever more overwrites), one more level unlocked every register_curriculum / 8 steps; then the task.
    register_curriculum: int = opt(0, "steps over which multi_register training samples ramp from 2-register "
                                      "one-write lookups to the task (8 registers, 2/4/8 writes); 0 = off")
    task_weights: tuple | None = opt(None, "share of each step's tokens per task, one weight per training task in "
                                           "order, e.g. 0.3,0.1,0.6 (unpacked only; default equal); finite, > 0. "
                                           "Samples, not loss: each task's micro-batch is averaged over its own "
                                           "targets and weighs alike in the step's loss",
                                     parse=parse_task_weights)
    # The global batch: a run on several processes splits it (training.data.shard), so it trains the same data.
    batch_tokens: int = opt(2048, "approximate tokens per optimizer step, over all processes together")
    packing: bool = opt(True, "pack several samples per row (--no-packing: one sample per row, a micro-batch per "
                              "task)")
    seq_len: int = opt(1024, "packed row length in tokens, at most the model's context (max_len; the base's with "
                             "--base)")
    curriculum_steps: int = opt(600, "initial 1-pass steps on short samples (a standard warm start)")
    curriculum_max_n: int = opt(8, "largest N during the curriculum")
    curriculum_seq_len: int = opt(256, "packed row length during the curriculum, at most the model's context, as "
                                       "--seq-len")
    lr: float = opt(2e-3, "peak learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    warmup: int = opt(100, "linear learning-rate warm-up steps")
    steps: int = opt(4000, "total optimizer steps")
    # Before lr_legs[i] the cosine decays toward lr_legs[i], as if the run had been started with --steps lr_legs[i]
    # and then resumed with a larger --steps (which re-spreads the cosine over the new total): such a chain of
    # resumed runs in one run.
    lr_legs: tuple = opt((), "comma-separated ends of earlier legs, e.g. 1500,3000: the cosine decays toward each in "
                             "turn, as a run resumed with a larger --steps at each ('' = one cosine; default: the "
                             "preset's, minus legs that do not end before --steps)", parse=parse_lr_legs)
    seed: int = opt(0, "data and init seed")
    init_offset: int = opt(0, "added to --seed for the initial weights only: another value draws other initial "
                              "weights from the same data (a seed study against one twin); 0 = the shipped runs' "
                              "init (--seed 0 --init-offset 1 starts from --seed 1's weights)")
    eval_every: int = opt(250, "steps between evaluations")
    save_every: int = opt(250, "steps between checkpoints")
    base: str | None = opt(None, "warm start from an HF causal LM dir or preset (its tokenizer is kept; fresh fusion, "
                                 "fresh optimizer)", parse=parse_base)
    base_fusion: bool = opt(False, "with --base: keep the base's own trained fusion (W_U, W_G, norm) instead of a "
                                   "fresh one, to fine-tune a full-bandwidth checkpoint such as a shipped one "
                                   "(fresh optimizer, steps from 0; the shipped checkpoints carry no optimizer "
                                   "state, so they cannot be --resume'd)")
    objective: str = opt("multipass", "multipass: the Jacobi objective (pass k fuses pass k-1's states); recurrent: "
                                      "every batch runs recurrent-full and backpropagates through the whole "
                                      "recurrence (state tracking); the multi-pass flags (--schedule, --lam, --noise, "
                                      "--prefix-mix, --warm-*, --fixed-point-*, --consistency*) have no effect there "
                                      "and are refused, as they are under --schedule 1")
    dense_targets: bool = opt(False, "state-tracking tasks: the running value is a loss target at the end of every "
                                     "update line (never a token of the input), beside the final label")
    dense_every: bool = opt(False, "with --dense-targets: the running value is the target at every column from the "
                                   "first update line's end to the answer (the value as of the latest completed "
                                   "line), not only at line ends, so every top state fed back must read out, "
                                   "through the LM head, as the running value")
    length_doubling: int = opt(0, "length curriculum: N <= length-start * 2**(step // this) (within --distractors); "
                                  "0 = off")
    length_start: int = opt(4, "largest N in the first leg of the length curriculum")
    all_answers: bool = opt(False, "shell game training pairs drawn from all six ordered answer pairs (off: each "
                                   "pair's answers are cups A and B, never C, as in earlier runs)")
    variants: dict | None = opt(None, "state-tracking tasks: how each training pair's update lines are drawn, as "
                                      "variant:weight pairs of tasks.tracking.VARIANTS (uniform, hold, periodic, "
                                      "heldout), e.g. uniform:0.6,hold:0.2,periodic:0.2; default: uniform only, as "
                                      "earlier runs", parse=parse_variants)
    heldout_split: bool = opt(False, "state-tracking tasks: no training prompt holds a held-out transition pair "
                                     "(tasks.tracking.heldout_pairs, the split of arXiv 2606.07254), so the heldout "
                                     "variant tests pairs of lines never seen in a row")
    pairs: bool = opt(False, "unpacked batches of both members of every pair (rows 2i and 2i+1; the same token "
                             "budget); a twin trained without --interchange sees the same rows")
    decoy: float = opt(0.0, "recurrent objective: the share of columns whose cached keys/values are computed from "
                            "another row's fed state while each row's recurrence goes on from its own (the targets "
                            "stay the row's): the cache's copies of the state stop being a reliable source, the fed "
                            "state is; the complement of a state swap; 0 = off")
    interchange: float = opt(0.0, "recurrent objective on --pairs batches: the fraction of pairs whose fed states "
                                  "are exchanged at one column drawn uniformly after their last differing token, "
                                  "the targets from that column on being the donor's (interchange intervention "
                                  "training, Geiger et al. 2022); 0 = off")

    loop_core: int = opt(0, "a looped model (models.looped): the blocks of its core, iterated r times (0 = no loop); "
                            "the first loop_prelude of the n_layers blocks are the prelude, the rest after the core "
                            "the coda (from scratch, qwen3, schedule 1)")
    loop_prelude: int = opt(0, "a looped model: the blocks before the core")
    loop_iterations: int = opt(1, "a looped model: the trained r (the checkpoint's default); each step draws its r as "
                                  "1 + Poisson(r - 1), capped at 2r (Huginn draws r per step), the same in every process")
    loop_truncate: int = opt(0, "a looped model: backpropagate through the last k iterations only (0 = all; the "
                                "prelude still learns through the injection)")
    loop_inject: bool = opt(True, "a looped model: inject the prelude's output into every iteration through an adapter "
                                  "on [state; e] (Huginn); --no-loop-inject: plain iteration (Ouro)")

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
        for name, words in CHOICES.items():
            if getattr(self, name) not in words:
                raise UserError(f"{name} must be {' or '.join(map(repr, words))}, got {getattr(self, name)!r}")
        if not self.base:  # the sizes of a model built from scratch (--base keeps its own config)
            if self.d_model % self.n_heads:
                raise UserError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
            if self.arch == "qwen3" and self.n_heads % self.n_kv_heads:
                raise UserError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): each key/value "
                                "head serves a whole group of query heads")
            if self.arch == "qwen3" and (self.d_model // self.n_heads) % 2:
                raise UserError(f"d_model / n_heads ({self.d_model // self.n_heads}) must be even for qwen3: RoPE "
                                "rotates pairs of dimensions")
        if self.attn_window and self.arch != "qwen3":
            raise UserError(f"attn_window needs arch 'qwen3' (got {self.arch!r}: no sliding-window layers)")
        if self.attn_dropout and (self.arch != "qwen3" or self.base):
            raise UserError("attn_dropout needs a qwen3 model built by the trainer (not --base: its config is kept)")
        if self.loop_core:
            if self.base or self.arch != "qwen3":
                raise UserError("a looped model (loop_core > 0) is built from scratch as qwen3 (not --base, not gpt2)")
            if self.loop_prelude + self.loop_core > self.n_layers:
                raise UserError(f"loop_prelude ({self.loop_prelude}) + loop_core ({self.loop_core}) must be at most "
                                f"n_layers ({self.n_layers}); the rest is the coda")
            if self.objective != "multipass" or any(parse_schedule(self.schedule)[1:]):  # '1/0': one pass too
                raise UserError("a looped model has no fusion: train it with --objective multipass --schedule 1 (its "
                                "feedback is in depth, not across positions)")
            most = most_loop_iterations(self.loop_iterations)
            if self.loop_truncate >= most:  # refused, not dropped: it would change nothing
                raise UserError(f"--loop-truncate {self.loop_truncate} never truncates: a step runs at most {most} "
                                f"iteration(s) at --loop-iterations {self.loop_iterations}; use less or 0")
            if self.loop_truncate and not self.loop_inject and self.loop_prelude:
                raise UserError("--loop-truncate without injection would leave the prelude without gradient: keep "
                                "--loop-inject or set --loop-prelude 0")
        elif self.loop_prelude or self.loop_truncate or self.loop_iterations != 1 or not self.loop_inject:
            raise UserError("loop_prelude, loop_iterations, loop_truncate and loop_inject describe a looped model: set "
                            "loop_core > 0")
        self.probs = parse_schedule(self.schedule)
        if not all(math.isfinite(p) for p in self.probs) or len(self.probs) > MAX_PASSES:
            raise UserError(f"bad schedule {self.schedule!r}: at most {MAX_PASSES} finite weights (of 1, 2, 3... "
                            "passes), e.g. 75/22/3")
        # packed rows only (unpacked rows hold one sample each); --base keeps its own context, checked by the trainer
        if self.packing and not self.base and (self.seq_len > self.max_len or self.curriculum_seq_len > self.max_len):
            raise UserError(f"seq_len ({self.seq_len}) and curriculum_seq_len ({self.curriculum_seq_len}) must be at "
                            f"most the model's max_len ({self.max_len})")
        if self.warmup > self.steps:  # the rate would never reach --lr, and no cosine would run
            raise UserError(f"warmup ({self.warmup} steps) is longer than the run (steps {self.steps}): the learning "
                            f"rate would never reach lr; give --warmup at most {self.steps}")
        # a step is whole packed rows: fewer tokens than one row silently trained one row (the curriculum's rows are
        # at most --seq-len: training.cli refuses a longer one)
        if self.packing and self.batch_tokens < self.seq_len:
            raise UserError(f"batch_tokens ({self.batch_tokens}) is less than one packed row (seq_len {self.seq_len}): "
                            f"give --batch-tokens at least {self.seq_len}, or a shorter --seq-len")
        self.lr_legs = tuple(self.lr_legs)
        ends = (*self.lr_legs, self.steps)
        if any(isinstance(e, bool) or not isinstance(e, int) or e <= self.warmup for e in self.lr_legs) or \
                any(a >= b for a, b in zip(ends, ends[1:])):
            raise UserError(f"lr_legs must be increasing steps after the warm-up ({self.warmup}) and before "
                            f"steps ({self.steps}), got {list(self.lr_legs)}")
        try:
            self.distractors = {int(k): float(v) for k, v in dict(self.distractors).items()}
        except (TypeError, ValueError):
            raise UserError(f"distractors must map N to a weight, got {self.distractors!r}") from None
        if not self.distractors or any(not 0 <= k <= MAX_DISTRACTORS or not math.isfinite(v) or v < 0
                                       for k, v in self.distractors.items()) \
                or not 0 < sum(self.distractors.values()) < math.inf:  # an infinite sum: every probability 0
            raise UserError(f"distractors must map N in 0..{MAX_DISTRACTORS} to finite non-negative weights with a "
                            f"positive, finite sum, got {self.distractors}")
        from tasks import ALL_TASKS, TRACKING_TASKS
        self.tasks = tuple(self.tasks)
        twice = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if twice:  # each name a share of the mixture: a repeat silently doubled its share
            raise UserError(f"--tasks lists {', '.join(twice)} more than once; give each task once (--task-weights "
                            "sets the shares)")
        bad = [t for t in self.tasks if t not in ALL_TASKS]
        if bad or not self.tasks:
            raise UserError(f"unknown task(s) {', '.join(map(str, bad)) or '(none)'}; valid tasks: {', '.join(ALL_TASKS)}")
        if self.dense_targets and (self.packing or any(t not in TRACKING_TASKS for t in self.tasks)):
            raise UserError("dense_targets needs unpacked batches (--no-packing) and state-tracking tasks only "
                            f"({', '.join(TRACKING_TASKS)})")
        if self.base_fusion and not self.base:
            raise UserError("base_fusion needs --base (the checkpoint whose fusion is kept)")
        if self.dense_every and not self.dense_targets:
            raise UserError("dense_every needs --dense-targets")
        if any(t in TRACKING_TASKS for t in self.tasks) and min(self.distractors) < 1:
            raise UserError("the state-tracking tasks need N >= 1 update lines: drop N = 0 from distractors")
        if self.variants is not None:
            self.variants = parse_variants(",".join(f"{k}:{v}" for k, v in dict(self.variants).items()))
        if (self.variants is not None or self.heldout_split) and not any(t in TRACKING_TASKS for t in self.tasks):
            raise UserError(f"variants and heldout_split apply to the state-tracking tasks only "
                            f"({', '.join(TRACKING_TASKS)})")
        if self.heldout_split and "heldout" in (self.variants or {}) and self.variants["heldout"] > 0:
            raise UserError("heldout_split excludes the held-out pairs that the heldout variant is made of: drop "
                            "heldout from variants")
        if self.task_weights is not None:
            try:
                self.task_weights = tuple(float(w) for w in self.task_weights)
            except (TypeError, ValueError):
                raise UserError("task_weights needs one positive weight per task") from None
            if len(self.task_weights) != len(self.tasks) or \
                    any(not math.isfinite(w) or w <= 0 for w in self.task_weights) or \
                    not math.isfinite(sum(self.task_weights)):
                raise UserError(f"task_weights needs one positive weight per task (finite), got {list(self.task_weights)}")
        if self.pairs and self.packing:
            raise UserError("pairs needs unpacked batches (--no-packing)")
        if self.interchange and not (self.pairs and self.objective == "recurrent" and self.dense_targets):
            raise UserError("interchange needs --pairs, --objective recurrent and --dense-targets (the donor's "
                            "targets replace the row's after the exchange)")
        if self.decoy and (self.objective != "recurrent" or self.packing):
            raise UserError("decoy needs --objective recurrent (the decoy columns live in its cached recurrence) and "
                            "--no-packing (a row per sample)")
        if self.decoy and self.interchange:  # composable in the engine, but never tested nor measured together
            raise UserError("--decoy and --interchange train one at a time (their combination is untested)")
        if self.reads and self.packing:
            raise UserError("reads must be >= 0 and needs unpacked batches (--no-packing)")

    def check_world(self, world: int) -> None:
        """Refuse options that need every row of a micro-batch in one process (their partner or donor rows)."""
        if world > 1 and self.interchange:
            raise UserError("--interchange trains on one process (torchrun would split a pair's rows)")
        if world > 1 and self.decoy:
            raise UserError("--decoy trains on one process (its donors are rows of the whole micro-batch)")

    @property
    def max_passes(self) -> int:
        return len(self.probs)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name, off in (("register_curriculum", 0), ("targets", "all"), ("fixed_point_prob", 0.0),
                          ("fixed_point_tol", 0.0), ("consistency", 0.0), ("consistency_window", 0),
                          ("consistency_layers", "top"), ("gate_std", 1.0), ("objective", "multipass"),
                          ("dense_targets", False), ("dense_every", False), ("base_fusion", False), ("length_doubling", 0),
                          ("length_start", 4), ("attn_window", 0),
                          ("pairs", False), ("interchange", 0.0), ("all_answers", False), ("init_offset", 0),
                          ("attn_dropout", 0.0), ("decoy", 0.0), ("variants", None), ("heldout_split", False),
                          ("loop_core", 0), ("loop_prelude", 0), ("loop_iterations", 1), ("loop_truncate", 0),
                          ("loop_inject", True)):
            if d[name] == off:  # as lr_legs: the configs of runs without these options stay unchanged
                d.pop(name)
        if not self.lr_legs:  # keeps the config of runs without legs (the shipped logs) unchanged
            d.pop("lr_legs")
        # Exactly what train_log.json reads back (tuples -> lists, int keys -> str), so a plain --resume
        # compares equal and records no config change.
        return json.loads(json.dumps(d))
