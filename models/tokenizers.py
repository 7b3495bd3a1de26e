"""The tokenizer a model's task prompts are tokenized with: the model folder's own, or the one `--tokenizer` names.

A model folder without a tokenizer is refused (one line naming the files looked for and the flag), never run with
some other tokenizer in silence: the suite's 44-word task tokenizer on a model with a larger vocabulary would feed
it token ids that mean other words to it, and every number written would be wrong without a word.

    load_tokenizer_dir(folder)       -> the folder's tokenizer, or None if it holds none of TOKENIZER_FILES
    tokenizer_source(arg)            -> (folder, what) of a --tokenizer value (a folder or a model preset name)
    resolve_tokenizer(model, tok, model_arg, tokenizer_arg) -> the tokenizer to use (UserError if none fits)

Accepted in a folder: ``tokenizer.json`` (a fast tokenizer, what training.train and every shipped checkpoint
save), or ``tokenizer_config.json`` with a vocabulary file (``vocab.json``, ``merges.txt``, ``tokenizer.model``,
``vocab.txt``, ...: what ``save_pretrained`` of a slow tokenizer writes), loaded with ``AutoTokenizer``.
"""
from __future__ import annotations

from pathlib import Path

from common.errors import UserError

FAST_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
VOCAB_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
LOOKED_FOR = f"{FAST_FILE}, or {CONFIG_FILE} with a vocabulary file ({', '.join(VOCAB_FILES)})"
FLAG_HINT = ("pass --tokenizer DIR_OR_PRESET (a folder holding the tokenizer the model was trained with, or a "
             "preset such as tiny-fbt or smollm2-135m)")


def has_tokenizer_files(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / FAST_FILE).is_file() or ((folder / CONFIG_FILE).is_file()
                                              and any((folder / f).is_file() for f in VOCAB_FILES))


def load_tokenizer_dir(folder: str | Path):
    """The tokenizer saved in `folder` (None if it holds none of the accepted files); UserError if unreadable."""
    folder = Path(folder)
    if not has_tokenizer_files(folder):
        return None
    try:
        if (folder / FAST_FILE).is_file():
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        vocab = tok.get_vocab()
    except Exception as e:  # JSONDecodeError, KeyError, OSError, ValueError, tokenizers' own Exception
        from models.full_bandwidth import one_line

        raise UserError(f"corrupt tokenizer in {folder}: {one_line(e, 200)}") from None
    if not vocab:
        raise UserError(f"corrupt tokenizer in {folder}: its vocabulary is empty")
    return tok


def tokenizer_source(arg: str) -> tuple[Path | None, str]:
    """(folder, description) of a --tokenizer value: an existing folder, a preset's checkpoint folder, or
    (None, 'smollm2-135m') for the SmolLM2 loader's own tokenizer. UserError if it names none of these."""
    from models.checkpoints import PRESET_NAMES, checkpoint_dir

    s = str(arg)
    if not s.strip():
        raise UserError("--tokenizer is empty: give a folder holding a tokenizer or a preset name")
    p = Path(s)
    if p.is_dir():
        return p, str(p)
    if p.exists():
        raise UserError(f"--tokenizer {s}: not a folder (give the folder holding {FAST_FILE})")
    from models.smollm2 import NAME as SMOLLM2

    if s == SMOLLM2:
        return None, SMOLLM2
    if s in PRESET_NAMES:
        d = checkpoint_dir(s)
        if not d.is_dir():
            raise UserError(f"--tokenizer {s}: preset {s!r} has no checkpoint at {d}")
        return d, f"preset {s} ({d})"
    raise UserError(f"--tokenizer {s}: neither an existing folder nor a preset "
                    f"({', '.join(k for k in PRESET_NAMES if k != 'smoke')}, {SMOLLM2})")


def load_named_tokenizer(arg: str):
    """The tokenizer a --tokenizer value names (tokenizer_source); UserError if it has none."""
    folder, what = tokenizer_source(arg)
    if folder is None:  # smollm2-135m: the converted model's folder (converted once, then reused)
        from models.smollm2 import convert

        folder = convert()
    tok = load_tokenizer_dir(folder)
    if tok is None:
        raise UserError(f"--tokenizer {arg}: {what} holds no tokenizer (looked for {LOOKED_FOR})")
    return tok


def check_fits(tok, model, what: str) -> None:
    """UserError unless every token id of `tok` is a row of the model's input embedding."""
    rows = model.lm.get_input_embeddings().weight.shape[0]
    ids = list(tok.get_vocab().values())
    top = max(ids, default=-1)
    if top >= rows:
        raise UserError(f"{what} does not fit the model: token ids up to {top}, the model's embedding has {rows} "
                        "rows")


def resolve_tokenizer(model, tok, model_arg: str, tokenizer_arg: str | None = None):
    """The tokenizer for `model`'s task prompts.

    `tok`: what models.loading.load_model returned beside it (the folder's own tokenizer, or None);
    `tokenizer_arg`: the --tokenizer value (None: the model's own). Refused in one line: a model without a
    tokenizer of its own and no --tokenizer, a --tokenizer that names nothing usable, or a tokenizer with token
    ids the model's embedding does not have.
    """
    if tokenizer_arg is not None:
        named = load_named_tokenizer(tokenizer_arg)
        check_fits(named, model, f"--tokenizer {tokenizer_arg}")
        return named
    if tok is None:
        where = Path(model_arg)
        raise UserError(f"model {model_arg} has no tokenizer of its own (looked for {LOOKED_FOR} in "
                        f"{where if where.is_dir() else 'its folder'}); {FLAG_HINT}")
    check_fits(tok, model, f"the tokenizer of model {model_arg}")
    return tok
