"""Named presets: training recipes for the shipped tiny models, and model loading by name or path."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.errors import UserError
from training.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "checkpoints"


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
# Every layer attends to a 64-token window (both models, same architecture): the trained prompts (up to 263
# tokens) are 4x the window, so the windowed regime a longer prompt runs in is the one trained; the standard
# pass's receptive field (6 x 63 = 378 tokens) still covers every trained prompt. docs/recipe.md item 19.
# The running value is a loss target at every column of the update lines (dense_every), and shell-game pairs
# end on all three cups (all_answers): without these the shell game stalls at 0.69 on the draws that never
# answer C (docs/recipe.md item 21).
_TRACK = dict(tasks=("parity", "shell_game"), attn_window=64, packing=False, dense_targets=True, dense_every=True,
              all_answers=True, targets="labels", schedule="1",
              distractors={n: 1.0 for n in range(1, 65)}, length_doubling=200, length_start=4, curriculum_steps=0,
              task_weights=(0.4, 0.6), batch_tokens=4096, lr=1e-3, warmup=100, steps=1000, gate_init="unit",
              gate_std=3.0, prefix_mix=0.0, noise=0.0, eval_every=100, save_every=100)
PRESETS["tiny-fbt-track"] = TrainConfig(objective="recurrent", **_TRACK)
PRESETS["tiny-std-track"] = TrainConfig(**_TRACK)
# An experiment, not shipped (docs/recipe.md item 20): 200 more steps resumed from a local 1000-step run of the
# earlier tiny-fbt-track recipe (--resume needs its optimizer state, which shipped checkpoints do not carry) on
# both members of every pair, half of them with interchange training.
# It lost the tasks (parity at chance by step 1200) instead of making the fed state the only carrier. It keeps
# the data of the recipe it was run on (line-end targets only, shell-game answers A / B).
PRESETS["tiny-fbt-track-iit"] = replace(PRESETS["tiny-fbt-track"], steps=1200, lr_legs=(1000,), pairs=True,
                                        interchange=0.5, dense_every=False, all_answers=False)
PRESETS["smoke"] = replace(TrainConfig(), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64,
                           steps=4, batch_tokens=256, seq_len=128, curriculum_steps=0, eval_every=2, save_every=2,
                           distractors={0: 0.5, 8: 0.5}, warmup=1)


def get_preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name])


def checkpoint_dir(name: str) -> Path:
    """The folder of the named checkpoint: the first ``<root>/<name>`` that exists along the search path
    (common.paths.checkpoint_roots: each folder of $FBPROBE_CHECKPOINTS, then ./checkpoints, then the package's
    own checkpoints/), else the package's ``checkpoints/<name>`` (where training.train writes by default)."""
    from common.paths import checkpoint_roots

    for root in checkpoint_roots():
        if (root / name).is_dir():
            return root / name
    return CHECKPOINTS / name


def load_model(name_or_path: str, placement=None):
    """Load a model by shipped preset name, full-bandwidth checkpoint dir, or plain HF model dir.

    Returns (FullBandwidthLM, tokenizer or None, name). A plain HF LM is wrapped without a fusion module.
    Anything unreadable or inconsistent (config, weights, NaN/inf weights, tokenizer) is one UserError line.
    `placement` (common.placement.Placement; default float32 on the CPU): device, dtype and, for plain HF
    models, an accelerate device map.
    """
    from common.placement import CPU
    from models.full_bandwidth import FullBandwidthLM, check_finite_weights

    placement = placement or CPU
    p = Path(name_or_path)
    # --- the real pretrained model of the recirculation study, owned by models/smollm2.py ---
    if not p.exists() and name_or_path == "smollm2-135m":
        from models.smollm2 import load_smollm2

        model, tok, name = load_smollm2(**_hf_kw(placement))
        check_finite_weights(model, name)
        return placement.place(model), tok, name
    # ---
    if not p.exists() and name_or_path in PRESETS:
        p = checkpoint_dir(name_or_path)
        if not p.exists():
            raise UserError(f"preset {name_or_path!r} has no shipped checkpoint at {p}; train it with "
                            f"`python -m training.train --preset {name_or_path}`")
    if not p.exists():
        raise UserError(f"unknown model {name_or_path!r}: not a preset ({', '.join(k for k in PRESETS if k != 'smoke')}) "
                        f"nor an existing directory")
    if not p.is_dir():
        raise UserError(f"model {name_or_path!r}: {p} is a file, not a model directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{p} is not a model directory: it has no config.json")
    if '"full-bandwidth-lm"' in cfg_file.read_text(errors="replace"):
        if placement.device_map != "none":
            raise UserError(f"--device-map is for plain HF models; {p} is a full-bandwidth checkpoint "
                            "(use --device)")
        model = FullBandwidthLM.from_pretrained(p)
    else:
        model = FullBandwidthLM(_load_hf_lm(p, **_hf_kw(placement)), fusion=False).eval()
    return placement.place(model), _load_tokenizer(p, model), p.name


def _hf_kw(placement) -> dict:
    """from_pretrained keywords of a placement: the dtype, and accelerate's device map when asked."""
    kw = {"dtype": placement.torch_dtype}
    if placement.device_map != "none":
        kw["device_map"] = placement.device_map
    return kw


def _load_hf_lm(p: Path, **from_pretrained_kw):
    """A plain HF causal LM from `p`; UserError if it cannot be read, has a config that makes a NaN or blind model
    (models.configs.check_config), non-floating, missing/mis-shaped or NaN/inf weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from common.jsonio import read_user_json
    from models.configs import check_config
    from models.full_bandwidth import check_finite_weights, non_float_weights, one_line

    hf_logging.disable_progress_bar()  # a per-shard bar is noise for the small models loaded here
    read_user_json(p / "config.json", "corrupt model config")  # huge ints, deep nesting, NaN: one line, not HF's
    try:
        config = AutoConfig.from_pretrained(str(p))
    except Exception as e:  # OSError/ValueError, HF config validation errors
        raise UserError(f"cannot load a model from {p}: {one_line(e)}") from None
    check_config(config, p / "config.json")
    try:
        ints = non_float_weights(p)  # HF would cast them silently into the float parameters
        if not ints:
            lm, info = AutoModelForCausalLM.from_pretrained(str(p), config=config, output_loading_info=True,
                                                            **from_pretrained_kw)
    except Exception as e:  # OSError/ValueError, safetensors errors on corrupt files
        raise UserError(f"cannot load a model from {p}: {one_line(e)}") from None
    if ints:
        raise UserError(f"corrupt model weights in {p}: {len(ints)} stored in a non-floating type, first "
                        f"{ints[0][0]} ({ints[0][1]}); weights must be floating point")
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
    """The tokenizer saved beside the model (None if it has none: models.tokenizers.LOOKED_FOR); UserError if it is
    unreadable or holds token ids the model's embedding does not have."""
    from models.tokenizers import check_fits, load_tokenizer_dir

    tok = load_tokenizer_dir(p)
    if tok is not None:
        check_fits(tok, model, f"tokenizer in {p}")
    return tok
