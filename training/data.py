"""Training data: the micro-batches of a step, a pure function of (seed, step), and one process's share of them.

Every process builds the same global batch and trains its own rows of it (`shard`), so the number of processes
does not change what is trained, and a run can be resumed on another number of them.
"""
from __future__ import annotations

import random
from typing import NamedTuple

import numpy as np
import torch

from common.errors import UserError
from tasks import label_token_ids, make_dataset, prompt_ids, prompt_prefix
from tasks.samples import GROUP_TASKS, REGISTERS, TRACKING_TASKS, WRITES_CHOICES
from tasks.tracking import tracker, tracking_pairs
from training.config import REGISTER_LEVELS, TrainConfig

SHELL_ANSWER_PAIRS = 6  # ordered pairs of different cups: one cycle of the shell game's answer rule
FIXED_POINT = -1  # Batch.warm value: pass 2 fuses the fixed-point states (engine.prefill.fixed_point_top)


class Batch(NamedTuple):
    ids: torch.Tensor  # [batch, pos]
    mask: torch.Tensor  # [batch, pos]
    k: int  # passes
    warm: int  # extra no-grad passes before pass 2; FIXED_POINT: start pass 2 from the exact fixed point
    fuse_from: torch.Tensor  # [batch] first column that may be fused (prefix mixin)
    desc: str
    label_pos: torch.Tensor  # [batch, pos] bool: the token at this column is a label word
    skip_pos: torch.Tensor | None = None  # [batch, pos] bool: a random task value, not a loss target
    dense: torch.Tensor | None = None  # [batch, pos] target id of the logits AT each column (-100: none)
    # [batch] interchange training: the column at which the row is fed its pair partner's state (row r ^ 1 of a
    # pairs batch) instead of its own, 0 = none (column 0 is never fused); `dense` is the partner's from there on
    swap: torch.Tensor | None = None
    # decoy training: [batch, pos] bool, the columns whose cached keys/values are computed from row
    # decoy_donor[r]'s fed state (another row of the micro-batch) while the row's recurrence goes on from its own
    decoy: torch.Tensor | None = None
    decoy_donor: torch.Tensor | None = None  # [batch]


def value_token_ids(tok) -> list[int]:
    """Ids of the task's random value symbols (digits, register names): uniformly random by construction."""
    vocab = tok.get_vocab()
    return sorted(vocab[t] for t in [*map(str, range(10)), *REGISTERS] if t in vocab)


