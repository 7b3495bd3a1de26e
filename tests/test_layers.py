"""The package layers are enforced, not hoped (docs/design.md, "Layers"): the import-linter contracts of
pyproject.toml hold, no two files import each other (directly or around a longer loop), and no package imports
the script folders (benchmarks/, scripts/, examples/)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the backport (an import-linter dependency there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = CONFIG["root_packages"]
SCRIPT_FOLDERS = ("benchmarks", "scripts", "examples", "tests")


def _graph():
    try:
        import grimp
    except ImportError:  # a dependency of import-linter, in the dev extra
        pytest.fail("grimp is missing: install the dev extra (pip install -e '.[dev]')")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_every_package_is_named_in_the_contract():
    found = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")
    assert sorted(PACKAGES) == found
    layers = {m.strip() for c in CONFIG["contracts"] if c["type"] == "layers" for layer in c["layers"]
              for m in layer.replace("|", ":").split(":")}
    assert layers == set(PACKAGES)


def test_import_linter_contracts_hold():
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.is_file():
        pytest.fail(f"{exe} is missing: install the dev extra (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([str(exe), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "0 broken" in r.stdout


def _cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan), each sorted."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_files(graph):
    """Every import counts, a lazy one inside a function too: a file never depends on itself through others."""
    ours = {m for m in graph.modules if m.split(".")[0] in PACKAGES}
    adj = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in ours} for m in ours}
    cycles = _cycles(adj)
    detail = []
    for comp in cycles:
        for m in comp:
            for i in sorted(adj[m] & set(comp)):
                lines = [d["line_number"] for d in graph.get_import_details(importer=m, imported=i)]
                detail.append(f"{m} -> {i} (line {', '.join(map(str, lines))})")
    assert not cycles, "import cycles between files:\n" + "\n".join(detail)


def test_no_package_imports_the_script_folders(graph):
    bad = []
    for m in sorted(graph.modules):
        if m.split(".")[0] not in PACKAGES:
            continue
        for i in graph.find_modules_directly_imported_by(m):
            if i.split(".")[0] in SCRIPT_FOLDERS:
                bad.append(f"{m} -> {i}")
    assert not bad, "packages import script folders:\n" + "\n".join(bad)


def test_preset_names_are_the_training_presets():
    from models.checkpoints import PRESET_NAMES
    from training.presets import PRESETS

    assert tuple(PRESETS) == PRESET_NAMES


def test_nothing_outside_engine_branches_on_a_modes_kind():
    """Issue 38: what a mode is lives in engine/ (engine.modes.Mode's properties); no other file asks a mode's kind
    (`grep -rnE "\\.kind (==|in)"` outside engine/ finds nothing). analysis.where_state did, for a loop's R."""
    import re

    pattern = re.compile(r"\.kind (==|in)")
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout: every .py below the root but the virtual environment
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    hits = [f"{f}:{i}" for f in files if not f.startswith("engine/")
            for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
