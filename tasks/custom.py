"""Built-in and bring-your-own tasks behind one interface: ``resolve_task(spec) -> TaskSource`` (docs/tasks.md).

``spec`` is one of

* a built-in task name (``tasks.ALL_TASKS``): ``tasks.make_dataset`` with ``LABEL_WORDS[name]``;
* a path to a JSONL file (``*.jsonl``): a fixed dataset, first line a header ``{"label_words": [...]}``
  (optional ``"name"``), then one sample per line:
  ``{"text", "label", "pair", "group"[, "n_distractors", "diff_line", "running"]}``;
* ``package.module:function``: a generator with the built-in signature ``f(n_pairs, n_distractors, seed) ->
  list[Sample]`` that carries ``f.label_words`` (and optionally ``f.task_name`` and ``f.distractors``, the
  default N values).

Every CLI (probes.run, analysis.evaluate, interventions.run) uses it the same way::

    src = resolve_task(args.task)           # UserError (one line) on a bad spec or a malformed file
    ...                                     # every other argument checked
    src.load()                              # module:function: imports (runs) the user's code, time-limited
    samples = src.make(n_pairs, n, seed)    # validated: pairs of two members with different labels, ...
    ids, samples = src.tokenize(samples, tokenizer)  # shared final token, known words
    label_ids = src.label_token_ids(tokenizer)       # one distinct single token per label word

A JSONL file is used whole (``n_pairs=None``) or cut to its first ``n_pairs`` pairs per N; its ``seed`` is
ignored (the data are fixed). Samples of custom tasks carry ``task = src.name`` and the task's
``label_words``, so ``Sample.answer`` / ``full_text`` work for every task.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import re
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

from common.errors import Terminated, UserError
from common.jsonio import loads_user, split_jsonl

from .samples import ALL_TASKS, LABEL_WORDS, TRACKING_TASKS, Sample
from .tokenizer import dedicated_pad_id

__all__ = ["TaskSource", "resolve_task", "validate_samples", "is_custom_spec"]

SAMPLE_KEYS = {"text", "label", "pair", "group"}
OPTIONAL_KEYS = {"n_distractors", "diff_line", "running"}
HEADER_KEYS = {"label_words", "name", "answer_sep"}
_FUNC_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_custom_spec(spec: str) -> bool:
    """True for a JSONL path or a module:function spec (not a built-in task name)."""
    return spec not in ALL_TASKS


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """What a task is once known: for a module:function task, only after its code has been imported."""

    name: str  # the rows' "task" and the default output folder name
    label_words: tuple  # index = label
    default_distractors: tuple | None = None  # jsonl: the N values in the file; function: f.distractors
    make: Callable | None = None  # (n_pairs, n_distractors, seed) -> validated samples; None for built-ins
    answer_sep: str = " "  # the text between prompt and answer: a header's / function's "answer_sep"


class TaskSource:
    """One task, built-in or custom. ``make(n_pairs, n_distractors, seed)`` returns validated samples.

    A module:function task imports (runs) the user's code only in ``load()``, which ``name``, ``label_words``,
    ``default_distractors`` and ``make`` call on first use: a CLI checks everything else first, then calls
    ``load()``, so a refused invocation never runs that code.
    """

    def __init__(self, form: str, spec: str, *, loaded: _Loaded | None = None, loader: Callable | None = None,
                 sha256: str | None = None, min_distractors: int = 0, variant: str | None = None):
        self.form = form  # "builtin", "jsonl" or "function" (written as "kind" by describe())
        self.spec = spec  # as given
        self.variant = variant  # a built-in tracking task's input variant ("parity@hold": tasks.tracking)
        self.sha256 = sha256  # jsonl: digest of the file's bytes
        self.min_distractors = min_distractors  # 1 for the tracking tasks (a pair differs in an update line);
        #                                         the language tasks' own lower bound (tasks.language)
        self._loaded, self._loader = loaded, loader

    def __repr__(self) -> str:
        return f"TaskSource({self.form!r}, {self.spec!r}{'' if self._loaded else ', not loaded'})"

    def load(self) -> "TaskSource":
        """Import and check a module:function task's code (once); other tasks are loaded already. UserError if bad."""
        if self._loaded is None:
            self._loaded = self._loader()
        return self

    @property
    def name(self) -> str:
        return self.load()._loaded.name

    @property
    def task(self) -> str:
        """The built-in task a variant is drawn from ("parity" for "parity@hold"); else the name."""
        return self.name.split("@")[0] if self.variant else self.name

    @property
    def label_words(self) -> tuple:
        return self.load()._loaded.label_words

    @property
    def answer_sep(self) -> str:
        """The text between a prompt and its answer (" " unless a custom task sets its answer_sep)."""
        if self.builtin:
            from .words import ANSWER_SEP

            return ANSWER_SEP.get(self.task, " ")
        return self.load()._loaded.answer_sep

    @property
    def default_distractors(self) -> tuple | None:
        return self.load()._loaded.default_distractors

    @property
    def n_classes(self) -> int:
        return len(self.label_words)

    @property
    def chance(self) -> float:
        return 1.0 / self.n_classes

    @property
    def builtin(self) -> bool:
        return self.form == "builtin"

    @property
    def fixed(self) -> bool:
        """A fixed dataset (JSONL): n_pairs=None means every pair, and the seed is ignored."""
        return self.form == "jsonl"

    def describe(self) -> dict:
        """JSON-able identity of the task for output metadata."""
        d = {"kind": self.form, "spec": self.spec, "name": self.name, "label_words": list(self.label_words)}
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        if not self.builtin and self.answer_sep != " ":
            d["answer_sep"] = self.answer_sep
        return d

    def make(self, n_pairs: int | None, n_distractors: int, seed: int = 0) -> list[Sample]:
        if self.form == "builtin":
            from .generators import make_dataset

            return make_dataset(self.task, n_pairs, n_distractors, seed=seed, variant=self.variant or "uniform")
        if n_pairs is not None and (not _is_int(n_pairs) or n_pairs < 1):
            raise UserError(f"number of pairs must be a positive integer, got {n_pairs!r}")
        if not _is_int(n_distractors) or n_distractors < 0:
            raise UserError(f"number of distractors must be a non-negative integer, got {n_distractors!r}")
        return self.load()._loaded.make(n_pairs, n_distractors, seed)

    def tokenize(self, samples, tokenizer):
        """``tasks.tokenize_samples`` (shared final token, no unknown words), errors naming the task."""
        from .tokenizer import tokenize_samples

        try:
            seqs, out = tokenize_samples(samples, tokenizer)
        except UserError as e:
            if self.builtin:
                raise
            raise UserError(f"task {self.spec}: {e}") from None
        if not self.builtin:
            _check_one_answer_per_input(seqs, out, self.spec)
        return seqs, out

    def label_token_ids(self, tokenizer, prompt: str | None = None) -> list[int]:
        """Token id of each label word as it follows a prompt (index = label).

        Built-in tasks: ``tasks.label_token_ids``. Custom tasks: every label word must be exactly one token
        after ``prompt`` (default: the task's first prompt) + " ", known to the tokenizer, and the words'
        tokens all different.
        """
        if self.builtin:
            from .tokenizer import label_token_ids

            return label_token_ids(tokenizer, self.task)
        if prompt is None:
            n = self.default_distractors[0] if self.default_distractors else max(self.min_distractors, 1)
            prompt = self.make(1 if not self.fixed else None, n, 0)[0].text
        tname = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        unk = getattr(tokenizer, "unk_token_id", None)
        out = []
        sep = self.answer_sep
        for w in self.label_words:
            full = tokenizer(prompt + sep + w, add_special_tokens=False)["input_ids"]
            extra = len(full) - len(base)
            if full[:len(base)] != base or extra != 1:
                raise UserError(f"task {self.spec}: label word {w!r} is not one token after the prompt joined by "
                                f"answer_sep {sep!r} (prompt + {sep!r} + {w!r}) under tokenizer {tname!r} ({extra} "
                                "tokens); choose label words that are one token there, or another answer_sep")
            if unk is not None and full[-1] == unk:
                raise UserError(f"task {self.spec}: label word {w!r} is unknown to tokenizer {tname!r}")
            if full[-1] == dedicated_pad_id(tokenizer):
                raise UserError(f"task {self.spec}: label word {w!r} is the padding token of tokenizer {tname!r}")
            out.append(full[-1])
        if len(set(out)) < len(out):
            raise UserError(f"task {self.spec}: the label words {list(self.label_words)} do not all give "
                            f"different tokens under tokenizer {tname!r}")
        return out


