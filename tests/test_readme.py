"""The README is a product page: at most 180 lines, a quick start of two commands (`make demo`, `make test`),
and every relative link in it resolves to a file of the clone."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_starts_with_two_commands():
    assert len(README.splitlines()) <= 180
    quick = README.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in quick.strip().splitlines()] == ["make demo", "make test"]


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
