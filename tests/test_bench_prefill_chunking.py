"""benchmarks/prefill.py section 5 at a --window-long where prefill_many does not chunk (up to 2 x 512 columns):
it says so and reports no speed-up, instead of timing the one full pass against itself. Tiny sizes: seconds."""
from __future__ import annotations

import json

from test_cli_toolkit import ROOT, _load


def test_no_chunking_at_a_short_window_long(capsys):
    mod = _load("benchmarks/prefill.py")
    mod.main(["--threads", "1", "--short", "8", "--long", "16", "--repeats", "1", "--overhead-repeats", "1",
              "--naive-samples", "2", "--window-model", str(ROOT / "checkpoints" / "tiny-fbt-track"),
              "--window-short", "64", "--window-long", "128", "--window-batch", "1", "--window-repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert any("standard pass T=128: no chunking at this length" in line for line in lines)
    window = json.loads(lines[-1])["window"]
    assert window["standard_chunked"] is False and window["standard_full_over_chunked"] is None
