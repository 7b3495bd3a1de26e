"""Bad inputs that used to get through (issue 37, item 6): each is one `error:` line (exit 2) before anything is
written, or correct behaviour.

1. user JSON (task files, checkpoint configs, training logs): huge integers, deep nesting, NaN, raw U+2028;
2. module:function tasks: sys.exit, hangs, fields of the wrong type, and their code imported only after every
   other argument is checked;
3. checkpoint configs and weights that make a NaN or blind model (full-bandwidth and plain HF);
4. no command writes into a model's folder;
5. training: heads that do not divide, and a kill during a checkpoint save.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import uuid
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from common.jsonio import loads_user, split_jsonl


def _one_line(e) -> str:
    msg = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in msg and msg, msg
    return msg


def _cli_refused(main, argv, capsys, needle) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
    return err


# ----- 1. user JSON ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, needle", [
    ("1" * 5000, "an integer of 5000 digits"),
    ('{"a": [' + "9" * 200 + "]}", "an integer of 200 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    ("[" * 150 + "]" * 150, "nested deeper than"),  # parses, but deeper than any real file
    ('{"x": NaN}', "NaN is not a JSON number"),
    ('{"x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"x": 1e999}', "out of range"),
    ('{"x": "\\ud800"}', "lone surrogate"),
    ('{"x": 1,}', "not valid JSON"),
    ('{"text": "x", "label": 0, "label": 1}', "key 'label' appears twice"),  # else the last would win, silently
    ('[{"a": {"b": 1, "b": 1}}]', "key 'b' appears twice"),
])
def test_loads_user_refuses_in_one_line(text, needle):
    with pytest.raises(UserError) as e:
        loads_user(text, "f.json")
    msg = _one_line(e)
    assert msg.startswith("f.json: ") and needle in msg, msg


def test_loads_user_reads_plain_json():
    assert loads_user('{"a": [1, 2.5, "x\u2028y", null, true], "b": -' + "9" * 100 + "}", "w") == {
        "a": [1, 2.5, "x\u2028y", None, True], "b": -int("9" * 100)}
    assert loads_user(b'{"a": 1}', "w") == {"a": 1}
    with pytest.raises(UserError, match="not UTF-8"):
        loads_user(b'{"a": "\xff"}', "w")


def test_split_jsonl_splits_on_newline_only():
    assert split_jsonl('a\u2028b\r\n\n  \nc\x85d\n') == [(1, "a\u2028b"), (4, "c\x85d")]


HEADER = {"label_words": ["0", "1"], "name": "sep"}


def _rows(*texts):
    return [HEADER] + [{"text": t, "label": i % 2, "pair": i // 2, "group": i // 2} for i, t in enumerate(texts)]


def test_jsonl_line_with_a_raw_line_separator_is_valid(tmp_path):
    from tasks import resolve_task

    p = tmp_path / "sep.jsonl"
    # ensure_ascii=False writes U+2028 raw: valid JSON, and one line of the file
    p.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in _rows("a\u2028b :", "a\u2028c :")) + "\r\n",
                 encoding="utf-8")
    samples = resolve_task(str(p)).make(None, 0, 0)
    assert [s.text for s in samples] == ["a\u2028b :", "a\u2028c :"]


@pytest.mark.parametrize("line, needle", [
    ('{"text": "x :", "label": 1' + "0" * 5000 + ', "pair": 0, "group": 0}', "line 3: an integer of 5001 digits"),
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 3: nested deeper than"),
    ('{"text": "x :", "label": NaN, "pair": 0, "group": 0}', "line 3: NaN is not a JSON number"),
])
def test_jsonl_huge_or_deep_values_are_one_line(tmp_path, line, needle):
    from tasks import resolve_task

    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(HEADER) + "\n" + json.dumps(_rows("a :")[1]) + "\n" + line + "\n")
    with pytest.raises(UserError) as e:
        resolve_task(str(p))
    assert needle in _one_line(e)


# ----- tiny models ------------------------------------------------------------------------------------------
def _save_fbt(path: Path, **kw) -> Path:
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok), n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, attn_window=8,
                       initializer_range=0.1, **kw)
    FullBandwidthLM.from_config(cfg, seed=0).eval().save_pretrained(path, tokenizer=tok)
    return path


def _save_hf(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"fbt": _save_fbt(root / "fbt"), "hf": _save_hf(root / "hf")}


@pytest.fixture
def fbt(pristine, tmp_path):
    return Path(shutil.copytree(pristine["fbt"], tmp_path / "fbt"))


@pytest.fixture
def hf(pristine, tmp_path):
    return Path(shutil.copytree(pristine["hf"], tmp_path / "hf"))


def _edit_json(path: Path, fn) -> None:
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def _load_refused(path, *needles) -> str:
    from models.loading import load_model

    with pytest.raises(UserError) as e:
        load_model(str(path))
    msg = _one_line(e)
    for n in needles:
        assert n in msg, msg
    return msg


def test_pristine_models_load(fbt, hf):
    from models.loading import load_model

    assert load_model(str(fbt))[0].has_fusion and not load_model(str(hf))[0].has_fusion


@pytest.mark.parametrize("kind", ["fbt", "hf"])
@pytest.mark.parametrize("text, needle", [
    ('{"format": "full-bandwidth-lm", "n": ' + "7" * 5000 + "}", "an integer of 5000 digits"),
    ('{"format": "full-bandwidth-lm", "n": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than"),
    ('{"format": "full-bandwidth-lm", "n": NaN}', "NaN is not a JSON number"),
])
def test_checkpoint_config_json_huge_or_deep(kind, text, needle, fbt, hf):
    path = fbt if kind == "fbt" else hf
    (path / "config.json").write_text(text if kind == "fbt" else text.replace('"full-bandwidth-lm"', '"llama"'))
    _load_refused(path, "config.json", needle)


# ----- 3. configs and weights that make a NaN or blind model ------------------------------------------------
def _rope(cfg):
    return cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})


BAD_CONFIGS = {
    "rope_theta 0": (lambda c: _rope(c).update(rope_theta=0), "rope_parameters.rope_theta must be a finite number > 0"),
    "rms_norm_eps < 0": (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite number > 0"),
    # Mistral (Llama's weights) windows every layer; a Llama ignores the key (tested below)
    "window 0": (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=0),
                 "sliding_window must be an integer >= 1"),
    "window < 0": (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=-4),
                   "sliding_window must be"),
    "kv heads": (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads 3 does not divide"),
    "positions 0": (lambda c: c.update(max_position_embeddings=0),
                    "max_position_embeddings must be a positive integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_full_bandwidth_config_is_refused(fbt, case):
    edit, needle = BAD_CONFIGS[case]
    _edit_json(fbt / "config.json", lambda c: edit(c["base_config"]))
    _load_refused(fbt, needle)


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_hf_config_is_refused(hf, case):
    edit, needle = BAD_CONFIGS[case]
    _edit_json(hf / "config.json", edit)
    _load_refused(hf, needle)


@pytest.mark.parametrize("model_type", ["nonexistent", "bloom"])
def test_a_checkpoint_of_an_unsupported_family_is_named_so(fbt, model_type):
    """A full-bandwidth checkpoint names its base family before HF builds its config: the supported-families line,
    not HF's "Unrecognized model identifier" list or a config validation error."""
    _edit_json(fbt / "config.json", lambda c: c["base_config"].update(model_type=model_type))
    _load_refused(fbt, f"unsupported model family (model_type '{model_type}')", "supported are llama")


