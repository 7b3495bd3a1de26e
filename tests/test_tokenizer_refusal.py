"""No silent wrong numbers from tokenizers (issue 37): a model folder without a tokenizer of its own is refused in one
line (never run with the suite's task tokenizer unasked), --tokenizer names one, a tokenizer whose config has no
unk token still refuses words it does not know, and analysis.evaluate --seed draws fresh datasets."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "checkpoints" / "tiny-fbt"


def _llama(path: Path, vocab: int) -> Path:
    """A random-weight Llama saved with save_pretrained: config and weights, no tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(path)
    assert not any(p.name.startswith("tokenizer") for p in path.iterdir())
    return path


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("bare") / "llama", vocab=64)  # >= the task tokenizer's 44 words


def _refused(main, argv, capsys, *needles) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    return err


PROBES = ["--task", "completion", "--distractors", "0", "--n-pairs", "10", "--n-boot", "20", "--no-mdl",
          "--no-cache", "--no-progress"]
EVAL = ["--tasks", "completion", "--distractors", "0", "--n-pairs", "4", "--modes", "std", "--no-progress"]


def test_probes_run_refuses_a_model_without_a_tokenizer(bare, tmp_path, capsys):
    from probes.run import main

    out = tmp_path / "p"
    _refused(main, ["--model", str(bare), "--out", str(out), *PROBES], capsys,
             "has no tokenizer of its own", "tokenizer.json", "tokenizer_config.json", "--tokenizer")
    assert not out.exists()  # nothing written


def test_evaluate_refuses_a_model_without_a_tokenizer(bare, tmp_path, capsys):
    from analysis.evaluate import main

    out = tmp_path / "e.json"
    _refused(main, ["--model", str(bare), "--out", str(out), *EVAL], capsys,
             "has no tokenizer of its own", "tokenizer.json", "--tokenizer")
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tokenizer", [str(SHIPPED), "tiny-fbt"])
def test_tokenizer_flag_names_a_shipped_one(bare, tmp_path, tokenizer):
    from analysis.evaluate import main as evaluate
    from probes.run import main as probes
    from tasks import build_tokenizer

    assert (SHIPPED / "tokenizer.json").is_file()
    out = tmp_path / "p"
    assert probes(["--model", str(bare), "--tokenizer", tokenizer, "--out", str(out), *PROBES]) == 0
    doc = json.loads((out / "probes.json").read_text())
    from models.tokenizers import load_tokenizer_dir
    from models.fingerprint import tokenizer_hash

    assert doc["meta"]["run"]["tokenizer"] == tokenizer_hash(load_tokenizer_dir(SHIPPED))
    assert load_tokenizer_dir(SHIPPED).get_vocab().items() <= build_tokenizer().get_vocab().items()  # task words
    assert {r["mode"] for r in doc["results"]} == {"standard"} and len(doc["results"]) == 3  # depths 0..2
    ev = tmp_path / "e.json"
    evaluate(["--model", str(bare), "--tokenizer", tokenizer, "--out", str(ev), *EVAL])
    meta = json.loads(ev.read_text())["meta"]
    assert meta["tokenizer"] == tokenizer and meta["datasets"][0]["n_samples"] == 8


def test_tokenizer_flag_refusals(tmp_path, capsys):
    from probes.run import main

    from models.tokenizers import load_tokenizer_dir

    top = max(load_tokenizer_dir(SHIPPED).get_vocab().values())
    small = _llama(tmp_path / "small", vocab=top)  # one row fewer than the shipped tokenizer's ids need
    out = tmp_path / "p"
    _refused(main, ["--model", str(small), "--tokenizer", "tiny-fbt", "--out", str(out), *PROBES], capsys,
             "--tokenizer tiny-fbt does not fit the model", f"token ids up to {top}", f"{top} rows")
    _refused(main, ["--model", str(small), "--tokenizer", str(tmp_path / "nope"), "--out", str(out), *PROBES],
             capsys, "neither an existing folder nor a preset")
    _refused(main, ["--model", str(small), "--tokenizer", str(small), "--out", str(out), *PROBES], capsys,
             "holds no tokenizer", "tokenizer.json")
    assert not out.exists()


def test_a_tokenizer_without_unk_token_refuses_an_unknown_word(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from common.errors import UserError
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    build_tokenizer().save_pretrained(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["unk_token"]
    cfg_file.write_text(json.dumps(cfg))
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert tok.unk_token_id is None  # the [UNK] id check cannot see it
    ds = make_dataset("completion", 4, 2, seed=0)
    tokenize_samples(ds, tok)  # every word known: accepted
    bad = dataclasses.replace(ds[2], text="zebra " + ds[2].text)
    assert 1 in tok(bad.text, add_special_tokens=False)["input_ids"]  # mapped to [UNK] all the same
    with pytest.raises(UserError) as e:
        tokenize_samples(ds[:2] + [bad] + ds[3:], tok)
    msg = str(e.value)
    assert "does not know every word" in msg and "'zebra'" in msg and "'[UNK]'" in msg and "\n" not in msg


def test_byte_level_bpe_knows_every_word():
    """A byte-level BPE tokenizer (SmolLM2 / GPT-2 style) gives every string back: the round trip accepts it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tasks import make_dataset, tokenize_samples

    ds = make_dataset("completion", 4, 2, seed=0)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([s.full_text for s in ds], vocab_size=300, min_frequency=1, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    odd = [dataclasses.replace(s, text="zebra Ünïcode " + s.text) for s in ds]  # words it never saw
    ids, out = tokenize_samples(odd, tok)
    assert [tok.decode(r) for r in ids] == [s.text for s in odd]


def test_evaluate_seed_draws_fresh_datasets(tiny_ckpt, tmp_path):
    from analysis.evaluate import EVAL_SEED, main

    def run(name, *seed):
        out = tmp_path / f"{name}.json"
        main(["--model", str(tiny_ckpt), "--out", str(out), *EVAL, *seed])
        meta = json.loads(out.read_text())["meta"]
        return meta["seed"], [d["fingerprint"] for d in meta["datasets"]]

    seed0, default = run("default")
    seed1, one = run("one", "--seed", "1")
    again = run("again", "--seed", "1")
    assert seed0 == EVAL_SEED and seed1 == 1
    assert one != default and again == (1, one)
    assert run("explicit", "--seed", str(EVAL_SEED)) == (EVAL_SEED, default)  # the default is the fixed seed


def test_the_fixed_point_diagnostic_refuses_words_its_tokenizer_does_not_know():
    """analysis.fixed_point tokenized with tok(...) and ran prompts of [UNK]s; it goes through tokenize_samples."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from analysis.fixed_point import _batch
    from common.errors import UserError
    from tasks import build_tokenizer

    full = build_tokenizer()
    spec = json.loads(full.backend_tokenizer.to_str())
    spec["model"]["vocab"].pop("scratch")  # a task word this tokenizer no longer knows
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="[UNK]",
                                  pad_token=full.pad_token)
    _batch(full, "completion", 4, 2, 0)  # every word known: accepted
    with pytest.raises(UserError, match="does not know every word"):
        _batch(tok, "completion", 4, 2, 0)


def test_an_unknown_word_is_named():
    """The [UNK] refusal names the word, not only its token position."""
    from common.errors import UserError
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    ds = make_dataset("completion", 4, 2, seed=0)
    bad = dataclasses.replace(ds[2], text="quagga " + ds[2].text)
    with pytest.raises(UserError, match=r"unknown word 'quagga', token at position 0 of pair 1's prompt"):
        tokenize_samples(ds[:2] + [bad] + ds[3:], build_tokenizer())