# ----------------------------------------------------------------------------------------------------------
def _check_one_answer_per_input(seqs, samples, spec) -> None:
    """One input, one answer, under the tokenizer that will read them: two texts that differ only where it does
    not see (whitespace a word-level tokenizer drops) are one prompt; with two labels (a pair's members, or two
    pairs) the probes and swaps would score a contradiction."""
    label_of: dict = {}
    for ids, s in zip(seqs, samples):
        key = (s.n_distractors, tuple(ids))
        first = label_of.setdefault(key, s)
        if first.label != s.label:
            what = "the two members of one pair are" if first.pair_id == s.pair_id else "two samples are"
            raise UserError(f"task {spec}: {what} the same input under this tokenizer (N={s.n_distractors}; texts "
                            f"{first.text[-40:]!r} and {s.text[-40:]!r} at their ends) with labels {first.label} "
                            f"and {s.label}: one prompt cannot have two answers (texts that differ only in "
                            "whitespace?)")


def _check_answer_sep(sep, where: str) -> str:
    """The text joining prompt and answer: "" or whitespace (a digit after a byte-level BPE prompt ending in a space
    is one token, its spaced form two)."""
    if not isinstance(sep, str) or len(sep) > 4 or sep.strip():
        raise UserError(f"{where}: answer_sep must be \"\" or up to 4 whitespace characters, got {sep!r}")
    return sep


