"""Named presets: training recipes for the shipped tiny models (loading a model by name or path: models.loading)."""
from __future__ import annotations

from dataclasses import replace

from common.errors import UserError
from models.checkpoints import PRESET_NAMES
from training.config import TrainConfig


# Two stages, as the paper (warm start from a standard checkpoint). Stage 1, `tiny-base`: 1-pass training, one
# sample per row, loss on the label tokens only; the first 1500 steps on N = 0 only (many short samples:
# completion needed ~1e5 samples to leave its plateau in a small probe run), then the full N mixture, with
# multi_register ramped from a plain lookup over its first 3000 steps (without it the task stayed at chance).
# Stage 2 continues from tiny-base: multi-pass (tiny-fbt, tiny-fbt-no3) or 1-pass (tiny-std, the baseline with
# tiny-fbt's architecture, data and token budget). A feedback fixed point that keeps every task's label needed
# a token-aware gate (gate_init "unit", pre-activation std 3: with nn.Linear's default init sigmoid(W_G e) sat at
# ~0.5 for every token), warm no-grad passes and fused passes started from the fixed point (Jacobi passes to a
# relative change < 1e-3 where that is cheaper, else the exact recurrence: 5.4x cheaper at two threads in
# benchmarks/fixed_point.py, same start), and a state-consistency loss that pulls every fused pass's block
# outputs toward the standard pass's (the label loss alone let fused passes relay pass 1's state, a shortcut
# gone at the fixed point). docs/recipe.md has each step.
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
# The S5 and A5 word problems (issue 40; tasks.groups), one model for both as tiny-fbt-track holds parity and the
# shell game: the tracking recipe, its pairs drawn 60% uniform, 20% with a stretch of lines that leave the ball
# where it is (hold: longer than the window from N = 32 on) and 20% periodic, so that a state which rides on the
# window instead of the feedback is trained against; no prompt holds a held-out transition pair (heldout_split),
# so the heldout variant is a test of unseen line pairs (docs/recipe.md item 23).
_GROUP = {**_TRACK, "tasks": ("s5", "a5"), "task_weights": (0.5, 0.5), "heldout_split": True,
          "variants": {"uniform": 0.6, "hold": 0.2, "periodic": 0.2}}
PRESETS["tiny-fbt-group"] = TrainConfig(objective="recurrent", **_GROUP)
PRESETS["tiny-std-group"] = TrainConfig(**_GROUP)
# The tracking pair again, on inputs that do not let the state ride on the window (issue 40, docs/recipe.md item
# 23): item 22's recipe with the group models' data draws (hold and periodic stretches, no held-out transition
# pair). tiny-fbt-track lost parity on a stretch of x ^= 0 lines longer than its window (0.45 at N = 64).
_TRACK2 = {**_TRACK, "heldout_split": True, "variants": {"uniform": 0.6, "hold": 0.2, "periodic": 0.2}}
PRESETS["tiny-fbt-track2"] = TrainConfig(objective="recurrent", **_TRACK2)
PRESETS["tiny-std-track2"] = TrainConfig(**_TRACK2)
# The same data with a window of one update line (4 tokens: "x ^= 1 \n", "swap A C \n"; issue 40, docs/recipe.md
# item 26): neither a still stretch nor a pair of lines can be read from the window, so the fed state is the only
# carrier of the tracked value from one line to the next.
PRESETS["tiny-fbt-track3"] = TrainConfig(objective="recurrent", **{**_TRACK2, "attn_window": 4})
# A 2-token window (docs/recipe.md item 27): a swap's two cups are in view together at its second cup, and no
# position sees operands of two different lines.
PRESETS["tiny-fbt-track4"] = TrainConfig(objective="recurrent", **{**_TRACK2, "attn_window": 2})
# Feedback in depth beside the tracking pair (issue 41, models.looped): the same 6 blocks, 64-token windows and data
# as tiny-fbt-track / tiny-std-track, arranged as a prelude of 2, a core of 2 iterated r = 4 times (r drawn per step,
# 1 + Poisson(3), at most 8) with Huginn's input injection, and a coda of 2; the adapter (2 D^2) has the fusion's
# parameter count (W_U and W_G), so the two models match in parameters; per token the loop runs 2 + 2 r + 2 = 12
# blocks at r = 4. No fusion: one parallel pass per prompt (schedule 1), the recurrence is in depth only.
_LOOP = {"loop_prelude": 2, "loop_core": 2, "loop_iterations": 4}
PRESETS["tiny-loop-track"] = TrainConfig(**_TRACK, **_LOOP)
# The same looped network on the S5 / A5 data of tiny-fbt-group (its looped counterpart).
PRESETS["tiny-loop-group"] = TrainConfig(**_GROUP, **_LOOP)
# An experiment, not shipped (docs/recipe.md item 25): the looped network on tiny-fbt-track2's data (hold and
# periodic draws, held-out transition pairs).
PRESETS["tiny-loop-track2"] = TrainConfig(**_TRACK2, **_LOOP)
PRESETS["smoke"] = replace(TrainConfig(), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64,
                           steps=4, batch_tokens=256, seq_len=128, curriculum_steps=0, eval_every=2, save_every=2,
                           distractors={0: 0.5, 8: 0.5}, warmup=1)
# models.checkpoints (below training) finds each preset's checkpoint by name: its list must be these names, in order.
if tuple(PRESETS) != PRESET_NAMES:
    raise RuntimeError(f"models.checkpoints.PRESET_NAMES {PRESET_NAMES} != training.presets.PRESETS {tuple(PRESETS)}")


def get_preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name])