def _n_mixture(cfg: TrainConfig, step: int) -> tuple[list[int], np.ndarray]:
    """(N values, probabilities) for this step: the curriculum keeps only N <= curriculum_max_n."""
    distractors = cfg.distractors
    if cfg.length_doubling:
        top = cfg.length_start * 2 ** min(step // cfg.length_doubling, 30)
        distractors = {n: w for n, w in distractors.items() if n <= top} or {min(distractors): 1.0}
    if step < cfg.curriculum_steps:
        distractors = {n: w for n, w in distractors.items() if n <= cfg.curriculum_max_n} or distractors
    ns = sorted(distractors)
    return ns, np.array([distractors[k] for k in ns]) / sum(distractors.values())


def _register_level(cfg: TrainConfig, step: int, rng) -> tuple[int, int | None]:
    """(registers, writes) of a multi_register training sample at this step: the task's own (8, one of 2/4/8)
    after the curriculum; during it a level drawn uniformly from the first ones, one more level every
    register_curriculum / len(REGISTER_LEVELS) steps. The plain lookups stay in the mix until the end: with the
    other tasks in the batch the lookup circuit formed later than a fixed ramp moved on (docs/recipe.md)."""
    if step >= cfg.register_curriculum:
        return len(REGISTERS), int(rng.choice(list(WRITES_CHOICES)))
    top = step * len(REGISTER_LEVELS) // cfg.register_curriculum
    return REGISTER_LEVELS[int(rng.integers(top + 1))]


def _passes(cfg: TrainConfig, step: int, rng) -> tuple[int, int]:
    """(K passes, warm no-grad passes) drawn for this step; 1 pass during the curriculum."""
    k = int(rng.choice(len(cfg.probs), p=np.array(cfg.probs))) + 1
    if step < cfg.curriculum_steps:
        k = 1  # feedback passes only once the standard pass has learned the tasks (as the paper's warm start)
    warm = int(rng.integers(1, cfg.warm_passes + 1)) if (k > 1 and cfg.warm_passes and rng.random() < cfg.warm_prob) else 0
    # Drawn only when the option is on, so the batches of recipes without it are unchanged.
    if k > 1 and cfg.fixed_point_prob > 0 and rng.random() < cfg.fixed_point_prob:
        warm = FIXED_POINT
    return k, warm


def _value_targets(ids: torch.Tensor, label_pos: torch.Tensor, tok) -> torch.Tensor:
    # With tied embeddings, uniformly random targets drive the embeddings of exactly the symbols the tasks
    # must tell apart towards one vector (measured: digit embeddings at cosine 0.99 after 750 steps, and
    # every label at chance); they carry no learnable signal, so they are not targets. Labels stay.
    return torch.isin(ids, torch.tensor(value_token_ids(tok))) & ~label_pos


def _answer_pos(ids: torch.Tensor, tok) -> torch.Tensor:
    """[batch, pos] bool: tokens right after "value :", i.e. the answers of multi_register queries (the final
    one and the training-only reads inside the history)."""
    v, c = (tok.convert_tokens_to_ids(t) for t in ("value", ":"))
    out = torch.zeros_like(ids, dtype=torch.bool)
    out[:, 2:] = (ids[:, :-2] == v) & (ids[:, 1:-1] == c)
    return out


def _training_pair(cfg: TrainConfig, task: str, n: int, rng, **kw) -> list:
    """One training pair of `task` (both members), drawn from `rng`.

    make_dataset's first pair always has the first answers of the task's rule: labels 0 / 1, which for the
    shell game means the ball never ends under cup C (tasks.generators._SHELL_LABELS). `all_answers` draws the
    pair from a whole cycle of the rule instead (all six ordered answer pairs); off, the stream of earlier runs
    is kept. s5 / a5 and any variant (`cfg.variants`) are built by tasks.tracking, one pair at a drawn place in
    the label cycle.
    """
    seed = int(rng.integers(2**31))
    if task in GROUP_TASKS or (task in TRACKING_TASKS and (cfg.variants is not None or cfg.heldout_split)):
        # the variant is drawn only when the option is on, so the batches of recipes without it are unchanged
        variant = "uniform"
        if cfg.variants is not None:
            names = list(cfg.variants)
            w = np.array([cfg.variants[v] for v in names])
            variant = names[int(rng.choice(len(names), p=w / w.sum()))]
        cycle = len(tracker(task).labels)
        # s5 / a5 always: their label cycle's first entry alone would never answer cups 2-4
        offset = int(rng.integers(cycle)) if cfg.all_answers or task in GROUP_TASKS else 0
        return tracking_pairs(task, 1, n, random.Random(seed), variant, label_offset=offset,
                              exclude_heldout=cfg.heldout_split)
    if not (cfg.all_answers and task == "shell_game"):
        return make_dataset(task, 1, n, seed=seed, **kw)
    cycle = make_dataset(task, SHELL_ANSWER_PAIRS, n, seed=seed, **kw)
    j = int(rng.integers(SHELL_ANSWER_PAIRS))
    return cycle[2 * j:2 * j + 2]


def longest_sample(cfg: TrainConfig, tok, pairs: int = 8) -> int:
    """Tokens of the longest of `pairs` training pairs per task drawn at the mixture's largest N (the BOS included,
    where there is one): what an unpacked row (one sample per row) reaches. A draw of its own generator, so the
    batches are untouched; a probe, not a bound (multi_register's reads vary the length): training checks every
    batch too."""
    rng = np.random.default_rng([cfg.seed, 0, 0, 2])
    lead, n = prompt_prefix(tok), max(cfg.distractors)
    longest = 0
    for task in cfg.tasks:
        reads = cfg.reads if task == "multi_register" else 0
        writes = max(WRITES_CHOICES) if task == "multi_register" else None
        for _ in range(pairs):
            for s in _training_pair(cfg, task, n, rng, writes=writes, reads=reads, registers=len(REGISTERS)):
                longest = max(longest, len(prompt_ids(tok, s.full_text, lead)))
    return longest


def make_batch(cfg: TrainConfig, tok, step: int) -> Batch:
    """Deterministic packed batch for (seed, step): the global batch of every process (see `shard`).

    Rows of exactly `cfg.seq_len` tokens, each a stream of samples (full text + newline) with task, N and
    writes drawn per sample, so every batch mixes all tasks with no padding (attention keeps its fast causal
    path). One task per batch instead stalled learning on a plateau: see the model card.
    """
    # The 0 held the process's rank when every process drew a batch of its own: kept, so the batches stay the same.
    rng = np.random.default_rng([cfg.seed, step, 0])
    ns, p_n = _n_mixture(cfg, step)
    seq_len = min(cfg.seq_len, cfg.curriculum_seq_len) if step < cfg.curriculum_steps else cfg.seq_len
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    lead = prompt_prefix(tok)  # a BOS before each sample, where the tokenizer puts one before a text
    rows = max(1, cfg.batch_tokens // seq_len)
    ids = torch.empty(rows, seq_len, dtype=torch.long)
    label_pos = torch.zeros(rows, seq_len, dtype=torch.bool)
    for r in range(rows):
        stream, labels = [], []
        while len(stream) < seq_len:
            task = str(rng.choice(list(cfg.tasks)))
            n = int(rng.choice(ns, p=p_n))
            registers, writes = _register_level(cfg, step, rng) if task == "multi_register" else (len(REGISTERS), None)
            sample = _training_pair(cfg, task, n, rng, writes=writes, registers=registers)[int(rng.integers(2))]
            toks = prompt_ids(tok, sample.full_text, lead)  # each sample as analysis reads it
            labels.append(len(stream) + len(toks) - 1)
            stream += toks + newline
        ids[r] = torch.as_tensor(stream[:seq_len])
        label_pos[r, [p for p in labels if p < seq_len]] = True
    mask = torch.ones_like(ids)
    skip_pos = _value_targets(ids, label_pos, tok) if cfg.skip_values else None
    k, warm = _passes(cfg, step, rng)
    # Prefix mixin: a random-length prefix per row keeps plain embeddings (prompt prefilled normally).
    prefix = np.where(rng.random(rows) < cfg.prefix_mix, (rng.random(rows) * seq_len).astype(int), 0)
    return Batch(ids, mask, k, warm, torch.as_tensor(prefix), f"packed/k={k}", label_pos, skip_pos)


def make_batches(cfg: TrainConfig, tok, step: int) -> list[Batch]:
    """The micro-batches of one optimizer step, a pure function of (seed, step): the global batch, whatever the
    number of processes (each trains its rows of it, `shard`), so that it does not change what is trained.

    packing=True: one packed batch (`make_batch`). packing=False: one micro-batch per task, each of
    ~batch_tokens/len(tasks) tokens, ONE sample per row (the prompt's own context only, as at evaluation) and
    one N (and writes) per micro-batch, so rows have equal length (but for multi_register's, whose reads make them
    differ by a few tokens: right-padded, `real` marks the tokens; the loss skips the padding, the consistency
    term, the fixed-point stopping test and the state noise count it), fast causal attention. In
    packed rows the label position also attends to every earlier sample in the row (same symbols, other
    values): measured here, labels then stayed at chance for 1000+ steps.
    """
    if cfg.packing:
        return [make_batch(cfg, tok, step)]
    rng = np.random.default_rng([cfg.seed, step, 0, 1])  # 0: as in make_batch
    ns, p_n = _n_mixture(cfg, step)
    k, warm = _passes(cfg, step, rng)
    pad = tok.pad_token_id or 0
    lead = prompt_prefix(tok)  # a BOS before each sample, where the tokenizer puts one before a text
    out = []
    shares = np.array(cfg.task_weights or [1.0] * len(cfg.tasks))
    shares = shares / shares.sum()
    for task, share in zip(cfg.tasks, shares):
        n = int(rng.choice(ns, p=p_n))
        registers, writes = _register_level(cfg, step, rng) if task == "multi_register" else (len(REGISTERS), None)
        reads = cfg.reads if task == "multi_register" else 0
        seqs, samples = [], []
        while True:
            pair = _training_pair(cfg, task, n, rng, writes=writes, reads=reads, registers=registers)
            chosen = pair if cfg.pairs else [pair[int(rng.integers(2))]]
            samples += chosen
            seqs += [prompt_ids(tok, s.full_text, lead) for s in chosen]
            if sum(map(len, seqs)) + len(seqs[-1]) * len(chosen) > cfg.batch_tokens * share:
                break
        T = max(map(len, seqs))
        # Rows differ in length where the task's prompts do (multi_register's reads: ~1 micro-batch in 7 of
        # tiny-fbt's, half of tiny-fbt-group's). Right padding is never attended to by real tokens under causal
        # attention, and pad targets are skipped; but the batch mask is all ones, so the pad columns count as fused
        # positions in the consistency term's mean, the fixed-point check and the state noise (~1% of the
        # consistency term on such a batch). The shipped recipes were trained so; left as it is.
        ids = torch.full((len(seqs), T), pad, dtype=torch.long)
        label_pos = torch.zeros(len(seqs), T, dtype=torch.bool)
        real = torch.zeros(len(seqs), T, dtype=torch.bool)
        for r, sq in enumerate(seqs):
            ids[r, :len(sq)] = torch.as_tensor(sq)
            label_pos[r, len(sq) - 1] = True
            real[r, :len(sq)] = True
        if reads:
            label_pos |= _answer_pos(ids, tok)
        dense = _dense_targets(samples, seqs, T, tok, task, cfg.dense_every) if cfg.dense_targets else None
        skip_pos = ~real
        if cfg.skip_values:
            skip_pos |= _value_targets(ids, label_pos, tok)
        prefix = np.where(rng.random(len(seqs)) < cfg.prefix_mix, (rng.random(len(seqs)) * T).astype(int), 0)
        swap = None
        if cfg.interchange:
            if any(len(a) != len(b) for a, b in zip(seqs[::2], seqs[1::2])):
                raise UserError(f"interchange needs pair members of one token length ({task} has pairs that differ)")
            swap, dense = _interchange(ids, dense, [len(sq) for sq in seqs[::2]], cfg.interchange,
                                       np.random.default_rng([cfg.seed, step, 0, 2, len(out)]))
        decoy = donor = None
        if cfg.decoy and len(seqs) > 1:
            decoy, donor = _decoy(min(map(len, seqs)), T, len(seqs), cfg.decoy,
                                  np.random.default_rng([cfg.seed, step, 0, 3, len(out)]))
        out.append(Batch(ids, torch.ones_like(ids), k, warm, torch.as_tensor(prefix),
                         f"{task}/N={n}/k={k}", label_pos, skip_pos, dense, swap, decoy, donor))
    return out


def _interchange(ids: torch.Tensor, dense: torch.Tensor, lengths, frac: float, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """(swap [rows], dense [rows, T]) of interchange training on a pairs batch (rows 2i, 2i + 1 are a pair, of
    lengths[i] real tokens each, right-padded to T).

    A fraction `frac` of the pairs exchange their fed states at one column c drawn uniformly from the columns
    after their last differing input token (the answer, the rows' last column, excluded; the shell game's lines
    differ in up to two cups) up to the prompt's final ":"; both members alike. From c on the rows' tokens are
    the same, so the right answer of a row fed its partner's state is the partner's: the targets at columns >= c
    (padding has none) are the partner's. (A column between two differing tokens has no such answer: the row would read its own
    second cup with its partner's first.) The rng is its own stream (not the data's), so a twin trained without
    interchange sees the same rows.
    """
    rows, T = ids.shape
    swap = torch.zeros(rows, dtype=torch.long)
    dense = dense.clone()
    cols = torch.arange(T)
    for i, L in zip(range(0, rows, 2), lengths):
        diff = (ids[i, :L - 1] != ids[i + 1, :L - 1]).nonzero()  # the inputs: the answer column left out
        if len(diff) == 0 or rng.random() >= frac:
            continue
        last = int(diff[-1])
        if last + 1 > L - 2:
            continue
        c = int(rng.integers(last + 1, L - 1))  # uniform over last + 1 .. L - 2 (the ":" that predicts the answer)
        swap[i] = swap[i + 1] = c
        after = cols >= c
        a, b = dense[i].clone(), dense[i + 1].clone()
        dense[i, after], dense[i + 1, after] = b[after], a[after]
    return swap, dense


def _decoy(L: int, T: int, rows: int, frac: float, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """(cols [rows, T] bool, donor [rows]) of decoy training: each column 1 .. L-3 (L: the shortest row; L-2, the
    final ":", is read only by the answer's column, which has no target) with probability `frac`, for every row
    alike (the engine runs such a column twice for the whole micro-batch, so sharing them keeps the cost at
    1 + frac steps); the donors are a shift of the rows, never a row itself. Its own rng stream: the rows and
    targets are the run's without decoys. (A micro-batch of one row has no donor: the caller gives it none.)"""
    cols = torch.zeros(rows, T, dtype=torch.bool)
    draw = torch.as_tensor(rng.random(max(L - 2, 0)) < frac)  # L-2 draws: the stream of the first decoy runs
    cols[:, 1:L - 2] = draw[:max(L - 3, 0)]
    donor = (torch.arange(rows) + int(rng.integers(1, rows))) % rows
    return cols, donor


def _dense_targets(samples, seqs, T: int, tok, task: str, every: bool = False) -> torch.Tensor:
    """[rows, T] target ids AT each column: the running value's label word at the last token of every update line
    (line i + 1 of the prompt ends before its newline), and the answer at the prompt's last token; -100 elsewhere.
    `every`: also at each column between, the value as of the latest completed line (from the first update line's
    end on), so that every top state fed back reads out, through the LM head, as the running value."""
    words = label_token_ids(tok, task)
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    if len(newline) != 1:
        raise UserError("dense targets need a tokenizer with a newline token")
    out = torch.full((len(seqs), T), -100, dtype=torch.long)
    for r, (s, sq) in enumerate(zip(samples, seqs)):
        ends = [j - 1 for j, t in enumerate(sq) if t == newline[0]]  # last token of each line
        for i, j in enumerate(ends[1:1 + len(s.running)]):
            out[r, j] = words[s.running[i]]
            if every:  # to the next line's end (exclusive), or through the query line for the last update
                stop = ends[i + 2] if i + 1 < len(s.running) else len(sq) - 2
                out[r, j:stop] = words[s.running[i]]
        out[r, len(sq) - 2] = words[s.label]  # the prompt's final ":" predicts the answer (the row's last token)
    return out


# Batch's per-row tensors (decoy_donor holds row numbers of the whole micro-batch: one process only, not sharded)
ROW_FIELDS = ("ids", "mask", "fuse_from", "label_pos", "skip_pos", "dense", "swap", "decoy")


def has_rows(n: int, rank: int, world: int) -> bool:
    """Whether process `rank` has rows of its own in a global micro-batch of n rows (always, unless n < world)."""
    return (rank + 1) * n // world > rank * n // world


def rows_of(n: int, rank: int, world: int) -> slice:
    """Process `rank`'s rows of a global micro-batch of n rows: contiguous, shares differing by at most one row.
    With fewer rows than processes, a process without rows of its own gets the last row again, weighted 0
    (training.loss.share_of): every process must run every micro-batch, as DDP all-reduces over all of them."""
    return slice(rank * n // world, (rank + 1) * n // world) if has_rows(n, rank, world) else slice(n - 1, n)


def shard(mb: Batch, rank: int, world: int) -> Batch:
    """Process `rank`'s rows of the global micro-batch `mb` (every per-row tensor sliced alike)."""
    rows = rows_of(mb.ids.shape[0], rank, world)
    return mb._replace(**{name: getattr(mb, name)[rows] for name in ROW_FIELDS if getattr(mb, name) is not None})