def _check_label_words(words, where: str) -> tuple:
    if not isinstance(words, (list, tuple)) or len(words) < 2:
        raise UserError(f"{where}: label_words must be a list of at least 2 strings, got {words!r}")
    for w in words:
        if not isinstance(w, str) or not w or w != w.strip() or any(c.isspace() for c in w):
            raise UserError(f"{where}: every label word must be a non-empty string without whitespace, got {w!r}")
    if len(set(words)) < len(words):
        raise UserError(f"{where}: label_words {list(words)} are not all different")
    return tuple(words)


def validate_samples(samples, label_words, where: str, answer_sep: str = " ") -> list[Sample]:
    """Check generated or loaded samples; return them as a list (UserError, one line, on the first problem).

    Every item is a ``Sample`` with a non-empty text, an integer label in ``0..K-1`` (K label words), integer
    pair, group and N; every pair has exactly two members, with different labels, the same group and the
    same N; ``running`` (optional) holds labels in ``0..K-1`` and ``diff_line`` indexes it.
    """
    if isinstance(samples, (str, bytes, dict)):
        raise UserError(f"{where}: expected a list of Sample, got {type(samples).__name__}")
    try:
        samples = list(samples)
    except TypeError:
        raise UserError(f"{where}: expected a list of Sample, got {type(samples).__name__}") from None
    if not samples:
        raise UserError(f"{where}: no samples")
    k = len(label_words)
    pairs: dict = {}
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise UserError(f"{where}: item {i} is a {type(s).__name__}, not a tasks.Sample")
        if not isinstance(s.text, str) or not s.text.strip():
            raise UserError(f"{where}: sample {i} has an empty or non-string text")
        if not isinstance(s.task, str):
            raise UserError(f"{where}: sample {i} has task {s.task!r}; must be a string")
        if not _is_int(s.label) or not 0 <= s.label < k:
            raise UserError(f"{where}: sample {i} has label {s.label!r}; labels must be integers in 0..{k - 1} "
                            f"(index into the {k} label words)")
        for f in ("pair_id", "group_id", "n_distractors", "writes"):
            if not _is_int(getattr(s, f)) or (f in ("n_distractors", "writes") and getattr(s, f) < 0):
                raise UserError(f"{where}: sample {i} has {f} {getattr(s, f)!r}; must be an integer"
                                + (" >= 0" if f in ("n_distractors", "writes") else ""))
        if s.n_tokens is not None and (not _is_int(s.n_tokens) or s.n_tokens < 1):
            raise UserError(f"{where}: sample {i} has n_tokens {s.n_tokens!r}; leave it None (tokenize fills it)")
        if s.running is not None:
            if not isinstance(s.running, (list, tuple)):
                raise UserError(f"{where}: sample {i} has running {s.running!r}; must be a non-empty list of "
                                f"labels in 0..{k - 1}")
            run = tuple(s.running)
            if not run or any(not _is_int(v) or not 0 <= v < k for v in run):
                raise UserError(f"{where}: sample {i} has running {list(run)}; must be a non-empty list of "
                                f"labels in 0..{k - 1}")
        if s.diff_line is not None and (not _is_int(s.diff_line) or s.diff_line < 0 or (
                s.running is not None and s.diff_line >= len(s.running))):
            raise UserError(f"{where}: sample {i} has diff_line {s.diff_line!r}; must be an integer >= 0"
                            + (" below len(running)" if s.running is not None else ""))
        pairs.setdefault((s.n_distractors, s.pair_id), []).append(s)
    for (n, pid), members in pairs.items():
        if len(members) != 2:
            raise UserError(f"{where}: pair {pid} (N={n}) has {len(members)} member(s); every pair needs exactly 2")
        a, b = members
        if a.label == b.label:
            raise UserError(f"{where}: the two members of pair {pid} (N={n}) have the same label {a.label}; "
                            "a pair's members must have different labels")
        if a.group_id != b.group_id:
            raise UserError(f"{where}: the two members of pair {pid} (N={n}) are in different groups "
                            f"({a.group_id}, {b.group_id}); a pair must lie in one CV group")
        if a.text == b.text:  # one prompt cannot have two answers; its swap would be an identity patch
            raise UserError(f"{where}: the two members of pair {pid} (N={n}) have the same text but different "
                            "labels; a pair's prompts must differ where its labels do")
    words = tuple(label_words)  # carried by each sample, so Sample.answer / full_text work for any task
    # running as a tuple: a list would make the (frozen) Sample unhashable
    return [s if s.label_words == words and s.answer_sep == answer_sep and not isinstance(s.running, list) else
            dataclasses.replace(s, label_words=words, answer_sep=answer_sep,
                                running=None if s.running is None else tuple(s.running))
            for s in samples]


