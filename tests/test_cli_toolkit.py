"""One CLI toolkit (common.cli): every entry point builds its parser on `Parser` and declares the flags it shares
with others through the shared groups, so that every `--help` lists them in the same words and bounds, a too-large
--seed is refused with the same one line everywhere, and no module builds an argparse parser or reads sys.argv by
hand."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from common.cli import MAX_SEED, MAX_THREADS, SHARED_HELP, DefaultsFormatter, Parser, add_seed_flag, derived_seed

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "stats", "tasks", "models", "engine", "training", "probes", "interventions", "analysis")
SCRIPT_FOLDERS = ("benchmarks", "scripts", "examples")

# Every entry point: the file that holds its `main(argv)`, and the shared flags it takes (MODEL / TASK: the shared
# model / task words as a positional argument). A new entry point is added here (test_every_entry_point_is_listed).
ENTRY_POINTS = {
    "probes/run.py": {"--task", "--model", "--tokenizer", "--seed", "--out", "--overwrite", "--no-progress",
                      "--device", "--dtype", "--device-map"},
    "probes/depth_curves.py": {"--plotly", "--overwrite"},
    "interventions/run.py": {"--task", "--model", "--tokenizer", "--seed", "--out", "--overwrite", "--no-progress",
                             "--device", "--dtype", "--device-map", "--plotly"},
    "analysis/evaluate.py": {"--tasks", "--model", "--tokenizer", "--seed", "--out", "--overwrite", "--no-progress",
                             "--device", "--dtype", "--device-map"},
    "analysis/gains.py": {"--tasks", "--tokenizer", "--out", "--overwrite", "--no-progress", "--plotly"},
    "analysis/stability.py": {"--tasks", "--tokenizer", "--out", "--overwrite", "--plotly", "--no-progress"},
    "analysis/length_curves.py": {"--out", "--overwrite", "--plotly"},
    "analysis/where_state.py": {"--out", "--overwrite", "--plotly"},
    "analysis/fixed_point.py": {"MODEL", "--tokenizer"},
    "analysis/demo.py": {"--out", "--overwrite", "--no-progress"},
    "analysis/recirculation/cli.py": {"--model", "--out", "--overwrite", "--plotly", "--dtype", "--threads", "--seed"},
    "training/cli.py": {"--out", "--overwrite", "--threads", "--device", "--no-progress", "--seed", "--tasks"},
    "training/card.py": set(),
    "models/smollm2.py": set(),
    "benchmarks/attribution.py": {"--model", "--task", "--threads"},
    "benchmarks/collect.py": {"--model", "--threads"},
    "benchmarks/collect_processes.py": {"--model", "--threads"},
    "benchmarks/cold_step.py": {"--seed"},
    "benchmarks/decode.py": {"--threads", "--seed", "--device"},
    "benchmarks/fixed_point.py": {"--model", "--threads"},
    "benchmarks/interventions.py": {"--model", "--task"},
    "benchmarks/patching.py": {"--model", "--task", "--threads"},
    "benchmarks/prefill.py": {"--threads", "--seed", "--device"},
    "benchmarks/probes.py": {"--threads"},
    "benchmarks/probes_run.py": set(),
    "benchmarks/recirculation.py": {"--model", "--threads"},
    "benchmarks/train.py": {"--threads", "--seed"},
    "benchmarks/train_ddp.py": {"--threads"},
    "scripts/accuracy_by_answer.py": {"MODEL", "TASK"},
    "scripts/argmax_counts.py": {"MODEL", "TASK"},
    "scripts/first_line_by_answer.py": {"MODEL", "TASK"},
    "scripts/first_line_rows.py": {"MODEL", "TASK"},
    "scripts/swap_persistence.py": {"MODEL", "TASK"},
    "scripts/permutation_probe.py": {"--model", "--seed", "--threads"},
    "scripts/probe_direction.py": {"--model", "--seed", "--threads"},
    "scripts/stress_tracking.py": {"--model", "--seed", "--threads"},
    "scripts/heldout_cells.py": {"--model", "--seed", "--threads"},
    "scripts/task_vocab.py": set(),
    "scripts/verdict_table.py": set(),
}
# `python -m` doors that only call an entry point above.
WRAPPERS = {"training/train.py": "training.cli", "training/__main__.py": "training.cli",
            "analysis/recirculation/__main__.py": "analysis.recirculation.cli"}
POSITIONAL = {"MODEL": "--model", "TASK": "--task"}


def _sources():
    for folder in PACKAGES + SCRIPT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path.relative_to(ROOT).as_posix(), path.read_text()


def _load(rel: str):
    path = ROOT / rel
    if not path.is_file():
        pytest.skip(f"{rel} is not in this checkout")
    if rel.split("/")[0] in PACKAGES:
        return importlib.import_module(rel[:-3].replace("/", "."))
    spec = importlib.util.spec_from_file_location("cli_toolkit_" + rel[:-3].replace("/", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _help(rel: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping: one help text per line
    mod = _load(rel)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0, rel
    return capsys.readouterr().out


def _entries(text: str) -> dict[str, str]:
    """{option or positional name: its help text} of a --help page (written without wrapping)."""
    out, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"^  \S", line):
            continue
        head, _, help_ = line.strip().partition("  ")
        if not help_.strip() and i + 1 < len(lines) and re.match(r"^ {3,}\S", lines[i + 1]):
            help_ = lines[i + 1]
        names = [t.rstrip(",") for t in head.split() if t.startswith("-")] or [head.split()[0]]
        for name in names:
            out[name] = " ".join(help_.split())
    return out


def _shared_words(flag: str) -> str:
    return " ".join(SHARED_HELP[flag].split())


# ----- every entry point --------------------------------------------------------------------------------------
def test_every_entry_point_is_listed():
    found = set()
    for rel, text in _sources():
        if rel in WRAPPERS:
            continue
        if re.search(r"^if __name__ == .__main__.:", text, re.M) or re.search(r"^def main\(argv", text, re.M):
            found.add(rel)
    assert found == set(ENTRY_POINTS) - {r for r in ENTRY_POINTS if not (ROOT / r).is_file()}, \
        "list every entry point (and the shared flags it takes) in ENTRY_POINTS"
    assert len(ENTRY_POINTS) >= 30


def test_every_entry_point_runs_as_a_script():
    """An entry point with `def main(argv` also calls it when run (`python -m pkg.mod`, `python path.py`): a module
    without the `__main__` guard runs nothing at all, silently, and exits 0."""
    silent = [rel for rel in ENTRY_POINTS if (ROOT / rel).is_file()
              and not re.search(r"^if __name__ == .__main__.:", (ROOT / rel).read_text(), re.M)]
    assert not silent, f"no `if __name__ == '__main__'` in {silent}"


@pytest.mark.parametrize("rel", sorted(WRAPPERS))
def test_wrappers_call_their_entry_point(rel):
    text = (ROOT / rel).read_text()
    assert f"from {WRAPPERS[rel]} import main" in text and "main()" in text


@pytest.mark.parametrize("rel", sorted(ENTRY_POINTS))
def test_help_lists_the_shared_flags_in_the_shared_words(rel, capsys, monkeypatch):
    entries = _entries(_help(rel, capsys, monkeypatch))
    shared = {name for name in entries if name in SHARED_HELP or name in POSITIONAL}
    assert shared == ENTRY_POINTS[rel], f"{rel}: shared flags {sorted(shared)}"
    for name in shared:
        flag, help_ = POSITIONAL.get(name, name), entries[name]
        assert help_.startswith(_shared_words(flag)), f"{rel} {name}: {help_!r}"
        if flag == "--seed":
            assert help_.startswith(f"random seed, 0..{MAX_SEED}, of ")
        if flag == "--threads":
            assert help_.startswith(f"torch CPU threads, 0..{MAX_THREADS} ")
        if flag == "--out":
            assert re.match(r"output (directory|file)\b", help_), f"{rel}: {help_!r}"


@pytest.mark.parametrize("rel", sorted(r for r, flags in ENTRY_POINTS.items() if "--seed" in flags))
@pytest.mark.parametrize("value", [str(MAX_SEED + 1), "-1"])
def test_a_seed_out_of_bounds_is_the_same_one_line_everywhere(rel, value, capsys):
    mod = _load(rel)
    with pytest.raises(SystemExit) as e:
        mod.main(["--seed", value])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: argument --seed: must be an integer in 0..{MAX_SEED}, got {value}\n", rel
    assert captured.out == ""


def test_no_module_builds_its_own_parser_or_reads_argv():
    for rel, text in _sources():
        if rel == "common/cli.py":
            continue
        code = "\n".join(line.split("#")[0] for line in text.splitlines())
        assert not re.search(r"\bArgumentParser\(", code), f"{rel}: build the parser with common.cli.Parser"
        assert "sys.argv" not in code, f"{rel}: parse argv with common.cli.Parser (command_text records it)"


# ----- the toolkit itself -------------------------------------------------------------------------------------
def test_the_seed_bound_fits_every_consumer():
    assert MAX_SEED == 2**32 - 1  # numpy's RandomState (scikit-learn's random_state) takes 0..2**32-1
    np.random.RandomState(MAX_SEED)
    for offset in (1, 2, 3, 1000, 1000 + 9):
        s = derived_seed(MAX_SEED, offset)
        assert 0 <= s <= MAX_SEED
        np.random.RandomState(s)
        assert derived_seed(7, offset) == 7 + offset  # the seeds that fitted before draw the same streams


def test_shared_flags_keep_their_words_under_the_defaults_formatter(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")
    p = Parser(prog="x", formatter_class=DefaultsFormatter)
    add_seed_flag(p, "the data")
    p.add_argument("--n", type=int, default=3, help="a size")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = p.format_help()
    e = _entries(text)
    assert e["--seed"] == f"random seed, 0..{MAX_SEED}, of the data (default 0)"
    assert e["--n"] == "a size (default: 3)" and e["--flag"] == "a switch"


def test_no_progress_silences_hugging_face_loading_bars(monkeypatch):
    """transformers 5 draws a "Loading weights" bar of its own: --no-progress turns it off when it is parsed."""
    import os

    from transformers.utils import logging as hf_logging

    from common.cli import Parser, add_progress_flag

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        p = Parser(prog="x")
        add_progress_flag(p)
        assert p.parse_args([]).no_progress is False and hf_logging.is_progress_bar_enabled()
        assert p.parse_args(["--no-progress"]).no_progress is True
        assert not hf_logging.is_progress_bar_enabled() and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
