"""Residual-stream collection through nnsight, for every depth 0..L at the probed (last) position.

How it works
    The model (a FullBandwidthLM; plain HF LMs are wrapped with ``fusion=False``) is wrapped once with
    ``nnsight.NNsight`` (nnsight's wrapper is taken off the caller's model again once no collector uses it:
    ``_wrap``; a collection runs in eval mode and leaves every module's mode as it was). For each batch ONE
    trace runs the prefill engine itself,
    ``engine.prefill.prefill_many(model, ids, mask, modes, collect=False, logits=False)``, as the traced function
    (``envoy.trace(ids, mask, fn=...)``): there is a single prefill engine, nnsight only reads from it.
    The engine calls the model several times (recurrent-k: one full standard pass, then k single-token
    steps; fused-n: n+1 parallel passes); every call is one *occurrence* of each block. The residual at the
    last position for a mode is produced by the engine's last model call for that mode, so the trace body
    reads, with ``tracer.iter[[occurrences]]``, the input of block 0 (depth 0) and the output of every block
    (depths 1..L; transformers 5 blocks return a plain tensor) at column -1 of exactly those calls.
    :func:`call_schedule` says which occurrence belongs to which mode; a plain forward-hook counter checks
    after every trace that the engine made exactly the calls the schedule expects, so a change in the
    engine fails loudly instead of silently reading the wrong call.

Layout of collected activations: ``float32 [samples, depths, d_model]``, depth 0 = vector entering block 0
(embedding, or fused input), depth l = output of 0-based block l - 1, the input of block l (depth L is *before* the
final norm), in the order of the samples given (batches are formed by length internally and put back in order).

On-disk cache (:class:`ActivationCache`): one ``<key>.npz`` per (model weights hash, config hash, dataset
fingerprint, tokenizer hash, mode, position, collector version), written atomically (``common.io.atomic_write``: a
temporary file of a unique name + ``os.replace``), reused when the key matches. Concurrent processes are safe
without a lock: a reader opens either the old complete file or the new complete one (a file it holds open
stays intact when replaced), two writers of one entry write the same bytes and the last rename wins, and an
unreadable entry is a miss. Exports (:func:`save_activations`): ``<stem>.npz`` holding ``resid``
[samples, depths, d_model] float32 plus ``label``, ``group_id``, ``pair_id``, ``n_distractors``, ``writes``,
``n_tokens`` (int64 [samples]), and ``<stem>.json`` beside it with ``meta`` (model, mode, depth convention)
and ``samples`` (one dict per row of ``resid``: index, task, text, label, pair_id, group_id, n_distractors,
writes, n_tokens).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import weakref
from pathlib import Path

import nnsight
import numpy as np
import torch
from nnsight import NNsight

from common.errors import UserError
from common.io import atomic_write
from models.fingerprint import config_hash, tokenizer_hash, weights_hash
from models.full_bandwidth import FullBandwidthLM, decoder_layers
from engine.hooks import CallCounter
from engine.inputs import eval_mode
from engine.modes import canonical_modes, parse_mode
from engine.prefill import call_schedule, pad_left, prefill_many

COLLECT_VERSION = 1  # bump when what is collected changes (invalidates the cache)
POSITION = -1  # the probed position: the shared final token


def _layers_path(model: FullBandwidthLM) -> str:
    layers = decoder_layers(model.lm)
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    raise UserError("cannot locate the decoder blocks inside the model")  # pragma: no cover


def _trace_batch(envoy, layers, run, ids, mask, steps):
    """One nnsight trace of ``run(ids, mask)``: residual at column -1 at the given call occurrences.

    Returns a list (one per step) of lists (one per depth) of tensors [batch, d_model].
    This body must live in a real file: nnsight reads its source.
    """
    with envoy.trace(ids, mask, fn=run) as tracer:
        got = nnsight.save([])
        for _ in tracer.iter[list(steps)]:
            per_depth = [layers[0].input[:, -1]]
            for i in range(len(layers)):
                out = layers[i].output
                out = out[0] if isinstance(out, tuple) else out  # a block returning a tuple (GPT-Neo)
                per_depth.append(out[:, -1])
            got.append(per_depth)
    return got


try:
    from nnsight.intervention.source import STATE as _NNSIGHT_STATE
except ImportError:  # pragma: no cover - another nnsight layout: its wrapper stays on the model, as nnsight leaves it
    _NNSIGHT_STATE = None
_NO_FORWARD = object()
# modules whose nnsight wrapper a Collector installed: [collectors alive that use it, the instance forward it took]
_WRAPPED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
_OURS: "weakref.WeakSet" = weakref.WeakSet()  # the collectors' own interleavers


def _wrap(collector, model):
    """``NNsight(model)`` for `collector`, undone once no collector uses it. nnsight installs its wrapper for good
    (an instance ``forward`` and its state on every module: inert outside a trace, but the model then never takes
    the lean one-token step, models.lean_step, ~1.5-2x slower recurrences on the tiny models); each module a
    collector wrapped gets its own forward back when the last collector using it is gone, unless an nnsight
    wrapper of someone else's routes through it too."""
    if _NNSIGHT_STATE is None:  # pragma: no cover
        return NNsight(model)
    fresh = [(m, vars(m).get("forward", _NO_FORWARD)) for m in model.modules() if _NNSIGHT_STATE not in vars(m)]
    envoy = NNsight(model)
    _OURS.add(envoy.interleaver)
    for m, forward in fresh:
        if _NNSIGHT_STATE in vars(m):
            _WRAPPED[m] = [0, forward]
    held = [m for m in model.modules() if m in _WRAPPED]
    for m in held:
        _WRAPPED[m][0] += 1
    weakref.finalize(collector, _unwrap, held)
    return envoy