# ----- JSONL ------------------------------------------------------------------------------------------------
class _Ids:
    def __init__(self):
        self.ids: dict = {}

    def __call__(self, key) -> int:
        return self.ids.setdefault(key, len(self.ids))


def _load_jsonl(spec: str) -> TaskSource:
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"task file {spec} does not exist (a --task ending in .jsonl names a samples file)")
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8-sig")  # a leading byte-order mark (some Windows editors) is not content
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read task file {spec}: {e}") from None
    lines = split_jsonl(text)
    if not lines:
        raise UserError(f"task file {spec} is empty")
    objs = []
    for i, ln in lines:
        obj = loads_user(ln, f"{spec} line {i}")
        if not isinstance(obj, dict):
            raise UserError(f"{spec} line {i}: expected a JSON object, got {type(obj).__name__}")
        objs.append((i, obj))
    i0, header = objs[0]
    if "label_words" not in header or set(header) - HEADER_KEYS:
        raise UserError(f"{spec} line {i0}: the first line must be the header "
                        '{"label_words": [...], "name": ..., "answer_sep": ... (both optional)}, got keys '
                        + ", ".join(sorted(header)))
    words = _check_label_words(header["label_words"], f"{spec} line {i0}")
    sep = _check_answer_sep(header.get("answer_sep", " "), f"{spec} line {i0}")
    name = header.get("name", path.stem)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(f"{spec} line {i0}: name {name!r} must be 1-64 letters, digits, '_', '-' or '.'")
    if name in ALL_TASKS:
        raise UserError(f"{spec} line {i0}: name {name!r} is a built-in task's; choose another "
                        "(set \"name\" in the header or rename the file)")
    if len(objs) < 2:
        raise UserError(f"task file {spec} has a header but no samples")
    pair_ids, group_ids = _Ids(), _Ids()
    samples, where = [], {}
    for i, obj in objs[1:]:
        keys = set(obj)
        missing = SAMPLE_KEYS - keys
        if missing:
            raise UserError(f"{spec} line {i}: missing {', '.join(sorted(missing))} (each sample needs text, "
                            "label, pair, group)")
        unknown = keys - SAMPLE_KEYS - OPTIONAL_KEYS
        if unknown:
            raise UserError(f"{spec} line {i}: unknown key(s) {', '.join(sorted(unknown))} (allowed: "
                            f"{', '.join(sorted(SAMPLE_KEYS | OPTIONAL_KEYS))})")
        for key in ("pair", "group"):
            if not (_is_int(obj[key]) or isinstance(obj[key], str)):
                raise UserError(f"{spec} line {i}: {key} must be an integer or a string, got {obj[key]!r}")
        if not isinstance(obj["text"], str):
            raise UserError(f"{spec} line {i}: text must be a string")
        n = obj.get("n_distractors", 0)
        if not _is_int(n) or n < 0:
            raise UserError(f"{spec} line {i}: n_distractors must be an integer >= 0, got {n!r}")
        running = obj.get("running")
        if running is not None:
            if not isinstance(running, list):
                raise UserError(f"{spec} line {i}: running must be a list of labels, got {running!r}")
            running = tuple(running)
        s = Sample(task=name, text=obj["text"], label=obj["label"], pair_id=pair_ids((n, obj["pair"])),
                   group_id=group_ids(obj["group"]), n_distractors=n, diff_line=obj.get("diff_line"),
                   running=running, label_words=words, answer_sep=sep)
        where[len(samples)] = i
        samples.append(s)
    try:
        validate_samples(samples, words, spec, sep)
    except UserError as e:  # name the line of the offending sample
        m = re.search(r": sample (\d+) ", str(e))
        if m:
            raise UserError(str(e).replace(f": sample {m.group(1)} ", f" line {where[int(m.group(1))]}: sample ",
                                           1)) from None
        raise
    used = {s.label for s in samples}
    if len(used) < len(words):
        unused = [w for j, w in enumerate(words) if j not in used]
        raise UserError(f"{spec}: label word(s) {unused} never occur as a label; every label word needs samples")
    by_n: dict = {}
    for s in samples:
        by_n.setdefault(s.n_distractors, []).append(s)
    counts = tuple(sorted(by_n))

    def make(n_pairs, n_distractors, seed):
        if n_distractors not in by_n:
            raise UserError(f"task file {spec} has no samples with n_distractors = {n_distractors} (it has "
                            f"{', '.join(map(str, counts))})")
        sel = by_n[n_distractors]
        if n_pairs is None:
            return list(sel)
        keep = list(dict.fromkeys(s.pair_id for s in sel))[:n_pairs]
        keep = set(keep)
        return [s for s in sel if s.pair_id in keep]

    return TaskSource("jsonl", spec, loaded=_Loaded(name, words, counts, make, sep),
                      sha256=hashlib.sha256(raw).hexdigest())


