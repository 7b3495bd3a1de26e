"""plotly.js for the suite's pages (probes.depth_curves, interventions.report, analysis.*): one copy per output
folder (``--plotly directory``, the default), inline in the page, or from the CDN."""
from __future__ import annotations

import functools
from pathlib import Path

from common.errors import UserError

PLOTLY_JS = "plotly.min.js"  # the one copy of plotly.js beside the pages of a folder (--plotly directory)
PLOTLY_CHOICES = ("directory", "inline", "cdn")


def check_plotly(mode: str) -> str:
    """`mode` if it is one of PLOTLY_CHOICES, else a one-line UserError."""
    if mode not in PLOTLY_CHOICES:
        raise UserError(f"--plotly {mode!r}: expected one of {', '.join(PLOTLY_CHOICES)}")
    return mode


def include_plotlyjs(mode: str):
    """plotly's ``include_plotlyjs`` argument for a --plotly mode (the page references ``plotly.min.js`` beside
    it under "directory"; write that file with `write_plotly_js` / `stage_plotly_js`)."""
    return {"directory": "directory", "inline": True, "cdn": "cdn"}[check_plotly(mode)]


@functools.lru_cache(maxsize=1)
def plotly_js() -> bytes:
    """The installed plotly's plotly.min.js bundle (what an inline page embeds)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode("utf-8")


def plotly_js_missing(directory: str | Path, mode: str = "directory") -> bool:
    """True when a "directory" page in `directory` needs plotly.min.js written: absent, or not this plotly's
    bundle (an older version, a truncated copy)."""
    if check_plotly(mode) != "directory":
        return False
    p = Path(directory) / PLOTLY_JS
    js = plotly_js()
    return not (p.is_file() and p.stat().st_size == len(js) and p.read_bytes() == js)


def write_plotly_js(directory: str | Path, mode: str = "directory") -> Path | None:
    """Write plotly.min.js into `directory` for its "directory" pages (atomically, only when missing or
    different); None for the other modes. Write it *before* the pages, so no page references a missing file."""
    from common.io import atomic_write

    if check_plotly(mode) != "directory":
        return None
    if plotly_js_missing(directory, mode):
        atomic_write(Path(directory) / PLOTLY_JS, plotly_js())
    return Path(directory) / PLOTLY_JS


def stage_plotly_js(st, mode: str = "directory") -> None:
    """The same inside a common.staged.Staged block: plotly.min.js is staged (renamed into place with the
    run's other files, before them) when the folder needs it. Stage it before the pages."""
    if plotly_js_missing(st.root, mode):
        st.file(PLOTLY_JS, plotly_js())
