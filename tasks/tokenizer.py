"""Word-level tokenizer over the whole task vocabulary, and prompt tokenization with the final-token check."""
from __future__ import annotations

import collections
import dataclasses

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from common.errors import UserError

from .samples import LABEL_WORDS, REGISTERS, TASKS, TRACKING_TASKS, Sample
from .words import ANSWER_SEP, LANGUAGE_TASKS

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"

# Every token any task text (prompt + answer) can contain. Order fixes the ids: keep appending only.
_TASK_TOKENS = (
    [str(d) for d in range(10)]
    + list(REGISTERS)
    + ["required", "completed", "scratch", "Status", "state", "final", "value", "get", "nop"]
    + ["=", "+=", "^=", ":", "#", "\n"]
    + [w for task in TASKS for w in LABEL_WORDS[task]]
    # Tracking tasks (issue 21); their label words ("0"/"1", cups "A"/"B"/"C") are already in.
    + ["x", "parity", "ball", "under", "swap"]
    + [w for task in TRACKING_TASKS for w in LABEL_WORDS[task]]
    + ["cycle"]  # s5 / a5 (issue 40): three-cycles of five cups; their cups and labels are the digits
)
# Words (\w+), operator runs (+=, ^=, :, #) and newlines are tokens; other whitespace is dropped.
# (The Whitespace pre-tokenizer would drop the newlines.)
_SPLIT_PATTERN = r"\w+|[^\w\s]+|\n"


def _language_tokens() -> list[str]:
    """Every token of the language tasks' texts (tasks.language), in a fixed order: their word lists, then the
    words and marks of their templates, sorted."""
    import re

    from . import language as lang

    fixed = [w for t in LANGUAGE_TASKS for w in LABEL_WORDS[t]] + list(lang.KEYS) + list(lang.VARIABLES)
    text = " ".join([*lang.IOI_TEMPLATES, *lang.IOI_FILLERS, ", . : # = print ( )"])
    rest = sorted(set(re.findall(_SPLIT_PATTERN, text.replace("{A}", "").replace("{B}", "").replace("{S}", ""))))
    return fixed + rest


def _vocab(language: bool = False) -> dict[str, int]:
    vocab: dict[str, int] = {PAD_TOKEN: 0, UNK_TOKEN: 1}
    for tok in _TASK_TOKENS + (_language_tokens() if language else []):
        vocab.setdefault(tok, len(vocab))  # label words "0"/"1" repeat the digits
    return vocab


