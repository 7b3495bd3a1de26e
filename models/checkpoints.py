"""Named checkpoints: the names of the training presets and the folder each one's checkpoint is found in.

    checkpoint_dir(name) -> the folder of a named checkpoint (common.paths.checkpoint_roots)

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