# ----- module:function --------------------------------------------------------------------------------------
# Importing the module and calling the generator run the user's code: both run under a time limit (a generator
# that never returns would hang the CLI), and sys.exit() in it becomes a one-line error instead of ending the run
# with status 0 and no results.
FUNCTION_TIME_LIMIT_S = 300


class _TimeUp(BaseException):
    """Raised by the SIGALRM handler; a BaseException so that the user's `except Exception` does not swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):
    """Run the block for at most `seconds` (SIGALRM, so only in the main thread of a POSIX process; elsewhere
    unlimited), else UserError naming the limit. A code that blocks signals inside C cannot be stopped."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    fired, armed = [], [True]

    def on_alarm(signum, frame):
        fired.append(True)
        if armed[0]:
            raise _TimeUp

    t0 = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    # re-fires every second: code that catches one _TimeUp (a bare except) is interrupted again
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        try:
            yield
        finally:
            armed[0] = False  # from here on the handler only records
    except _TimeUp:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:  # an outer timer (e.g. a test runner's), less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)
    if fired:
        raise UserError(f"{what} did not finish within the {seconds:g} s limit for a task's code "
                        "(tasks.custom.FUNCTION_TIME_LIMIT_S)")


def _run_user_code(what: str, call, failed: Callable[[Exception], str]):
    """`call()` under the time limit; sys.exit() and a timeout as one UserError line naming `what`, an exception
    as `failed(e)`."""
    with _time_limit(FUNCTION_TIME_LIMIT_S, what):
        try:
            return call()
        except SystemExit as e:
            raise UserError(f"{what} called sys.exit({e.code!r}); a task's code must return or raise") from None
        except UserError as e:  # the user's code refusing its arguments
            raise UserError(_one_line(f"{what}: {e}")) from None
        except (KeyboardInterrupt, Terminated, _TimeUp):  # Ctrl-C (exit 130), SIGTERM (143); the time limit's signal
            raise
        except BaseException as e:  # a bug in the user's code, even a BaseException of its own: still one line
            raise UserError(_one_line(failed(e))) from None


