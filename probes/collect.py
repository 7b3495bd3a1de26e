"""Residual-stream collection through nnsight, for every depth 0..L at the probed (last) position.

How it works
    The model (a FullBandwidthLM; plain HF LMs are wrapped with ``fusion=False``) is wrapped once with
    ``nnsight.NNsight``. For each batch ONE trace runs the prefill engine itself,
    ``engine.prefill.prefill_many(model, ids, mask, modes, collect=False)``, as the traced function
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
(embedding, or fused input), depth l = output of block l (depth L is *before* the final norm), in the order of
the samples given (batches are formed by length internally and put back in order).

On-disk cache (:class:`ActivationCache`): one ``<key>.npz`` per (model weights hash, dataset fingerprint,
tokenizer hash, mode, position, collector version), written atomically (``common.io.atomic_write``: a
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
import hashlib
import json
import sys
from pathlib import Path

import nnsight
import numpy as np
import torch
from nnsight import NNsight

from common.errors import UserError
from common.io import atomic_write
from models.full_bandwidth import FullBandwidthLM, decoder_layers
from engine.prefill import pad_left, parse_mode, prefill_many

COLLECT_VERSION = 1  # bump when what is collected changes (invalidates the cache)
POSITION = -1  # the probed position: the shared final token


# ----------------------------------------------------------------------------------------------------------
# which model call of the engine produces each mode's last-position residual
# ----------------------------------------------------------------------------------------------------------
RECIRC_PREFIX = "recirc-"


def is_recirc(mode) -> bool:
    """A recirculated 'mode' (probes.run --recirculate): 'recirc-s:d:alpha:convex|residual'."""
    return str(mode).startswith(RECIRC_PREFIX)


def recirc_spec(mode: str, n_layers: int | None = None):
    from models.recirculation import parse_recirculate

    return parse_recirculate(str(mode)[len(RECIRC_PREFIX):], n_layers)


def mode_name(mode) -> str:
    """Canonical name of a prefill mode or a recirculated mode."""
    return recirc_spec(mode).name if is_recirc(mode) else parse_mode(mode).name


def canonical_modes(modes) -> list[str]:
    """Parse and de-duplicate modes (aliases such as fused-0 / recurrent-0 become 'standard'), keep order."""
    out: list[str] = []
    for m in modes:
        name = mode_name(m)
        if name not in out:
            out.append(name)
    if not out:
        raise UserError("no prefill modes given")
    return out


def call_schedule(modes, T: int) -> tuple[dict[str, int], int]:
    """({mode: index of the engine's model call that computes position -1 for it}, total calls) for
    ``prefill_many(model, ids[:, :T], ..., modes)`` with canonical, de-duplicated ``modes``.

    Mirrors engine/prefill.py: recurrent modes first, in order, each one standard pass with cache (call 0,
    which also serves 'standard') and then min(k, T-1) single-token steps; then the remaining modes in order:
    standard one call, fused-n n+1 calls. Checked against the engine after every trace (see module doc).
    """
    parsed = [parse_mode(m) for m in modes]
    where: dict[str, int] = {}
    idx = 0
    for m in parsed:
        if m.kind == "recurrent":
            k = T - 1 if m.n is None else min(m.n, T - 1)
            if "standard" not in where and any(p.kind == "standard" for p in parsed):
                where["standard"] = idx
            where[m.name] = idx + k
            idx += k + 1
    for m in parsed:
        if m.name in where:
            continue
        if m.kind == "standard":
            where[m.name] = idx
            idx += 1
        else:
            idx += m.n + 1
            where[m.name] = idx - 1
    return where, idx


def _layers_path(model: FullBandwidthLM) -> str:
    layers = decoder_layers(model.lm)
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    raise UserError("cannot locate the decoder blocks inside the model")  # pragma: no cover


class _CallCounter:
    """Counts calls of block 0 (one per model call) with a plain forward pre-hook."""

    def __init__(self, block):
        self.n = 0
        self.handle = block.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self.handle.remove()


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
                per_depth.append(layers[i].output[:, -1])
            got.append(per_depth)
    return got


class Collector:
    """nnsight-wrapped model + batching; ``collect(token_ids, modes)`` -> {mode: float32 [N, L+1, D]}."""

    def __init__(self, model: FullBandwidthLM, batch_size: int = 32, max_batch_tokens: int = 32768,
                 pad_id: int = 0, progress: bool = True):
        if batch_size < 1 or max_batch_tokens < 1:
            raise UserError("batch_size and max_batch_tokens must be positive")
        self.model = model.eval()
        self.envoy = NNsight(self.model)
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
        counter = _CallCounter(decoder_layers(self.model.lm)[0])
        try:
            got = _trace_batch(self.envoy, self.layers, run, ids, mask, steps)
        finally:
            counter.close()
        if counter.n != n_calls or len(got) != len(steps):
            raise RuntimeError(f"{what} made {counter.n} model calls on {ids.shape[1]} columns, the collector "
                               f"expected {n_calls}: update probes.collect")
        return {s: torch.stack([t.detach().float() for t in g], dim=1) for s, g in zip(steps, got)}

    def _collect_recirc(self, ids, mask, mode) -> torch.Tensor:
        """Normal-branch residual at the last column under recirculation (models.recirculation, exact
        sequential engine), read through the same nnsight trace: the engine's last model call computes it."""
        from models.recirculation import RecirculatedLM

        spec = recirc_spec(mode, self.n_layers)
        # Recirculation only uses the LM; a fusion module (if any) is left out, never run.
        rlm = RecirculatedLM(FullBandwidthLM(self.model.lm, fusion=False).eval(), spec)
        T = ids.shape[1]
        cols = torch.tensor([T - 1])

        def run(ids_, mask_):
            return rlm.prefill(ids_, mask_, method="sequential", cols=cols)

        n_calls = 1 if spec.is_identity else T  # identity = the base model's one parallel forward
        return self._traced(run, ids, mask, [n_calls - 1], n_calls, f"recirculation {spec.name}")[n_calls - 1]

    @torch.no_grad()
    def collect_batch(self, ids: torch.Tensor, mask: torch.Tensor, modes) -> dict[str, torch.Tensor]:
        """One left-padded batch -> {mode: [batch, L+1, d_model]} (canonical mode names)."""
        modes = canonical_modes(modes)
        out = {m: self._collect_recirc(ids, mask, m) for m in modes if is_recirc(m)}
        engine = [m for m in modes if not is_recirc(m)]
        if engine:
            out.update(self._collect_engine(ids, mask, engine))
        return {m: out[m] for m in modes}

    def _collect_engine(self, ids: torch.Tensor, mask: torch.Tensor, modes) -> dict[str, torch.Tensor]:
        where, n_calls = call_schedule(modes, ids.shape[1])
        steps = sorted(set(where.values()))

        def run(ids_, mask_):
            return prefill_many(self.model, ids_, mask_, modes, collect=False)

        by_step = self._traced(run, ids, mask, steps, n_calls, f"prefill engine (modes {modes})")
        return {m: by_step[where[m]] for m in modes}

    def collect(self, token_ids: list[list[int]], modes, desc: str = "collect") -> dict[str, np.ndarray]:
        """Token id lists -> {mode: float32 [len(token_ids), L+1, d_model]} in the given sample order."""
        from tqdm.auto import tqdm

        modes = canonical_modes(modes)
        if not token_ids:
            raise UserError("empty dataset: nothing to collect")
        n, depth, d = len(token_ids), self.n_layers + 1, self.model.d_model
        out = {m: np.zeros((n, depth, d), dtype=np.float32) for m in modes}
        batches = self._batches([len(t) for t in token_ids])
        bar = tqdm(batches, desc=desc, unit="batch", disable=not self.progress, file=sys.stderr, leave=False)
        for rows in bar:
            ids, mask = pad_left([token_ids[i] for i in rows], self.pad_id)
            res = self.collect_batch(ids, mask, modes)
            for m in modes:
                out[m][rows] = res[m].cpu().numpy()
        bar.close()
        return out


def collect_activations(model: FullBandwidthLM, token_ids: list[list[int]], modes, batch_size: int = 32,
                        progress: bool = False, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Convenience: ``Collector(model, ...).collect(token_ids, modes)``."""
    return Collector(model, batch_size=batch_size, pad_id=pad_id, progress=progress).collect(token_ids, modes)


# ----------------------------------------------------------------------------------------------------------
# cache keys and the on-disk cache
# ----------------------------------------------------------------------------------------------------------
def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's full serialization (fast tokenizers) or of its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def cache_key(weights: str, dataset: str, tokenizer: str, mode: str) -> str:
    blob = json.dumps({"collect_version": COLLECT_VERSION, "weights": weights, "dataset": dataset,
                       "tokenizer": tokenizer, "mode": mode_name(mode), "position": POSITION},
                      sort_keys=True)
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
                       weights: str | None = None, desc: str = "collect") -> tuple[dict[str, np.ndarray], dict]:
    """Collect ``modes`` for a tokenized dataset, reusing cached modes; returns (acts, {mode: 'hit'|'miss'})."""
    from tasks import dataset_fingerprint

    modes = canonical_modes(modes)
    shape = (len(token_ids), collector.n_layers + 1, collector.model.d_model)
    acts: dict[str, np.ndarray] = {}
    status: dict[str, str] = {}
    keys = {}
    if cache is not None:
        weights = weights or weights_hash(collector.model)
        ds, tk = dataset_fingerprint(samples), tokenizer_hash(tokenizer)
        for m in modes:
            keys[m] = cache_key(weights, ds, tk, m)
            hit = cache.get(keys[m], shape)
            if hit is not None:
                acts[m], status[m] = hit, "hit"
    missing = [m for m in modes if m not in acts]
    if missing:
        new = collector.collect(token_ids, missing, desc=desc)
        for m in missing:
            acts[m], status[m] = new[m], "miss"
            if cache is not None:
                cache.put(keys[m], new[m])
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
                  "input), depth l = output of block l (depth L before the final norm); position = last token",
        "meta": meta,
        "samples": [dict(index=i, **dataclasses.asdict(s)) for i, s in enumerate(samples)],
    }
    atomic_write(npz, write_npz)
    atomic_write(js, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return npz, js