def _unwrap(modules) -> None:
    for m in modules:
        entry = _WRAPPED.get(m)
        if entry is None:
            continue
        entry[0] -= 1
        state = vars(m).get(_NNSIGHT_STATE)
        others = state is not None and any(
            (i := r[0]()) is not None and i not in _OURS for r in getattr(state, "routes", ()))
        if entry[0] > 0 or others:
            continue
        del _WRAPPED[m]
        d = vars(m)
        d.pop(_NNSIGHT_STATE, None)
        if entry[1] is _NO_FORWARD:
            d.pop("forward", None)
        else:
            d["forward"] = entry[1]


class Collector:
    """nnsight-wrapped model + batching; ``collect(token_ids, modes)`` -> {mode: float32 [N, L+1, D]}."""

    def __init__(self, model: FullBandwidthLM, batch_size: int = 32, max_batch_tokens: int = 32768,
                 pad_id: int = 0, progress: bool = True):
        if batch_size < 1 or max_batch_tokens < 1:
            raise UserError("batch_size and max_batch_tokens must be positive")
        self.model = model  # in eval mode while it collects, then as the caller had it (engine.inputs.eval_mode)
        self.envoy = _wrap(self, self.model)
        self.layers = self.envoy.get(_layers_path(self.model))
        self.n_layers = len(decoder_layers(self.model.lm))
        self.batch_size, self.max_batch_tokens = int(batch_size), int(max_batch_tokens)
        self.pad_id, self.progress = int(pad_id), progress

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # by length: little padding
        out, cur = [], []
        for i in order:
            if cur and (len(cur) >= self.batch_size or (len(cur) + 1) * lengths[i] > self.max_batch_tokens):
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
        return out

    def _traced(self, run, ids, mask, steps, n_calls, what):
        with CallCounter(self.model) as counter:
            got = _trace_batch(self.envoy, self.layers, run, ids, mask, steps)
        if counter.n != n_calls or len(got) != len(steps):
            raise RuntimeError(f"{what} made {counter.n} model calls on {ids.shape[1]} columns, the collector "
                               f"expected {n_calls}: update probes.collect")
        return {s: torch.stack([t.detach().float() for t in g], dim=1) for s, g in zip(steps, got)}

    def _loop_collector(self, r: int) -> "Collector":
        """A collector of the looped model re-unrolled to r iterations (a loop-R mode): its own nnsight wrapper,
        built while the model holds that unrolling (LoopedLM keeps one block list per r, so it stays valid)."""
        from models.looped import looping, require_looped

        subs = self.__dict__.setdefault("_loops", {})
        if r not in subs:
            with looping(require_looped(self.model, f"loop-{r}"), r):
                subs[r] = Collector(self.model, self.batch_size, self.max_batch_tokens, self.pad_id, False)
        return subs[r]

    def depth_of(self, mode) -> int:
        """Depths 0..L of `mode`'s stack (a loop-R mode: the unrolled one) + 1."""
        m = parse_mode(mode)
        r = m.loop_iterations
        return (self._loop_collector(r).n_layers if r is not None else self.n_layers) + 1

    @torch.no_grad()
    def collect_batch(self, ids: torch.Tensor, mask: torch.Tensor, modes) -> dict[str, torch.Tensor]:
        """One left-padded batch -> {mode: [batch, L+1, d_model]} (canonical mode names; a loop-R mode's L is its
        unrolled stack's)."""
        with eval_mode(self.model):
            return self._collect_batch(ids, mask, modes)

    def _collect_batch(self, ids, mask, modes) -> dict[str, torch.Tensor]:
        from models.looped import looping

        modes = canonical_modes(modes, self.n_layers)
        adaptive = [m for m in modes if parse_mode(m).adaptive_exit is not None]
        if adaptive:
            raise UserError(f"{adaptive[0]} runs every prompt to its own exit (a different stack per prompt): an "
                            "evaluation mode; probe a fixed loop-R instead")
        loops = [m for m in modes if parse_mode(m).loop_iterations is not None]
        out = {}
        for m in loops:  # each at its own unrolling, as standard there
            r = parse_mode(m).loop_iterations
            sub = self._loop_collector(r)
            with looping(self.model, r):
                out[m] = sub.collect_batch(ids, mask, ["standard"])["standard"]
        modes = [m for m in modes if m not in loops]
        if not modes:
            return out
        where, n_calls = call_schedule(modes, ids.shape[1], self.n_layers)
        steps = sorted(set(where.values()))

        def run(ids_, mask_):  # residuals only: no LM head (21-28% of a SmolLM2 pass)
            return prefill_many(self.model, ids_, mask_, modes, collect=False, logits=False)

        by_step = self._traced(run, ids, mask, steps, n_calls, f"the engine (modes {', '.join(modes)})")
        return {**out, **{m: by_step[where[m]] for m in modes}}

    def collect(self, token_ids: list[list[int]], modes, desc: str = "collect", procs=None
                ) -> dict[str, np.ndarray] | None:
        """Token id lists -> {mode: float32 [len(token_ids), L+1, d_model]} in the given sample order.

        `procs` (common.distributed.Processes, under torchrun): the batches are formed over all samples exactly
        as in one process and dealt out to the processes, each runs its own through the engine, and rank 0
        gathers them: the same batches, so the same numbers. Returns None on the other ranks."""
        from tqdm.auto import tqdm

        modes = canonical_modes(modes, self.n_layers)
        if not token_ids:
            raise UserError("empty dataset: nothing to collect")
        batches = self._batches([len(t) for t in token_ids])
        if procs is not None and procs.world > 1:
            batches = procs.share(batches)
        rows_mine = [i for rows in batches for i in rows]
        where = {i: j for j, i in enumerate(rows_mine)}
        n, d = len(token_ids), self.model.d_model
        out = {m: np.zeros((len(rows_mine), self.depth_of(m), d), dtype=np.float32) for m in modes}
        bar = tqdm(batches, desc=desc, unit="batch", disable=not self.progress, file=sys.stderr, leave=False)
        for rows in bar:
            ids, mask = pad_left([token_ids[i] for i in rows], self.pad_id)
            res = self.collect_batch(ids, mask, modes)
            for m in modes:
                out[m][[where[i] for i in rows]] = res[m].float().cpu().numpy()
        bar.close()
        if procs is not None and procs.world > 1:
            return procs.gather_rows(out, rows_mine, n)
        order = np.argsort(rows_mine)  # one process: rows_mine is a permutation of 0..n-1
        return {m: a[order] for m, a in out.items()}