def _one_line(text: str) -> str:
    return "; ".join(x.strip() for x in text.splitlines() if x.strip())


def _function_loader(spec: str) -> Callable[[], _Loaded]:
    mod_name, func_name = spec.split(":")

    def load() -> _Loaded:
        mod = _run_user_code(f"task {spec}: importing module {mod_name!r}", lambda: importlib.import_module(mod_name),
                             lambda e: f"task {spec}: cannot import module {mod_name!r} ({type(e).__name__}: {e})")
        f = getattr(mod, func_name, None)
        if f is None or not callable(f):
            raise UserError(f"task {spec}: module {mod_name!r} has no function {func_name!r}")
        words = getattr(f, "label_words", None)
        if words is None:
            raise UserError(f"task {spec}: the function needs a label_words attribute (e.g. "
                            f"{func_name}.label_words = (\"0\", \"1\"))")
        words = _check_label_words(tuple(words) if isinstance(words, (list, tuple)) else words, f"task {spec}")
        sep = _check_answer_sep(getattr(f, "answer_sep", " "), f"task {spec}")
        name = getattr(f, "task_name", func_name)
        if not isinstance(name, str) or not _NAME_RE.match(name) or name in ALL_TASKS:
            raise UserError(f"task {spec}: task_name {name!r} must be 1-64 letters, digits, '_', '-' or '.' and "
                            "not a built-in task's name")
        dis = getattr(f, "distractors", None)
        if dis is not None:
            if not isinstance(dis, (list, tuple)) or not dis or any(not _is_int(n) or n < 0 for n in dis):
                raise UserError(f"task {spec}: distractors must be a non-empty list of integers >= 0, got {dis!r}")
            dis = tuple(sorted(set(dis)))

        def generate(n_pairs, n_distractors, seed):
            out = f(n_pairs, n_distractors, seed)
            # an iterator (a generator function's result) runs the user's code as it is consumed: consume it here
            if isinstance(out, Iterable) and not isinstance(out, (str, bytes, dict, list)):
                out = list(out)
            return out

        def make(n_pairs, n_distractors, seed):
            call = f"n_pairs={n_pairs}, N={n_distractors}, seed={seed}"
            out = _run_user_code(f"task {spec} ({call})", lambda: generate(n_pairs, n_distractors, seed),
                                 lambda e: f"task {spec} failed for {call}: {type(e).__name__}: {e}")

            out = validate_samples(out, words, f"task {spec} (N={n_distractors})", sep)
            # what was asked: rows are reported under the requested N, sized by the requested pairs
            wrong = next((s for s in out if s.n_distractors != n_distractors), None)
            if wrong is not None:
                raise UserError(f"task {spec} was asked for N={n_distractors} and returned a sample with "
                                f"n_distractors={wrong.n_distractors} (pair {wrong.pair_id})")
            got = len({s.pair_id for s in out})
            if n_pairs is not None and got != n_pairs:
                raise UserError(f"task {spec} was asked for {n_pairs} pairs (N={n_distractors}) and returned {got}")
            return [s if s.task == name else dataclasses.replace(s, task=name) for s in out]

        return _Loaded(name, words, dis, make, sep)

    return load


