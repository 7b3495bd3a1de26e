"""Ctrl-C in a CLI's first seconds, while its module imports torch and transformers (before `cli_entry` runs), is
one line, 'interrupted', exit 130, as it is later (common.errors.quiet_import_interrupts); importing the packages
as a library changes no hook. The interrupt is injected at `import torch` by a sitecustomize of the test's own."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import _dash_m_module

ROOT = Path(__file__).resolve().parents[1]

# raises what FBPROBE_TEST_RAISE names when `torch` is first imported, from inside the import system
SITECUSTOMIZE = '''
import os, sys
class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        how = os.environ["FBPROBE_TEST_RAISE"]
        if how == "pass":  # torch imports as usual
            return None
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "wrapped":  # a library that turns the interrupt into an import error
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise ImportError("could not import torch")
        raise ImportError("a genuine import failure")
sys.meta_path.insert(0, _Finder())
'''

ENTRIES = ["analysis.evaluate", "probes.run", "interventions.run", "training.train",
           "analysis.recirculation"]


def _run(tmp_path, how, *argv):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "FBPROBE_TEST_RAISE": how, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_interrupt_while_a_cli_imports_is_one_line(tmp_path, entry):
    r = _run(tmp_path, "interrupt", "-m", entry, "--help")
    assert r.stderr == "interrupted\n", r.stderr[-2000:]
    assert r.returncode in (130, -signal.SIGINT)


def test_an_interrupt_a_library_re_raised_as_an_import_error_is_one_line(tmp_path):
    r = _run(tmp_path, "wrapped", "-X", "utf8", "-m", "analysis.evaluate", "--help")
    assert r.stderr == "interrupted\n", r.stderr[-2000:]
    assert r.returncode == 130


def test_a_genuine_import_error_keeps_its_traceback(tmp_path):
    r = _run(tmp_path, "other", "-m", "analysis.evaluate", "--help")
    assert "Traceback" in r.stderr and "a genuine import failure" in r.stderr and r.returncode == 1


def test_importing_the_packages_as_a_library_leaves_the_hook_alone(tmp_path):
    r = _run(tmp_path, "none", "-c", "import sys, analysis, probes, interventions, training; "
                                     "print(sys.excepthook is sys.__excepthook__)")
    assert r.stdout.strip() == "True", r.stderr[-2000:]


@pytest.mark.parametrize("argv, module", [
    (["python", "-m", "analysis.evaluate", "--help"], "analysis.evaluate"),
    (["python", "-manalysis.demo"], "analysis.demo"),
    (["python", "-X", "importtime", "-W", "ignore", "-u", "-m", "probes.run"], "probes.run"),
    (["python", "-c", "import x", "-m", "probes.run"], None),
    (["python", "script.py", "-m", "probes.run"], None),
    (["python", "-"], None),
    # short options cluster as CPython reads them (`python -um training.train` was a library import to the hook)
    (["python", "-um", "training.train"], "training.train"),
    (["python", "-uBmprobes.run"], "probes.run"),
    (["python", "-bb", "-P", "-Xdev", "-Wd", "-m", "probes.run"], "probes.run"),
    (["python", "--check-hash-based-pycs", "always", "-m", "probes.run"], "probes.run"),
    (["python", "-E", "-s", "-I", "-O", "-B", "-u", "-q", "-X", "dev", "-W", "error::DeprecationWarning", "-m",
      "probes.run"], "probes.run"),
    (["python", "-uW", "-m", "-m", "probes.run"], "probes.run"),  # -W's value is "-m"
    (["python", "-uc", "import x", "-m", "probes.run"], None),
    (["python", "--", "-m", "probes.run"], None),
    (["python", "-m"], None),
    (["python"], None),
])
def test_the_module_of_a_command_line(argv, module):
    assert _dash_m_module(argv) == module


def test_a_cleanup_bug_raised_while_an_interrupt_unwinds_keeps_its_traceback(tmp_path):
    """The import-time hook outlived the imports: once the entry point ran, a bug in a cleanup that an interrupt
    set off (an error raised while the KeyboardInterrupt unwound) was 'interrupted', exit 130, its traceback lost
    and atexit's cleanups skipped (os._exit). cli_entry reports interrupts from then on; the bug is a traceback."""
    pkg = tmp_path / "fbxpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from common.errors import quiet_import_interrupts\n"
                                     "quiet_import_interrupts(__name__)\n")
    (pkg / "cli.py").write_text(
        "import atexit, sys\n"
        "import torch\n"
        "from common.errors import cli_entry\n"
        "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
        "@cli_entry\n"
        "def main(argv=None):\n"
        "    try:\n"
        "        raise KeyboardInterrupt\n"
        "    except KeyboardInterrupt:\n"
        "        {}['a cleanup bug']\n"
        "main()\n")
    r = _run(tmp_path, "pass", "-m", "fbxpkg.cli")
    assert "KeyError: 'a cleanup bug'" in r.stderr and "atexit ran" in r.stderr, r.stderr[-2000:]
    assert "interrupted" not in r.stderr and r.returncode == 1
    r = _run(tmp_path, "interrupt", "-m", "fbxpkg.cli")  # still one line while the imports run
    assert r.stderr == "interrupted\n", r.stderr[-2000:]
