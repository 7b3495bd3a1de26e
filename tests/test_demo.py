"""analysis.demo: the verdict rule on hand-made numbers (both verdicts, and the runs that meet neither), and the
whole path (two probes.run, two interventions.run, one page) on small studies of the shipped models."""
from __future__ import annotations

import json
import re

import pytest


def _k(probe_fb=(1.0, 1.0), probe_std=(0.5, 0.5), acc=(1.0, 1.0), ne=(0.0, 0.0), bypass_all=(1.0, 1.0), chance=0.5):
    x = lambda ci: {"value": (ci[0] + ci[1]) / 2, "ci": list(ci), "n": 100}
    return {"probe_depth0_feedback": x(probe_fb), "probe_depth0_standard": x(probe_std), "accuracy_feedback": x(acc),
            "swap_normalized_effect": x(ne), "bypass_all_accuracy": x(bypass_all), "chance": chance}


def test_judge_reads_each_verdict_from_its_numbers():
    from analysis.demo import judge

    assert judge(_k())[0] == "decodable, not used"
    assert judge(_k(ne=(0.97, 1.0), bypass_all=(0.45, 0.6)))[0] == "necessary and used"
    # a swap that moves the answer halfway is neither "used" nor "not used"
    assert judge(_k(ne=(0.2, 0.4)))[0] == "neither rule holds"
    # used, but the model answers without its fed inputs: not "necessary"
    assert judge(_k(ne=(0.97, 1.0), bypass_all=(0.9, 1.0)))[0] == "neither rule holds"
    # not decodable: the standard probe already reads it (leakage), so "decodable" says nothing
    assert judge(_k(probe_std=(0.8, 0.9)))[0] == "neither rule holds"
    assert judge(_k(acc=(0.4, 0.6)))[0].startswith("neither: the model does not solve the task")
    # a 3-way label: chance 1/3
    assert judge(_k(ne=(0.9, 1.0), bypass_all=(0.3, 0.45), chance=1 / 3))[0] == "necessary and used"


def test_judge_never_contradicts_the_report_printed_beside_it():
    """A normalized effect of 0.075 [0.06, 0.09] is "not used" by the CI rule and "partly used" by the causal
    report's; 0.51 [0.69, 2.65] (a CI that misses its estimate) is "used" by one and "inconclusive" by the other.
    The page printed both: the demo's verdict needs the report's to agree."""
    from analysis.demo import judge

    assert judge(_k(ne=(0.06, 0.09)), "partly used")[0] == "neither rule holds"
    assert judge(_k(ne=(0.06, 0.09)), "not detectably used")[0] == "decodable, not used"
    used = _k(ne=(0.69, 2.65), bypass_all=(0.45, 0.6))
    assert judge(used, "inconclusive (the effect's bootstrap CI does not contain its estimate)")[0] == \
        "neither rule holds"
    assert judge(used, "causally used")[0] == "necessary and used"


def test_the_intro_says_the_verdicts_found():
    from analysis.demo import STUDIES, found_verdicts

    a, b = STUDIES[0].claim, STUDIES[1].claim
    assert found_verdicts(STUDIES, [a, b]) == f"give opposite verdicts: {a}, and {b}"
    assert found_verdicts(STUDIES, [b, a]) == f"give opposite verdicts: {b}, and {a}"  # swapped, still opposite
    assert found_verdicts(STUDIES, [a, a]) == f"give these verdicts: {STUDIES[0].model}: {a}; {STUDIES[1].model}: {a}"
    assert "opposite" not in found_verdicts(STUDIES, [a, "neither rule holds"])


def test_demo_end_to_end_on_small_studies(tmp_path, monkeypatch, capsys):
    import analysis.demo as demo

    small = tuple(demo.Study(s.key, s.title, s.model, s.task, s.mode, n, 12, 10, s.claim)
                  for s, n in zip(demo.STUDIES, (8, 8)))
    monkeypatch.setattr(demo, "STUDIES", small)
    out = tmp_path / "demo"
    assert demo.main(["--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert said.count(f"wrote {out}/") == 9 and ".tmp" not in said  # the studies' lines under final names, the page
    page = (out / "index.html").read_text()
    for st in small:
        rep = json.loads((out / st.key / "causal_report.json").read_text())
        assert rep["config"]["budget"] == "quick" and rep["dataset"]["n_pairs"] == 10
        assert f"<code>{st.model}</code> on {st.task}" in page
        assert f"python -m interventions.run --task {st.task} --model {st.model}" in page  # the commands
        assert f"--out {out / st.key}" in page and ".tmp" not in page  # with the folder the results end in
        assert rep["config"]["command"].startswith(f"python -m interventions.run --task {st.task}") and \
            f"--out {out / st.key} " in rep["config"]["command"]
    # both verdicts, from the numbers of these runs
    assert "Verdict from the numbers: <b>decodable, not used</b>" in page
    assert "Verdict from the numbers: <b>necessary and used</b>" in page
    assert "give opposite verdicts: decodable, not used, and necessary and used" in page  # computed, not typed in
    assert re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", page) == ["plotly.min.js"] and (out / "plotly.min.js").is_file()
    # an earlier demo is never replaced silently
    with pytest.raises(SystemExit) as e:
        demo.main(["--out", str(out), "--no-progress"])
    assert e.value.code == 2
    # a demo stopped midway (here: in its second study's battery) leaves the earlier one whole, and no temporary
    import interventions.run as irun

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    calls, real = [], irun.main

    def stopped_in_the_second(argv=None):
        calls.append(argv)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(argv)

    monkeypatch.setattr(irun, "main", stopped_in_the_second)
    stale = out / ".parity.k1ll3d.tmp"  # a study folder a demo killed earlier (SIGKILL) left behind
    stale.mkdir()
    (stale / "probes.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        demo.main(["--out", str(out), "--no-progress", "--overwrite"])
    assert e.value.code == 130 and len(calls) == 2
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # the stale folder is gone too


def test_a_study_folder_of_other_files_is_not_replaced_without_overwrite(tmp_path):
    """The demo replaces its study folders whole: one holding anything (not only an earlier demo's files) needs
    --overwrite. A folder with the user's notes in memory/ was deleted by a run without it."""
    import analysis.demo as demo

    out = tmp_path / "demo"
    (out / demo.STUDIES[0].key).mkdir(parents=True)
    notes = out / demo.STUDIES[0].key / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(SystemExit) as e:
        demo.main(["--out", str(out), "--no-progress"])
    assert e.value.code == 2 and notes.read_text() == "mine"
