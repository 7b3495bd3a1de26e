"""docs/tasks.md holds: its JSONL file and generator run as written, its commands succeed, and its vocabulary
lists are the tokenizers' vocabularies (the task tokenizer and every checkpoints/*/tokenizer.json)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "tasks.md"
TEXT = DOC.read_text()
SPECIAL = {"[PAD]", "[UNK]"}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```\n", TEXT, flags=re.S | re.M)


def commands() -> list[list[str]]:
    """Every `python -m MODULE ...` line of the doc's bash blocks, without its trailing comment."""
    out = []
    for b in blocks("bash"):
        for line in b.splitlines():
            if line.startswith("python -m "):
                out.append(shlex.split(line.split("#")[0])[2:])
    return out


def _task_vocab_script():
    spec = importlib.util.spec_from_file_location("task_vocab", ROOT / "scripts" / "task_vocab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def checkpoint_tokenizers() -> dict[str, Path]:
    return {d.name: d for d in sorted((ROOT / "checkpoints").iterdir()) if (d / "tokenizer.json").is_file()}


def _tokenizer(d: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(d))


# ----- the examples ------------------------------------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The doc's files written into a fresh current directory (importable, as a user's would be)."""
    [jsonl] = blocks("jsonl")
    [module] = blocks("python")
    m = re.match(r"# (\w+)\.py\s", module)
    assert m, "the generator example starts with '# <module>.py'"
    (tmp_path / "last_write.jsonl").write_text(jsonl)
    (tmp_path / f"{m.group(1)}.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, m.group(1), raising=False)
    yield tmp_path
    sys.modules.pop(m.group(1), None)


def test_the_doc_names_its_files_and_commands():
    cmds = commands()
    assert ["probes.run", "--task", "last_write.jsonl", "--model", "tiny-fbt"] in cmds
    assert any(c[0] == "analysis.evaluate" and "my_tasks:first_bit" in c for c in cmds)
    assert any(c[0] == "probes.run" and "my_tasks:first_bit" in c for c in cmds)
    assert "not wired" not in TEXT and "once it\nis wired" not in TEXT


def test_examples_validate_under_every_shipped_tokenizer(workdir):
    from tasks.custom import resolve_task
    from tasks.tokenizer import build_tokenizer

    jsonl = resolve_task("last_write.jsonl")
    gen = resolve_task("my_tasks:first_bit")
    assert jsonl.name == "last_write" and jsonl.label_words == ("0", "1")
    assert gen.name == "first_bit" and gen.default_distractors == (2, 8)
    toks = {"task tokenizer": build_tokenizer(), **{n: _tokenizer(d) for n, d in checkpoint_tokenizers().items()}}
    for name, tok in toks.items():
        for src, n in ((jsonl, 0), (gen, 2), (gen, 8)):
            samples = src.make(None if src.fixed else 5, n, 0)
            ids, samples = src.tokenize(samples, tok)  # known words, one shared final token
            assert len(set(src.label_token_ids(tok, prompt=samples[0].text))) == 2, name


def _run(argv, capsys):
    mod = importlib.import_module(argv[0])
    extra = {"probes.run": ["--no-cache", "--no-progress"], "analysis.evaluate": ["--no-progress"]}[argv[0]]
    assert mod.main(argv[1:] + extra) in (0, None)
    return capsys.readouterr().out


def test_jsonl_command_runs_as_written(workdir, capsys):
    [cmd] = [c for c in commands() if "last_write.jsonl" in c]
    out = _run(cmd, capsys)
    folder = workdir / "figures" / "tiny-fbt" / "last_write"  # the default output, under the current directory
    doc = json.loads((folder / "probes.json").read_text())
    assert {r["task"] for r in doc["results"]} == {"last_write"} and "wrote" in out
    assert doc["meta"]["labels"]["words"] == ["0", "1"]
    assert (folder / "depth_curves.html").is_file() and (folder / "plotly.min.js").is_file()


def test_generator_commands_run_as_written(workdir, capsys):
    cmds = [c for c in commands() if "my_tasks:first_bit" in c]
    assert len(cmds) == 2
    for cmd in cmds:
        _run(cmd, capsys)
    ev = json.loads((workdir / "figures" / "tiny-fbt" / "eval.json").read_text())
    assert {(r["task"], r["n_distractors"]) for r in ev["results"]} == {("first_bit", 2), ("first_bit", 8)}
    probes = json.loads((workdir / "figures" / "tiny-fbt" / "first_bit" / "probes.json").read_text())
    assert {r["n_distractors"] for r in probes["results"]} == {8}


# ----- the vocabulary lists ----------------------------------------------------------------------------------
def doc_vocabularies() -> list[tuple[list[str], list[str], str]]:
    """[(checkpoint names, words)] of the doc's generated section, read back from the markdown."""
    tv = _task_vocab_script()
    section = tv.doc_section(TEXT)
    assert section is not None, "docs/tasks.md lost its generated vocabulary section"
    paras = [p.strip() for p in section.split("\n\n")[1:-1]]
    assert len(paras) % 2 == 0
    out = []
    for head, words in zip(paras[::2], paras[1::2]):
        names = re.findall(r"`checkpoints/([\w.-]+)`", head)
        toks = ["\n" if w == "\\n" else w for w in re.findall(r"`([^`]+)`", words)]
        out.append((names, toks, head))
    return out


def test_vocabulary_lists_are_the_tokenizers_vocabularies():
    from tasks.tokenizer import build_tokenizer

    groups = doc_vocabularies()
    task_vocab = build_tokenizer().get_vocab()
    names, words, head = groups[0]
    assert head.startswith("**The task tokenizer**")
    assert words == [t for t, _ in sorted(task_vocab.items(), key=lambda kv: kv[1]) if t not in SPECIAL]
    listed = [n for ns, _, _ in groups for n in ns]
    shipped = checkpoint_tokenizers()
    assert sorted(listed) == sorted(shipped), "every checkpoint named once"
    for ns, words, _ in groups:
        for n in ns:
            vocab = json.loads((shipped[n] / "tokenizer.json").read_text())["model"]["vocab"]
            assert words == [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIAL], n
            assert SPECIAL <= set(vocab)
    # tiny-fbt-track predates `cycle` (s5 / a5); the shipped probing models predate the tracking words
    assert "tiny-fbt-track" in listed and "tiny-fbt" in [n for ns, _, _ in groups[1:] for n in ns]


def test_vocabulary_section_is_what_the_script_writes():
    tv = _task_vocab_script()
    assert tv.doc_section(TEXT) == tv.section()
    assert tv.main(["--check"]) == 0
