"""Where commands write by default, and where shipped checkpoints are looked for.

Outputs: every default output lies under ``./figures/`` of the **current working directory** (never under the
installed package, so a command run outside the clone writes beside the user, not into an editable install):

- `default_output(model, task)` = ``./figures/<model>/<task>/`` (probes.run, interventions.run,
  analysis.recirculation's ``recirculation`` / ``mediation-<task>``);
- `figures_dir(*parts)` = ``./figures/<parts...>`` (analysis.evaluate's ``<model>/eval.json``,
  analysis.stability's ``stability/``, analysis.gains's ``gains/``, analysis.length_curves's
  ``length_curves.html``).

Checkpoints: `checkpoint_roots()` is the search path of a preset's checkpoint folder (docs/usage.md, "Where
outputs go and where checkpoints are found"): each folder of ``$FBPROBE_CHECKPOINTS`` (colon-separated, empty
entries ignored, relative ones taken from the current directory), then ``./checkpoints``, then the package's
own ``checkpoints/``. ``models.checkpoints.checkpoint_dir(name)`` returns the first ``<root>/<name>`` that exists.
"""
from __future__ import annotations

import os
from pathlib import Path

from common.errors import UserError

FIGURES = "figures"
CHECKPOINTS_ENV = "FBPROBE_CHECKPOINTS"
PACKAGE_CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


def _component(name: str, what: str) -> str:
    s = str(name)
    if s in ("", ".", "..") or "/" in s or os.sep in s or "\0" in s:
        raise UserError(f"cannot use {s!r} as the {what} folder name of a default output: give --out explicitly")
    return s


def figures_dir(*parts: str) -> Path:
    """``<cwd>/figures/<parts...>`` (each part one plain folder or file name)."""
    return Path.cwd() / FIGURES / Path(*[_component(p, "output") for p in parts]) if parts else Path.cwd() / FIGURES


def default_output(model_name: str, task: str) -> Path:
    """The default output folder of a run of `model_name` on `task`: ``<cwd>/figures/<model>/<task>``."""
    return Path.cwd() / FIGURES / _component(model_name, "model") / _component(task, "task")


def checkpoint_roots() -> list[Path]:
    """The checkpoint search path, in order: ``$FBPROBE_CHECKPOINTS`` entries, ``./checkpoints``, the package's."""
    roots = [Path(e) for e in os.environ.get(CHECKPOINTS_ENV, "").split(":") if e.strip()]
    roots += [Path.cwd() / "checkpoints", PACKAGE_CHECKPOINTS]
    out: list[Path] = []
    for r in roots:
        r = r if r.is_absolute() else Path.cwd() / r
        if r not in out:
            out.append(r)
    return out