def test_a_window_no_layer_applies_is_not_checked(hf):
    """A Llama ignores `sliding_window`, and Qwen2-MoE's config writes 0 there when no layer slides: such a value
    makes no blind model, so it loads (the same value under Mistral is refused above)."""
    from models.loading import load_model

    _edit_json(hf / "config.json", lambda c: c.update(sliding_window=0))
    assert load_model(str(hf))[0].config.sliding_window == 0


@pytest.mark.parametrize("kind", ["fbt", "hf"])
def test_integer_weights_are_refused(kind, fbt, hf):
    from safetensors.torch import load_file, save_file

    path = fbt if kind == "fbt" else hf
    sd = load_file(str(path / "model.safetensors"))
    save_file({k: (v * 100).to(torch.int32) for k, v in sd.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    _load_refused(path, "non-floating type")


def test_check_config_needs_heads_that_split_the_width():
    from transformers import GPT2Config

    from models.configs import check_config

    with pytest.raises(UserError, match="num_attention_heads 4 does not divide hidden_size 30"):
        check_config(GPT2Config(n_embd=30, n_head=4), "x")
    check_config(GPT2Config(n_embd=32, n_head=4), "x")


def test_evaluate_refuses_a_nan_config_before_writing(fbt, tmp_path, capsys):
    from analysis.evaluate import main

    _edit_json(fbt / "config.json", lambda c: _rope(c["base_config"]).update(rope_theta=0))
    out = tmp_path / "eval.json"
    _cli_refused(main, ["--model", str(fbt), "--tasks", "completion", "--distractors", "0", "--n-pairs", "2",
                        "--out", str(out), "--no-progress"], capsys, "rope_theta must be a finite number > 0")
    assert not out.exists()


# ----- 4. never into a model's folder ---------------------------------------------------------------------------
def test_evaluate_never_overwrites_a_checkpoint_config(fbt, capsys):
    from analysis.evaluate import main

    before = (fbt / "config.json").read_bytes()
    _cli_refused(main, ["--model", str(fbt), "--tasks", "completion", "--out", str(fbt / "config.json"), "--overwrite",
                        "--no-progress"], capsys, "is inside")
    assert (fbt / "config.json").read_bytes() == before


def test_output_paths_in_a_model_folder_are_refused(fbt, hf, tmp_path):
    from common.cli import output_dir, output_file

    (tmp_path / "link").symlink_to(fbt)
    for call, arg in ((output_dir, fbt), (output_dir, fbt / "sub" / "deeper"), (output_file, fbt / "eval.json"),
                      (output_file, fbt / "model.safetensors"), (output_file, hf / "config.json"),
                      (output_dir, tmp_path / "link" / "x"), (output_file, tmp_path / "link" / "config.json")):
        with pytest.raises(UserError, match="model directory") as e:
            call(arg)
        _one_line(e)
    assert output_dir(fbt, model_dir=True) == fbt  # training writes its own checkpoint there
    with pytest.raises(UserError, match="is inside"):
        output_dir(fbt / "sub", model_dir=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text("{}")
    (bin_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="model directory"):
        output_file(bin_dir / "results.json")
    assert output_file(tmp_path / "results.json") == tmp_path / "results.json"  # a plain folder is fine


def test_probes_run_refuses_a_model_folder_as_out(fbt, capsys):
    from probes.run import main

    _cli_refused(main, ["--task", "completion", "--model", str(fbt), "--out", str(fbt), "--no-cache",
                        "--no-progress"], capsys, "model directory")
    assert not (fbt / "probes.json").exists()


# ----- 2. module:function tasks -----------------------------------------------------------------------------
GOOD = '''
from tasks import Sample

def gen(n_pairs, n_distractors, seed):
    return [Sample("t", f"state = {b} :", b, p, p, n_distractors) for p in range(n_pairs) for b in (0, 1)]
gen.label_words = ("0", "1")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_module(source) -> 'module_name'`: a module importable from tmp_path (removed from sys.modules after)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(source: str) -> str:
        name = f"user_task_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_a_generator_yielding_samples_works(user_module):
    from tasks import resolve_task

    mod = user_module(GOOD + '''
def lazy(n_pairs, n_distractors, seed):
    yield from gen(n_pairs, n_distractors, seed)
lazy.label_words = ("0", "1")
''')
    assert len(resolve_task(f"{mod}:lazy").make(3, 0, 0)) == 6


@pytest.mark.parametrize("body, needle", [
    ("import sys\nsys.exit(0)\n" + GOOD, "called sys.exit(0)"),
    (GOOD + "raise SystemExit('bye')\n", "called sys.exit('bye')"),
    (GOOD + "def bad(n, k, s):\n    import sys\n    sys.exit(0)\nbad.label_words = ('0', '1')\n", "called sys.exit(0)"),
])
def test_sys_exit_in_a_task_is_one_line(user_module, body, needle):
    from tasks import resolve_task

    mod = user_module(body)
    func = "bad" if "def bad" in body else "gen"
    with pytest.raises(UserError) as e:
        resolve_task(f"{mod}:{func}").make(2, 0, 0)
    assert needle in _one_line(e)


@pytest.mark.parametrize("where", ["import", "generator"])
def test_a_base_exception_of_the_tasks_own_is_one_line(user_module, where):
    from tasks import resolve_task

    raise_it = "class Boom(BaseException):\n    pass\n"
    body = {"import": raise_it + "raise Boom('bang')\n" + GOOD,
            "generator": raise_it + GOOD + "def bad(n, k, s):\n    raise Boom('bang')\nbad.label_words = ('0', '1')\n",
            }[where]
    mod = user_module(body)
    with pytest.raises(UserError) as e:
        resolve_task(f"{mod}:{'gen' if where == 'import' else 'bad'}").make(2, 0, 0)
    assert "Boom: bang" in _one_line(e)


def test_ctrl_c_in_a_task_stays_an_interrupt(user_module):
    from tasks import resolve_task

    mod = user_module(GOOD + "def bad(n, k, s):\n    raise KeyboardInterrupt\nbad.label_words = ('0', '1')\n")
    with pytest.raises(KeyboardInterrupt):
        resolve_task(f"{mod}:bad").make(2, 0, 0)


def test_sigterm_in_a_task_stays_a_termination(user_module):
    """cli_entry raises SIGTERM as common.errors.Terminated: arriving inside a user's generator it is the run's
    stop (exit 143 after cleanup), not a one-line 'your task failed'."""
    from common.errors import Terminated
    from tasks import resolve_task

    mod = user_module(GOOD + "from common.errors import Terminated\n"
                             "def bad(n, k, s):\n    raise Terminated\nbad.label_words = ('0', '1')\n")
    with pytest.raises(Terminated):
        resolve_task(f"{mod}:bad").make(2, 0, 0)


@pytest.mark.parametrize("where", ["generator", "import", "swallowing"])
def test_a_task_that_never_ends_is_stopped(user_module, monkeypatch, where):
    import tasks.custom as custom
    from tasks import resolve_task

    monkeypatch.setattr(custom, "FUNCTION_TIME_LIMIT_S", 0.5)
    loop = "while True:\n    pass\n"
    body = {"import": loop + GOOD,
            "generator": GOOD + "def bad(n, k, s):\n    while True:\n        pass\nbad.label_words = ('0', '1')\n",
            # catches the first interruption (except Exception would not: the timeout is a BaseException)
            "swallowing": GOOD + "def bad(n, k, s):\n    try:\n        while True:\n            pass\n"
                                 "    except BaseException:\n        return gen(n, k, s)\n"
                                 "bad.label_words = ('0', '1')\n",
            }[where]
    mod = user_module(body)
    with pytest.raises(UserError) as e:
        resolve_task(f"{mod}:{'gen' if where == 'import' else 'bad'}").make(2, 0, 0)
    assert "did not finish within the 0.5 s limit" in _one_line(e)
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is off again


@pytest.mark.parametrize("field, value, needle", [
    ("running", 5, "has running 5"),
    ("running", "01", "has running"),
    ("label", "1", "has label '1'"),
    ("label", 1.0, "has label 1.0"),
    ("text", 5, "non-string text"),
    ("pair_id", "a", "has pair_id 'a'"),
    ("group_id", None, "has group_id None"),
    ("n_distractors", 0.5, "has n_distractors 0.5"),
    ("writes", -1, "has writes -1"),
    ("writes", "2", "has writes '2'"),
    ("n_tokens", "x", "has n_tokens 'x'"),
    ("task", 3, "has task 3"),
    ("diff_line", "0", "has diff_line '0'"),
])
def test_sample_fields_of_the_wrong_type_are_one_line(user_module, field, value, needle):
    from tasks import resolve_task

    mod = user_module(GOOD + f'''
import dataclasses
def bad(n, k, s):
    out = gen(n, k, s)
    return [dataclasses.replace(out[0], {field}={value!r})] + out[1:]
bad.label_words = ("0", "1")
''')
    with pytest.raises(UserError) as e:
        resolve_task(f"{mod}:bad").make(2, 0, 0)
    assert needle in _one_line(e)


MARKER_MODULE = GOOD + '''
from pathlib import Path
Path(__file__).with_suffix(".imported").write_text("yes")
'''


def test_task_code_is_imported_only_after_every_other_check(user_module, tmp_path, capsys):
    from analysis.evaluate import main as evaluate
    from interventions.run import main as interventions
    from probes.run import main as probes
    from tasks import resolve_task

    mod = user_module(MARKER_MODULE)
    marker = tmp_path / f"{mod}.imported"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    src = resolve_task(f"{mod}:gen")  # the spec's syntax only
    assert not marker.exists()
    for main, argv, needle in (
            (probes, ["--task", f"{mod}:gen", "--out", str(not_a_dir)], "exists and is not a directory"),
            (probes, ["--task", f"{mod}:gen", "--modes", "nonsense"], "nonsense"),
            (probes, ["--task", f"{mod}:gen", "--distractors", "x"], "--distractors"),
            (evaluate, ["--tasks", f"{mod}:gen", "--out", str(not_a_dir)], "file"),
            (evaluate, ["--tasks", f"completion,{mod}:gen", "--modes", "nonsense"], "nonsense"),
            (evaluate, ["--tasks", f"{mod}:gen", "--distractors", "-1"], "--distractors"),
            (interventions, ["--task", f"{mod}:gen", "--out", str(not_a_dir)], "exists and is not a directory"),
            (interventions, ["--task", f"{mod}:gen", "--mode", "nonsense"], "nonsense"),
            (interventions, ["--task", f"{mod}:gen", "--erase-depths", "x"], "--erase-depths")):
        _cli_refused(main, [*argv, "--model", "no-such-model", "--no-progress"], capsys, needle)
        assert not marker.exists(), argv
    # interventions.run: a good model and arguments, a bad --tokenizer: still refused before the import
    _cli_refused(interventions, ["--task", f"{mod}:gen", "--model", "tiny-fbt", "--tokenizer", str(tmp_path / "nope"),
                                 "--no-progress"], capsys, "nope")
    assert not marker.exists()
    # every other argument good but the model's name (or folder): refused before the import too
    for main, argv in ((probes, ["--task", f"{mod}:gen", "--distractors", "0"]),
                       (evaluate, ["--tasks", f"{mod}:gen", "--distractors", "0"]),
                       (interventions, ["--task", f"{mod}:gen", "--distractors", "0"])):
        for model, needle in (("no-such-model", "unknown model"), (str(tmp_path), "no config.json")):
            _cli_refused(main, [*argv, "--model", model, "--out", str(tmp_path / "o"), "--no-progress"], capsys,
                         needle)
            assert not marker.exists(), (argv, model)
    assert src.load().name == "gen" and marker.exists() and not (tmp_path / "o").exists()


# ----- 5. training ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    (dict(d_model=30, n_heads=4), "n_heads (4) must divide d_model (30)"),
    (dict(d_model=32, n_heads=4, n_kv_heads=3), "n_kv_heads (3) must divide n_heads (4)"),
    (dict(d_model=32, n_heads=4, n_kv_heads=8), "n_kv_heads (8) must divide n_heads (4)"),
    (dict(d_model=12, n_heads=4, n_kv_heads=2), "must be even for qwen3"),
    (dict(arch="gpt2", d_model=30, n_heads=4), "n_heads (4) must divide d_model (30)"),
])
def test_train_config_refuses_heads_that_do_not_divide(kw, needle):
    from training.config import TrainConfig

    with pytest.raises(UserError) as e:
        TrainConfig(**kw)
    assert needle in _one_line(e)
    TrainConfig(**{**kw, "base": "tiny-base"})  # --base keeps its own config: these sizes are unused


def test_train_cli_refuses_bad_heads_before_work(tmp_path, capsys):
    import training.cli as tcli

    _cli_refused(tcli.main, ["--preset", "smoke", "--n-heads", "3", "--out", str(tmp_path / "r")], capsys,
                 "n_heads (3) must divide d_model (32)")
    assert not (tmp_path / "r").exists()


@pytest.fixture
def trainer():
    """(model, tokenizer, optimizer, config) of the smoke preset, for direct saves."""
    from tasks import build_tokenizer
    from training.model import build_model
    from training.presets import get_preset

    cfg = get_preset("smoke")
    tok = build_tokenizer()
    model = build_model(cfg, len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return model, tok, opt, cfg


def _bump(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def _resume(trainer, out):
    from tasks import build_tokenizer
    from training.checkpoint import load_resume
    from training.model import build_model

    model, _, _, cfg = trainer
    fresh = build_model(cfg, len(build_tokenizer()))
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    step, log = load_resume(fresh, opt, cfg, out)
    return step, log, fresh


class _Killed(BaseException):
    pass


def test_a_save_that_fails_midway_keeps_the_previous_checkpoint(trainer, tmp_path, monkeypatch):
    import training.checkpoint as tckpt

    model, tok, opt, cfg = trainer
    out = tmp_path / "run"
    tckpt.save_checkpoint(model, tok, opt, cfg, 1, {"history": [1]}, out)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _bump(model)
    real = tckpt.atomic_write

    def fail_after_the_weights(path, data):  # model and config are written: the log is not
        if Path(path).name == tckpt.LOG_FILE:
            raise _Killed
        return real(path, data)

    monkeypatch.setattr(tckpt, "atomic_write", fail_after_the_weights)
    with pytest.raises(_Killed):
        tckpt.save_checkpoint(model, tok, opt, cfg, 2, {"history": [1, 2]}, out)
    monkeypatch.setattr(tckpt, "atomic_write", real)
    assert not (out / tckpt.PENDING).exists()
    step, log, fresh = _resume(trainer, out)
    assert step == 1 and log == {"history": [1]}
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)


def test_a_kill_while_writing_leaves_the_previous_checkpoint_resumable(trainer, tmp_path):
    import training.checkpoint as tckpt

    model, tok, opt, cfg = trainer
    out = tmp_path / "run"
    tckpt.save_checkpoint(model, tok, opt, cfg, 1, {"history": [1]}, out)
    # what SIGKILL leaves while the next save writes: a pending folder without its trainer state
    (out / tckpt.PENDING).mkdir()
    shutil.copy(out / "model.safetensors", out / tckpt.PENDING / "model.safetensors")
    (out / tckpt.PENDING / "config.json").write_text("{")
    tckpt.check_resume_files(out)
    assert _resume(trainer, out)[0] == 1
    tckpt.remove_stale(out)  # the next run removes it
    assert not (out / tckpt.PENDING).exists()


@pytest.mark.parametrize("first", [False, True])
def test_a_kill_while_moving_resumes_from_the_new_checkpoint(trainer, tmp_path, monkeypatch, first):
    import training.checkpoint as tckpt

    model, tok, opt, cfg = trainer
    out = tmp_path / "run"
    if not first:
        tckpt.save_checkpoint(model, tok, opt, cfg, 1, {"history": [1]}, out)
        _bump(model)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    real, moved = os.replace, []

    def killed_after_one_move(src, dst):
        if Path(src).parent.name == tckpt.PENDING and not Path(src).name.startswith("."):  # not a temporary
            if moved:
                raise _Killed
            moved.append(src)
        return real(src, dst)

    monkeypatch.setattr(tckpt.os, "replace", killed_after_one_move)
    with pytest.raises(_Killed):
        tckpt.save_checkpoint(model, tok, opt, cfg, 2, {"history": [1, 2]}, out)
    monkeypatch.setattr(tckpt.os, "replace", real)
    assert (out / tckpt.PENDING / tckpt.STATE_FILE).is_file()  # complete, half moved
    tckpt.remove_stale(out)  # a complete pending checkpoint is kept
    tckpt.check_resume_files(out)
    step, log, fresh = _resume(trainer, out)
    assert step == 2 and log == {"history": [1, 2]}
    assert all(torch.equal(fresh.state_dict()[k], new[k]) for k in new)
    assert not (out / tckpt.PENDING).exists()


def test_every_checkpoint_file_follows_the_umask(trainer, tmp_path):
    import training.checkpoint as tckpt

    model, tok, opt, cfg = trainer
    old = os.umask(0o027)
    try:
        tckpt.save_checkpoint(model, tok, opt, cfg, 1, {"history": []}, tmp_path / "run")
        model.save_pretrained(tmp_path / "plain", tokenizer=tok)
    finally:
        os.umask(old)
    files = [f for d in ("run", "plain") for f in (tmp_path / d).iterdir()]
    assert {f.name for f in files} >= {"model.safetensors", "config.json", tckpt.STATE_FILE, tckpt.LOG_FILE}
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: "0o640" for f in files}


def test_resume_refuses_a_huge_integer_in_the_trainer_state(trainer, tmp_path):
    from safetensors.torch import save_file

    import training.checkpoint as tckpt

    model, tok, opt, cfg = trainer
    out = tmp_path / "run"
    tckpt.save_checkpoint(model, tok, opt, cfg, 1, {"history": []}, out)
    header = '{"format": "%s", "step": 1%s}' % (tckpt.STATE_FORMAT, "0" * 5000)
    save_file({"t0": torch.zeros(1)}, str(out / tckpt.STATE_FILE), metadata={"trainer_state": header})
    with pytest.raises(UserError) as e:
        _resume(trainer, out)
    assert "an integer of 5001 digits" in _one_line(e)