def collect_activations(model: FullBandwidthLM, token_ids: list[list[int]], modes, batch_size: int = 32,
                        progress: bool = False, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Convenience: ``Collector(model, ...).collect(token_ids, modes)``."""
    return Collector(model, batch_size=batch_size, pad_id=pad_id, progress=progress).collect(token_ids, modes)


# ----------------------------------------------------------------------------------------------------------
# cache keys and the on-disk cache
# ----------------------------------------------------------------------------------------------------------
def tokenization_hash(tokenizer) -> str:
    """``tokenizer_hash``, and the prompts' special prefix (``tasks.prompt_prefix``, a BOS) where there is one:
    prompts were tokenized without it before, so a tokenizer that adds one shares no cache entry and no run with
    those; every other tokenizer keeps its keys."""
    from tasks import prompt_prefix

    prefix = prompt_prefix(tokenizer)
    return tokenizer_hash(tokenizer) + (f"+prefix{prefix}" if prefix else "")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the code that computes an activation (every .py file of engine/ and models/, this module) and of
    the torch and transformers versions: a change to any of them is another computation, so no cached activation
    of the old one is served (a fusion edit was a hit, 0.10 off). Read once per process (~50 small files)."""
    import transformers

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    files = sorted([*(root / "engine").glob("*.py"), *(root / "models").glob("*.py"), Path(__file__).resolve()])
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_key(weights: str, config: str, dataset: str, tokenizer: str, mode: str) -> str:
    blob = json.dumps({"collect_version": COLLECT_VERSION, "code": code_version(), "weights": weights,
                       "config": config, "dataset": dataset, "tokenizer": tokenizer, "mode": parse_mode(mode).name,
                       "position": POSITION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class ActivationCache:
    """``<dir>/<key>.npz`` files holding ``resid`` float32 [samples, depths, d_model]."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.npz"

    def get(self, key: str, shape: tuple | None = None) -> np.ndarray | None:
        p = self.path(key)
        if not p.is_file():
            return None
        try:
            with np.load(p) as z:
                arr = z["resid"]
        except Exception:  # a corrupt or foreign file is just a miss; it is rewritten atomically
            return None
        if shape is not None and tuple(arr.shape) != tuple(shape):
            return None
        return arr

    def put(self, key: str, resid: np.ndarray) -> Path:
        p = self.path(key)

        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, resid=np.ascontiguousarray(resid, dtype=np.float32))

        atomic_write(p, write)
        return p


def collect_with_cache(collector: Collector, token_ids, samples, modes, tokenizer, cache: ActivationCache | None,
                       weights: str | None = None, desc: str = "collect", procs=None
                       ) -> tuple[dict[str, np.ndarray] | None, dict]:
    """Collect ``modes`` for a tokenized dataset, reusing cached modes; returns (acts, {mode: 'hit'|'miss'}).

    Under torchrun (`procs`): rank 0 decides the cache hits for everyone, the misses are collected sharded
    (Collector.collect), and only rank 0 writes the cache and gets the activations (None elsewhere)."""
    from tasks import dataset_fingerprint

    modes = canonical_modes(modes)
    acts: dict[str, np.ndarray] = {}
    status: dict[str, str] = {}
    keys = {}
    if cache is not None:
        weights = weights or weights_hash(collector.model)
        ds, tk, cfg = dataset_fingerprint(samples), tokenization_hash(tokenizer), config_hash(collector.model)
        for m in modes:
            keys[m] = cache_key(weights, cfg, ds, tk, m)
            hit = cache.get(keys[m], (len(token_ids), collector.depth_of(m), collector.model.d_model))
            if hit is not None:
                acts[m], status[m] = hit, "hit"
    missing = [m for m in modes if m not in acts]
    if procs is not None and procs.world > 1:
        missing = procs.broadcast(missing)  # one decision: a cache written meanwhile must not split the ranks
    if missing:
        new = collector.collect(token_ids, missing, desc=desc, procs=procs)
        if new is None:  # not rank 0
            return None, {m: "miss" if m in missing else "hit" for m in modes}
        for m in missing:
            acts[m], status[m] = new[m], "miss"
            if cache is not None:
                cache.put(keys[m], new[m])
    elif procs is not None and not procs.is_main:
        return None, status
    return {m: acts[m] for m in modes}, status


# ----------------------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------------------
def save_activations(directory: str | Path, stem: str, resid: np.ndarray, samples, meta: dict) -> tuple[Path, Path]:
    """Write ``<stem>.npz`` (resid [samples, depths, d_model] + per-sample int arrays) and ``<stem>.json``."""
    directory = Path(directory)
    samples = list(samples)
    if resid.shape[0] != len(samples):
        raise UserError(f"{resid.shape[0]} activation rows for {len(samples)} samples")
    arrays = {
        "resid": np.ascontiguousarray(resid, dtype=np.float32),
        "label": np.array([s.label for s in samples], dtype=np.int64),
        "group_id": np.array([s.group_id for s in samples], dtype=np.int64),
        "pair_id": np.array([s.pair_id for s in samples], dtype=np.int64),
        "n_distractors": np.array([s.n_distractors for s in samples], dtype=np.int64),
        "writes": np.array([s.writes for s in samples], dtype=np.int64),
        "n_tokens": np.array([-1 if s.n_tokens is None else s.n_tokens for s in samples], dtype=np.int64),
    }
    npz, js = directory / f"{stem}.npz", directory / f"{stem}.json"

    def write_npz(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    doc = {
        "layout": "resid[sample, depth, d_model] float32; depth 0 = input of block 0 (embedding or fused "
                  "input), depth l = output of 0-based block l - 1 (depth L before the final norm); position = "
                  "last token",
        "meta": meta,
        "samples": [dict(index=i, **dataclasses.asdict(s)) for i, s in enumerate(samples)],
    }
    atomic_write(npz, write_npz)
    atomic_write(js, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return npz, js
