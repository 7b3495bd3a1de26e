"""Named checkpoints: the names of the training presets and the folder each one's checkpoint is found in.

    checkpoint_dir(name) -> the folder of a named checkpoint (common.paths.checkpoint_roots)
    fusion_trained(path)  -> whether a checkpoint's training ran its fusion (None: no training log)

Below models.loading and models.tokenizers (both find a preset's folder by name), and below training/.
"""
from __future__ import annotations

from pathlib import Path

# The names of training.presets' recipes, in its order: each one's checkpoint is found by name. Kept here, below
# training (models/ may not import training/); training.presets refuses to import when the two lists differ.
PRESET_NAMES = ("tiny-base", "tiny-fbt", "tiny-std", "tiny-fbt-no3", "tiny-fbt-track", "tiny-std-track",
                "tiny-fbt-track-iit", "tiny-fbt-group", "tiny-std-group",
                "tiny-fbt-track2", "tiny-std-track2", "tiny-fbt-track3", "tiny-fbt-track4", "tiny-loop-track", "tiny-loop-group",
                "tiny-loop-track2", "smoke")


def checkpoint_dir(name: str) -> Path:
    """The folder of the named checkpoint: the first ``<root>/<name>`` that exists along the search path
    (common.paths.checkpoint_roots: each folder of $FBPROBE_CHECKPOINTS, then ./checkpoints, then the package's
    own checkpoints/), else the package's ``checkpoints/<name>`` (where training.train writes by default)."""
    from common.paths import PACKAGE_CHECKPOINTS, checkpoint_roots

    for root in checkpoint_roots():
        if (root / name).is_dir():
            return root / name
    return PACKAGE_CHECKPOINTS / name


def fusion_trained(path: str | Path, _depth: int = 0) -> bool | None:
    """Whether the trainer ever ran a checkpoint's fusion: True for the recurrent objective or a schedule that
    can draw two passes or more, here or in the checkpoint it continued from (`base`); False where every step
    was the one-pass standard pass (the fusion keeps its initial weights); None where that cannot be read (no
    training log: any other HF model; a base not found). Read from train_log.json's recipe."""
    import json

    try:
        cfg = json.loads((Path(path) / "train_log.json").read_text())["config"]
        weights = [float(w) for w in str(cfg["schedule"]).split("/")]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if cfg.get("objective", "multipass") != "multipass" or any(w > 0 for w in weights[1:]):
        return True
    base = cfg.get("base")
    if not base:
        return False
    found = Path(base) if Path(base).is_dir() else checkpoint_dir(str(base))
    return fusion_trained(found, _depth + 1) if found.is_dir() and _depth < 32 else None