def build_tokenizer(language: bool = False) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: [PAD] = 0, [UNK] = 1, then every task token. No BOS/EOS is added.

    `language=True` also knows the words of the natural-language tasks (tasks.language), appended after the
    synthetic tasks' tokens; the default vocabulary is the one the shipped checkpoints were trained with."""
    tok = Tokenizer(models.WordLevel(_vocab(language), unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="removed", invert=True)
    # Readable decode: put a space before every token, join, then undo the spaces around "\n" and
    # before ":" so decode(encode(text)) == text for task texts.
    tok.decoder = decoders.Sequence([
        decoders.Replace(Regex("^"), " "),
        decoders.Fuse(),
        decoders.Replace(" \n ", "\n"),
        decoders.Replace(" \n", "\n"),
        decoders.Replace(" :", ":"),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN)


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def dedicated_pad_id(tokenizer) -> int | None:
    """The tokenizer's padding id when it is a token of its own ([PAD] of the task tokenizer): it marks padding,
    never a word, so a text holding it is refused. None when there is none, or when it is also the eos / bos
    token (SmolLM2's pad is its <|endoftext|>, which a text may hold)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None or pad in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)):
        return None
    return pad


def prompt_prefix(tokenizer) -> list[int]:
    """The special ids the tokenizer puts before a text by default (as ``tokenizer(text)`` does): a Llama's or
    Gemma's BOS; none for SmolLM2, GPT-2, Qwen3 and the task tokenizer. Every prompt starts with them, so that a
    model reads its prompts as it read its training text (Gemma without its BOS is known to degrade). What a
    tokenizer puts after a text (an EOS) is not taken: a prompt is continued.

    Read off texts the tokenizer can spell (two short texts, then a few of its own words; one it cannot spell is
    skipped): the ids before the text's own tokens, each marked special by the tokenizer (its
    ``special_tokens_mask``: a BOS its config does not name counts). Texts that disagree give none."""
    found = None
    for probe in _probe_texts(tokenizer):
        if probe is None:  # the short texts are settled: the vocabulary's words only if neither could be spelled
            if found is not None:
                break
            continue
        try:
            enc = tokenizer(probe, return_special_tokens_mask=True)
            full, bare = list(enc["input_ids"]), list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a text it cannot spell (tokenizers raise a bare Exception), a stand-in
            continue
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
        if not bare or at is None:
            continue
        mask = enc.get("special_tokens_mask")
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        if not all((mask[i] == 1) if mask is not None else (full[i] in special) for i in range(at)):
            return []  # ids before the text that are words of it: not a prefix this function knows
        if found is not None and found != full[:at]:
            return []
        found = full[:at]
    return found or []


def _probe_texts(tokenizer):
    """Texts to read the prefix off: two short ones, a None mark, then (asked only past the mark: a 128k
    vocabulary costs ~50 ms to list) up to 8 of the tokenizer's own plain words."""
    yield from ("0", "a b", None)
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a stand-in without a vocabulary
        return
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    yield from sorted((w for w in vocab if w.isalnum() and w not in special), key=lambda w: (vocab[w], w))[:8]


def prompt_prefix_tokens(tokenizer) -> list[str]:
    """``prompt_prefix`` as token strings (what the results record: ``["<s>"]``, or ``[]``)."""
    prefix = prompt_prefix(tokenizer)
    return list(tokenizer.convert_ids_to_tokens(prefix)) if prefix else []


def prompt_ids(tokenizer, text: str, prefix: list[int] | None = None) -> list[int]:
    """The ids a text is run on: ``prompt_prefix`` (given, or asked of the tokenizer), then the text's tokens."""
    prefix = prompt_prefix(tokenizer) if prefix is None else prefix
    return _with_prefix(prefix, list(tokenizer(text, add_special_tokens=False)["input_ids"]))


def _with_prefix(prefix: list[int], row: list[int]) -> list[int]:
    """The prefix, then the text's tokens; once: a text that writes it out itself (a task file's "<s> ...") starts
    with it already."""
    return row if row[:len(prefix)] == prefix else prefix + row


def tokenize_samples(samples, tokenizer) -> tuple[list[list[int]], list[Sample]]:
    """Token ids of each prompt (``prompt_prefix``, then the text's tokens) and the samples with ``n_tokens``
    filled (the prefix included).

    Raises ``UserError`` unless every prompt ends with the same final token id: the layer-0 chance
    guarantee of docs/design.md (Tasks) rests on it, and some tokenizers merge ":" with the preceding word.
    Also unless every prompt comes back from its tokens (decode(encode(text)) equals the text up to whitespace),
    whatever the tokenizer's unk token: a config may name none while its model still maps an unknown word to
    one, and a prompt with words the tokenizer does not know would be scored on inputs the model never read
    (byte-level BPE tokenizers, SmolLM2's or GPT-2's, know every string and pass).
    """
    samples = list(samples)
    if not samples:
        raise UserError("empty dataset: no samples to tokenize")
    enc = tokenizer([s.text for s in samples], add_special_tokens=False)
    ids = [list(x) for x in enc["input_ids"]]  # the texts' own tokens: the checks below read these
    name = _tokenizer_name(tokenizer)
    for s, row in zip(samples, ids):
        if not row:
            raise UserError(f"tokenizer {name!r} gives no tokens for a {s.task} prompt (pair {s.pair_id})")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None:
        for s, row in zip(samples, ids):
            if unk in row:  # a word the model never saw: its answers would be scored on [UNK] inputs
                j = row.index(unk)
                word = next((w for w in s.text.split() if unk in tokenizer(w, add_special_tokens=False)["input_ids"]),
                            None)
                raise UserError(f"tokenizer {name!r} does not know every word of the {s.task} task (unknown "
                                + (f"word {word!r}, " if word is not None else "")
                                + f"token at position {j} of pair {s.pair_id}'s prompt): this model was not built "
                                "for this task")
    pad = dedicated_pad_id(tokenizer)
    if pad is not None:
        for s, row in zip(samples, ids):
            if pad in row:  # fed as a token, it would be read as a word the model never saw in a text
                raise UserError(f"pair {s.pair_id}'s {s.task} prompt holds the padding token "
                                f"{tokenizer.convert_ids_to_tokens(pad)!r} (position {row.index(pad)}), which "
                                "marks padding and is never a word of a text")
    back = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    for s, text in zip(samples, back):
        if _squeeze(text) != _squeeze(s.text):
            raise UserError(f"tokenizer {name!r} does not know every word of the {s.task} task: "
                            f"{_first_lost(tokenizer, s.text, text)} in pair {s.pair_id}'s prompt: this model was "
                            "not built for this task (or give the tokenizer it was trained with)")
    # The expected ending is the most common final id (ties -> first seen), so the one sample reported
    # is the odd one out rather than whichever happened to come first.
    counts = collections.Counter(row[-1] for row in ids)
    expected = max(counts, key=lambda t: counts[t])
    for s, row in zip(samples, ids):
        if row[-1] != expected:
            got = tokenizer.decode(row[-3:])
            want = tokenizer.decode([expected])
            raise UserError(
                f"tokenizer {name!r}: prompts do not all end with the same final token; "
                f"{s.task} sample (pair {s.pair_id}, label {s.label}) ends with {got!r} "
                f"(last token {tokenizer.decode(row[-1:])!r}), expected final token {want!r}"
            )
    if any(s.task in LANGUAGE_TASKS for s in samples):
        _check_one_token_pairs(samples, ids, name)
    prefix = prompt_prefix(tokenizer)
    ids = [_with_prefix(prefix, row) for row in ids]
    out = [dataclasses.replace(s, n_tokens=len(row)) for s, row in zip(samples, ids)]
    return ids, out


def _check_one_token_pairs(samples, ids, name: str) -> None:
    """The language tasks' contract: the two members of a pair differ in exactly one token (tasks.language)."""
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        rows.setdefault(s.pair_id, []).append(i)
    for pair, members in rows.items():
        if len(members) != 2:
            continue
        a, b = (ids[i] for i in members)
        diff = len(a) != len(b) or sum(x != y for x, y in zip(a, b)) != 1
        if diff:
            s = samples[members[0]]
            raise UserError(f"tokenizer {name!r} splits the {s.task} pair {pair} so that its prompts differ in "
                            f"more than one token ({len(a)} vs {len(b)} tokens): the pair's one-token contrast "
                            "does not hold under this tokenizer")


def key_token_positions(samples, tokenizer) -> list[int]:
    """The token index (0-based, within the unpadded prompt as ``tokenize_samples`` gives it, its
    ``prompt_prefix`` included) of each sample's key word (``Sample.key_char``, tasks.language): the token whose
    characters hold the key word's first character. UserError for samples without a key (the synthetic tasks) or
    a tokenizer without character offsets."""
    samples = list(samples)
    missing = [s for s in samples if s.key_char is None]
    if missing:
        raise UserError(f"task {missing[0].task!r} has no key token (only the language tasks: "
                        f"{', '.join(LANGUAGE_TASKS)})")
    try:
        enc = tokenizer([s.text for s in samples], add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        raise UserError(f"tokenizer {_tokenizer_name(tokenizer)!r} gives no character offsets: key tokens need a "
                        "fast tokenizer") from None
    out, prefix = [], prompt_prefix(tokenizer)
    for s, offsets, row in zip(samples, enc["offset_mapping"], enc["input_ids"]):
        skip = len(_with_prefix(prefix, list(row))) - len(row)  # the prefix tokenize_samples puts before the text
        # The first token that ends past the key's first character (a leading-space token starts before it).
        j = next((k for k, (a, b) in enumerate(offsets) if b > s.key_char and a <= s.key_char), None)
        if j is None:
            j = next((k for k, (a, b) in enumerate(offsets) if b > s.key_char), None)
        if j is None:
            raise UserError(f"the key word of {s.task} pair {s.pair_id} lies past the end of its tokens")
        out.append(skip + j)
    return out


def _squeeze(text: str) -> str:
    """The text without whitespace: decoders may respace words (a word-level decoder, sentencepiece's leading
    space), never change one."""
    return "".join(text.split())


def _first_lost(tokenizer, text: str, back: str) -> str:
    """The first word of `text` its tokens do not give back (what the round-trip error names), as one line."""
    for word in text.split():
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        got = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if _squeeze(got) != word:
            return f"the word {word!r} comes back from its tokens as {got.strip()!r}"
    a, b = _squeeze(text), _squeeze(back)
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return f"the prompt comes back from its tokens as ...{b[max(0, i - 10):i + 20]!r}... where it reads " \
           f"...{a[max(0, i - 10):i + 20]!r}..."


def label_token_ids(tokenizer, task: str) -> list[int]:
    """Token id of each label word (index = label) as it follows the prompt, for any tokenizer.

    Two ids for the binary tasks, three for shell_game, five for s5 / a5.
    """
    from .generators import make_dataset

    if task in LANGUAGE_TASKS:
        return _language_label_ids(tokenizer, task)
    n_labels = len(LABEL_WORDS[task]) if task in LABEL_WORDS else 2  # unknown task: make_dataset says so
    # The tracking tasks need an update line; 3 pairs hold every shell_game cup, 5 every s5 / a5 cup.
    ds = make_dataset(task, n_pairs=1 if n_labels == 2 else n_labels, n_distractors=int(task in TRACKING_TASKS),
                      seed=0)
    out = []
    for label in range(n_labels):
        sample = next(s for s in ds if s.label == label)
        prompt = tokenizer(sample.text, add_special_tokens=False)["input_ids"]
        full = tokenizer(sample.full_text, add_special_tokens=False)["input_ids"]
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} "
                            f"does not split {task} answers from the prompt cleanly")
        out.append(full[len(prompt)])
    if len(set(out)) < len(out):
        raise UserError(f"the {task} label words do not all have different first tokens under this tokenizer")
    return out


def _language_label_ids(tokenizer, task: str) -> list[int]:
    """Each label word must be exactly one token after the task's prompt (joined by ``ANSWER_SEP``)."""
    from .generators import make_dataset
    from .language import LANGUAGE_DISTRACTORS

    name = _tokenizer_name(tokenizer)
    prompt = make_dataset(task, 1, LANGUAGE_DISTRACTORS[task][0], seed=0)[0].text
    base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    out = []
    for w in LABEL_WORDS[task]:
        full = tokenizer(prompt + ANSWER_SEP.get(task, " ") + w, add_special_tokens=False)["input_ids"]
        if full[:len(base)] != base or len(full) != len(base) + 1 or (unk is not None and full[-1] == unk):
            raise UserError(f"tokenizer {name!r}: the {task} answer {w!r} is not one known token after the prompt "
                            f"({len(full) - len(base)} tokens)")
        out.append(full[-1])
    if len(set(out)) < len(out):
        raise UserError(f"the {task} label words do not all have different tokens under tokenizer {name!r}")
    return out
