"""Named presets: training recipes for the shipped tiny models, and model loading by name or path."""
from __future__ import annotations

import json
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
    # change is below this (models.prefill.fixed_point_top; 2-5x cheaper where the map contracts); 0 = always the
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

    def __post_init__(self):
        self.probs = parse_schedule(self.schedule)
        if self.arch not in ("qwen3", "gpt2"):
            raise UserError(f"unknown arch {self.arch!r} (qwen3 or gpt2)")
        for name in ("n_layers", "d_model", "n_heads", "steps", "batch_tokens"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"{name} must be positive")
        if self.warm_passes < 0 or not 0 <= self.warm_prob <= 1:
            raise UserError("warm_passes must be >= 0 and warm_prob in [0, 1]")
        if not 0 <= self.fixed_point_prob <= 1:
            raise UserError(f"fixed_point_prob must be in [0, 1], got {self.fixed_point_prob}")
        if not 0 <= self.fixed_point_tol < 1:
            raise UserError(f"fixed_point_tol must be in [0, 1), got {self.fixed_point_tol}")
        if self.consistency < 0:
            raise UserError(f"consistency must be >= 0, got {self.consistency}")
        if self.consistency_layers not in ("top", "all"):
            raise UserError(f"consistency_layers must be 'top' or 'all', got {self.consistency_layers!r}")
        if self.consistency_window < 0:
            raise UserError(f"consistency_window must be >= 0, got {self.consistency_window}")
        self.lr_legs = tuple(self.lr_legs)
        ends = (*self.lr_legs, self.steps)
        if any(not isinstance(e, int) or e <= self.warmup for e in self.lr_legs) or \
                any(a >= b for a, b in zip(ends, ends[1:])):
            raise UserError(f"lr_legs must be increasing steps after the warm-up ({self.warmup}) and before "
                            f"steps ({self.steps}), got {list(self.lr_legs)}")
        if self.gate_init not in ("default", "unit"):
            raise UserError(f"gate_init must be 'default' or 'unit', got {self.gate_init!r}")
        if self.gate_std <= 0:
            raise UserError(f"gate_std must be > 0, got {self.gate_std}")
        if self.noise < 0 or not 0 <= self.prefix_mix <= 1 or self.lr <= 0:
            raise UserError("noise must be >= 0, prefix_mix in [0, 1], lr > 0")
        self.distractors = {int(k): float(v) for k, v in self.distractors.items()}
        if not self.distractors or any(k < 0 or v < 0 for k, v in self.distractors.items()) \
                or sum(self.distractors.values()) <= 0:
            raise UserError("distractors must map N >= 0 to non-negative weights with a positive sum")
        from tasks import TASKS
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise UserError(f"unknown task(s) {', '.join(bad) or '(none)'}; valid tasks: {', '.join(TASKS)}")
        if self.task_weights is not None:
            self.task_weights = tuple(float(w) for w in self.task_weights)
            if len(self.task_weights) != len(self.tasks) or min(self.task_weights) <= 0:
                raise UserError("task_weights needs one positive weight per task")
        if self.reads < 0 or (self.reads and self.packing):
            raise UserError("reads must be >= 0 and needs unpacked batches (--no-packing)")
        if self.targets not in ("all", "labels"):
            raise UserError(f"targets must be 'all' or 'labels', got {self.targets!r}")
        if self.register_curriculum < 0:
            raise UserError("register_curriculum must be >= 0 (steps)")
        if self.seq_len <= 0 or self.curriculum_seq_len <= 0 or self.curriculum_steps < 0:
            raise UserError("seq_len and curriculum_seq_len must be positive, curriculum_steps >= 0")

    @property
    def max_passes(self) -> int:
        return len(self.probs)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name, off in (("register_curriculum", 0), ("targets", "all"), ("fixed_point_prob", 0.0),
                          ("fixed_point_tol", 0.0), ("consistency", 0.0), ("consistency_window", 0),
                          ("consistency_layers", "top"), ("gate_std", 1.0)):
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
    """
    from models.full_bandwidth import FullBandwidthLM

    p = Path(name_or_path)
    # --- optional real pretrained model (SPEC section 6), owned by models/smollm2.py ---
    if not p.exists() and name_or_path == "smollm2-135m":
        from models.smollm2 import load_smollm2

        return load_smollm2()
    # ---
    if not p.exists() and name_or_path in PRESETS:
        p = checkpoint_dir(name_or_path)
        if not p.exists():
            raise UserError(f"preset {name_or_path!r} has no shipped checkpoint at {p}; train it with "
                            f"`python -m models.train --preset {name_or_path}`")
    if not p.exists():
        raise UserError(f"unknown model {name_or_path!r}: not a preset ({', '.join(k for k in PRESETS if k != 'smoke')}) "
                        f"nor an existing directory")
    cfg_file = p / "config.json"
    if cfg_file.is_file() and '"full-bandwidth-lm"' in cfg_file.read_text(errors="replace"):
        model = FullBandwidthLM.from_pretrained(p)
    else:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a per-shard bar is noise for the small models loaded here
        try:
            lm = AutoModelForCausalLM.from_pretrained(str(p))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load a model from {p}: {str(e).splitlines()[0]}") from None
        model = FullBandwidthLM(lm, fusion=False).eval()
    tok = None
    if (p / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast.from_pretrained(str(p))
    return model, tok, p.name