def resolve_task(spec) -> TaskSource:
    """A built-in task name (a tracking task with an input variant as ``task@variant``, e.g. ``parity@hold``:
    tasks.tracking.VARIANTS), a ``*.jsonl`` samples file or ``package.module:function`` -> :class:`TaskSource`.

    UserError (one line) on an unknown name or a missing or malformed file; a JSONL file is read and validated
    here. A module:function spec is checked for its syntax only: its module is imported (its code run) by
    ``TaskSource.load()``, and a generator's output validated on every ``make``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UserError("task is empty: give a built-in task, a .jsonl file or package.module:function")
    spec = spec.strip()
    if spec in ALL_TASKS:
        from .language import LANGUAGE_DISTRACTORS, LANGUAGE_N_RANGE

        return TaskSource("builtin", spec, loaded=_Loaded(spec, tuple(LABEL_WORDS[spec]),
                                                          default_distractors=LANGUAGE_DISTRACTORS.get(spec)),
                          min_distractors=LANGUAGE_N_RANGE[spec][0] if spec in LANGUAGE_N_RANGE
                          else int(spec in TRACKING_TASKS))
    if "@" in spec and spec.split("@")[0] in TRACKING_TASKS and not (spec.endswith(".jsonl") and Path(spec).is_file()):
        from .tracking import VARIANTS

        task, variant = spec.split("@", 1)
        if variant not in VARIANTS:
            raise UserError(f"unknown variant {variant!r} of {task}; valid: "
                            + ", ".join(f"{task}@{v}" for v in VARIANTS))
        return TaskSource("builtin", spec, loaded=_Loaded(spec, tuple(LABEL_WORDS[task])), min_distractors=1,
                          variant=variant)
    if spec.endswith(".jsonl") or (Path(spec).suffix and Path(spec).is_file()):
        return _load_jsonl(spec)
    if _FUNC_RE.match(spec):
        return TaskSource("function", spec, loader=_function_loader(spec))  # imported on load()
    raise UserError(f"unknown task {spec!r}; valid tasks: {', '.join(ALL_TASKS)} (a tracking task's input variant as "
                    f"parity@hold: tasks.tracking), a path to a .jsonl samples file, "
                    "or package.module:function (docs/tasks.md)")
