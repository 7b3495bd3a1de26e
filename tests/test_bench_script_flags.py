"""benchmarks/ and scripts/ keep the shared CLI rules (docs/usage.md, "Shared behaviour"; common.cli): every flag has
help text, every numeric flag is bounded with common.cli.int_in / float_in and its --help states the range in the
words its refusal uses, and a bad value is one `error:` line on stderr and exit code 2 before anything loads or is
written, never a traceback. Nothing here loads a model or runs a benchmark: the parsers are caught in-process at
their parse_args, and the refusals run as processes that stop at parsing."""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.cli import Parser
from test_cli_toolkit import ROOT, _help, _load

# Every benchmark and script that builds a command-line parser (benchmarks/torchrun_launch.py is a helper).
FILES = sorted(p.relative_to(ROOT).as_posix() for folder in ("benchmarks", "scripts")
               for p in (ROOT / folder).glob("*.py") if "Parser(" in p.read_text())


class _Caught(Exception):
    """Raised in place of parsing: the parser has been built, nothing has run."""


def _parser(rel: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `rel`'s main builds, caught at its parse_args."""
    caught = []

    def grab(self, args=None, namespace=None):
        caught.append(self)
        raise _Caught

    monkeypatch.setattr(Parser, "parse_args", grab)
    mod = _load(rel)
    with pytest.raises(_Caught):
        mod.main([])
    return caught[0]


def _bounded(action) -> str | None:
    """'int' / 'float' for an action typed with common.cli.int_in / float_in, else None."""
    name = getattr(action.type, "__qualname__", "")
    return {"int_in.<locals>.parse": "int", "float_in.<locals>.parse": "float"}.get(name)


def _range_words(action) -> str:
    """The range as `--help` must state it: the words of the refusal ('1..5000', '(0, 1)')."""
    env = inspect.getclosurevars(action.type).nonlocals
    if _bounded(action) == "int":
        return f">= {env['lo']}" if env["hi"] is None else f"{env['lo']}..{env['hi']}"
    return env["text"]()


def test_the_files_are_found():
    assert {"benchmarks/probes.py", "benchmarks/cold_step.py", "scripts/first_line_rows.py"} <= set(FILES)
    assert "benchmarks/torchrun_launch.py" not in FILES and len(FILES) >= 20


@pytest.mark.parametrize("rel", FILES)
def test_help_exits_0_and_every_option_says_what_it_is(rel, capsys, monkeypatch):
    assert "usage:" in _help(rel, capsys, monkeypatch)
    p = _parser(rel, monkeypatch)
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in p._actions
               if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert not missing, f"{rel}: no help text for {missing}"


@pytest.mark.parametrize("rel", FILES)
def test_every_numeric_flag_is_bounded_and_its_help_states_the_range(rel, monkeypatch):
    p = _parser(rel, monkeypatch)
    for a in p._actions:
        name = a.option_strings[0] if a.option_strings else a.dest
        assert a.type not in (int, float), f"{rel} {name}: use common.cli.int_in / float_in with bounds"
        if not _bounded(a) or a.help == argparse.SUPPRESS:
            continue
        words = _range_words(a)
        assert words in a.help, f"{rel} {name}: --help does not state its range {words!r}: {a.help!r}"
        if a.default not in (None, argparse.SUPPRESS):
            a.type(str(a.default))  # every default is inside its own range


# Bad values: (file, arguments). The positional MODEL / TASK of the scripts are never reached: the bad value is
# refused first.
BAD = [
    ("benchmarks/probes.py", ["--d-model", "-1"]),
    ("benchmarks/probes.py", ["--n-pairs", "-1"]),
    ("benchmarks/probes.py", ["--depths", "0"]),
    ("benchmarks/probes.py", ["--classes", "1"]),
    ("benchmarks/probes.py", ["--tight-tol", "nan"]),
    ("benchmarks/probes.py", ["--classes", "3", "--d-model", "2"]),
    ("benchmarks/cold_step.py", ["--gap-ms", "nan"]),
    ("benchmarks/collect_processes.py", ["--n-pairs", "-1"]),
    ("benchmarks/collect_processes.py", ["--distractors", "-1"]),
    ("benchmarks/collect_processes.py", ["--batch-size", "0"]),
    ("benchmarks/collect_processes.py", ["--repeats", "0"]),
    ("benchmarks/collect_processes.py", ["--timeout", "-5"]),
    ("benchmarks/collect.py", ["--batch", "3"]),  # pairs: 3 would run 2 rows
    ("benchmarks/patching.py", ["--n-pairs", "-1"]),
    ("benchmarks/patching.py", ["--positions", "0"]),
    ("benchmarks/interventions.py", ["--n-pairs", "abc"]),
    ("benchmarks/interventions.py", ["--max-positions", "-1"]),
    ("benchmarks/attribution.py", ["--n-pairs", "5"]),
    ("benchmarks/fixed_point.py", ["--tol", "inf"]),
    ("benchmarks/prefill.py", ["--d-model", "6", "--heads", "2"]),
    ("benchmarks/prefill.py", ["--short", "256", "--long", "256"]),  # equal lengths would share their JSON keys
    ("benchmarks/prefill.py", ["--window-short", "1024", "--window-long", "1024"]),
    ("benchmarks/probes_run.py", ["--repeats", "0"]),
    ("benchmarks/probes_run.py", ["--warmup", "-1"]),
    ("benchmarks/recirculation.py", ["--new-tokens", "1"]),
    ("benchmarks/train.py", ["--length", "1"]),
    ("benchmarks/train_ddp.py", ["--first-step", "-1"]),
    ("benchmarks/train_ddp.py", ["--timeout", "0"]),
    ("benchmarks/decode.py", ["--smol-layers", "0"]),
    ("scripts/first_line_rows.py", ["m", "t", "8", "-1"]),
    ("scripts/permutation_probe.py", ["s5", "--batch-size", "0"]),
    ("scripts/probe_direction.py", ["parity", "--n-pairs", "1"]),
    ("scripts/stress_tracking.py", ["parity", "--samples", "0"]),
    ("scripts/heldout_cells.py", ["parity", "--per-cell", "0"]),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """{case: (completed process, its working directory)}, the cases run a few at a time (each imports torch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(case, cwd):
        rel, args = case
        try:
            return subprocess.run([sys.executable, str(ROOT / rel), *args], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=60), cwd
        except subprocess.TimeoutExpired:  # this case fails alone, the others still report
            return None, cwd

    # The folders are made here, not in the threads: the factory is not thread-safe, and under pytest-xdist its
    # first call empties the worker's base folder, so two first calls at once deleted each other's folders.
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {(rel, tuple(args)): pool.submit(run, (rel, args), tmp_path_factory.mktemp("refusal"))
                   for rel, args in BAD}
        yield {case: f.result() for case, f in futures.items()}


@pytest.mark.parametrize("rel,args", BAD, ids=[f"{r.split('/')[1]} {' '.join(a)}" for r, a in BAD])
def test_a_bad_value_is_one_error_line_and_exit_2(rel, args, refusals):
    r, cwd = refusals[(rel, tuple(args))]
    assert r is not None, f"{rel} {args}: still running after 60 s (it went past parsing)"
    assert "Traceback" not in r.stderr, f"{rel} {args}:\n{r.stderr[-2000:]}"
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), \
        f"{rel} {args}: exit {r.returncode}, stderr {r.stderr[-2000:]!r}"
    assert r.stdout == ""
    assert not list(cwd.iterdir()), f"{rel} {args} wrote {list(cwd.iterdir())}"
