"""The one generic patching routine (nnsight) and its thin wrappers, TransformerLens style.

Every intervention of the suite is a list of `Patch`es handed to `run_patched`, which runs ONE nnsight trace
body (`_traced_forward`) over the whole batch (rows stacked in one input: nnsight cannot batch separate
`tracer.invoke` blocks of a custom module) and returns the logits at the probed position T.

Sites (positions are negative column offsets of the left-padded batch: -1 = T, -2 = T-1)
    state   the state entering the fusion at T (h_{T-1} under recurrent-1): `fusion` input 0
    fused   the fusion's output at T (the fused input u_T of block 0)
    resid   the residual stream at (depth, pos): depth 0 = the vector entering block 0 (embedding or fused
            input), depth l = output of block l (raw, before the final norm), pos in {-2, -1}

Modes
    standard      one parallel forward over the prompt (traced when patched)
    recurrent-1   the engine's one-step recurrent prefill: standard prefill of all T columns with a KV cache,
                  crop the last column, recompute T fused with h_{T-1} = the standard top state at T-1.
                  The clean prefix (cache + h_{T-1}) is computed once per batch and shared by every run
                  that does not patch T-1; the step at T is the traced forward. A patch at T-1 reruns the
                  prefix traced (its keys/values and h_{T-1} change) and then the step at T.
`CausalContext` checks that its clean recurrent-1 logits equal the engine's (`models.prefill`) bit for bit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import nnsight
import numpy as np
import torch
from nnsight import NNsight
from transformers import DynamicCache

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM, decoder_layers

SITES = ("state", "fused", "resid")
MODES = ("standard", "recurrent-1")
POSITIONS = (-2, -1)  # T-1, T
POS_NAMES = {-2: "T-1", -1: "T"}


@dataclass
class Batch:
    """One evaluation set, left-padded so that T is the last column of every row."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B] long, 0/1
    pair: torch.Tensor  # [B] long: row index of the paired sample (opposite label)
    groups: np.ndarray  # [B] cross-validation / bootstrap cluster ids
    label_ids: tuple  # (token id of the label-0 word, token id of the label-1 word)

    def __post_init__(self):
        B = self.input_ids.shape[0]
        if self.input_ids.ndim != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise UserError("input_ids and attention_mask must both be [batch, T]")
        if B < 2 or self.input_ids.shape[1] < 2:
            raise UserError("interventions need at least 2 samples of at least 2 tokens")
        if not bool(self.attention_mask[:, -2:].all()):
            raise UserError("prompts must be left-padded with at least 2 real tokens (T-1 and T) per row")
        self.labels = torch.as_tensor(self.labels, dtype=torch.long)
        self.pair = torch.as_tensor(self.pair, dtype=torch.long)
        self.groups = np.asarray(self.groups)
        if self.labels.shape != (B,) or self.pair.shape != (B,) or self.groups.shape != (B,):
            raise UserError("labels, pair and groups need one entry per row")
        if not bool((self.labels[self.pair] != self.labels).all()):
            raise UserError("every row's pair must have the opposite label")
        if len(self.label_ids) != 2 or self.label_ids[0] == self.label_ids[1]:
            raise UserError("label_ids must be two distinct token ids")

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_samples(cls, samples, tokenizer, task: str) -> "Batch":
        """Tokenize `tasks` samples (adjacent pairs, label 0 first) into a Batch."""
        from models.prefill import pad_left
        from tasks import label_token_ids, tokenize_samples

        ids, samples = tokenize_samples(samples, tokenizer)
        input_ids, mask = pad_left(ids, tokenizer.pad_token_id or 0)
        index = {(s.pair_id, s.label): i for i, s in enumerate(samples)}
        try:
            pair = [index[(s.pair_id, 1 - s.label)] for s in samples]
        except KeyError:
            raise UserError("every sample needs its pair (same pair_id, opposite label) in the dataset") from None
        return cls(input_ids, mask, torch.tensor([s.label for s in samples]), torch.tensor(pair),
                   np.array([s.group_id for s in samples]), tuple(label_token_ids(tokenizer, task)))


@dataclass(frozen=True)
class Patch:
    """Replace the activation at `site` (and `depth`, `pos` for resid) by `value` [B, D], row by row."""

    site: str
    value: torch.Tensor
    depth: int = 0
    pos: int = -1

    def __post_init__(self):
        if self.site not in SITES:
            raise UserError(f"unknown patch site {self.site!r} (use one of {', '.join(SITES)})")
        if self.pos not in POSITIONS:
            raise UserError(f"patch position must be -1 (T) or -2 (T-1), got {self.pos}")
        if self.site != "resid" and self.pos != -1:
            raise UserError(f"site {self.site!r} exists at T only (pos -1)")


@dataclass
class RunOut:
    logits: torch.Tensor  # [B, V] at T
    reads: dict = field(default_factory=dict)  # (depth, pos) -> [B, D]; ("state", -1) -> [B, D] when read


def _envoy_path(model: FullBandwidthLM) -> list[str]:
    layers = decoder_layers(model.lm)
    name = next(n for n, m in model.named_modules() if m is layers)
    return name.split(".")


class CausalContext:
    """A model, a batch, and the shared clean prefix of the recurrent-1 runs."""

    def __init__(self, model: FullBandwidthLM, batch: Batch, check_engine: bool = True):
        self.model = model.eval()
        self.batch = batch
        self.nn = NNsight(model)
        self.n_layers = model.n_layers
        self._layers_path = _envoy_path(model)
        ids, mask = batch.input_ids, batch.attention_mask
        ctx = getattr(model.config, "max_position_embeddings", None)
        if ctx is not None and int(mask.sum(-1).max()) > ctx:
            raise UserError(f"prompts of {int(mask.sum(-1).max())} tokens exceed the model's context ({ctx})")
        with torch.no_grad():
            self.e_T = model.embed(ids[:, -1])  # [B, D] token embedding at T
            self.cache, self.h_prev = self._prefix(ids, mask)
        self.fuse = (mask[:, -2].bool() & mask[:, -1].bool())[:, None]
        self.clean = {m: self.run(m, read=True) for m in (MODES if model.has_fusion else ("standard",))}
        if check_engine:
            self._check_engine()

    # -- prefix ------------------------------------------------------------------------------------------
    def _prefix(self, ids, mask, patches=(), read=False):
        """Standard prefill of all T columns with a cache; crop T. Returns (cache, h_{T-1}[, reads])."""
        cache = DynamicCache(config=self.model.config)
        if patches or read:
            top, reads = self._traced_forward(ids, mask, None, None, cache, patches, read_cols=(-2,) if read else ())
        else:
            top, reads = self.model(ids, mask, cache=cache, use_cache=True).top, {}
        cache.crop(-1)
        h_prev = top[:, -2].clone()
        return (cache, h_prev, reads) if read or patches else (cache, h_prev)

    def _check_engine(self):
        from models.prefill import prefill_many

        modes = list(self.clean)
        ref = prefill_many(self.model, self.batch.input_ids, self.batch.attention_mask, modes, collect=False)
        for m in modes:
            if not torch.equal(ref[m].logits[:, -1], self.clean[m].logits):
                diff = (ref[m].logits[:, -1] - self.clean[m].logits).abs().max().item()
                raise RuntimeError(f"clean {m} logits differ from the prefill engine's by {diff:.3g}")

    # -- THE trace body ----------------------------------------------------------------------------------
    def _layers(self):
        return functools.reduce(getattr, self._layers_path, self.nn)

    def _traced_forward(self, ids, mask, state, fuse, cache, patches, read_cols=()):
        """One traced forward (full prompt or the single step at T) with `patches`; reads at `read_cols`.

        Returns (top [B, q, D] of the run, reads {(depth, pos): [B, D], ("state", -1): [B, D]}). Modules are
        visited in execution order (nnsight requires it): fusion input, fusion output, block 0 input, block
        outputs 1..L.
        """
        by_site = {"state": [], "fused": []}
        resid: dict[int, list] = {}
        for p in patches:
            if p.site == "resid":
                resid.setdefault(p.depth, []).append(p)
            else:
                by_site[p.site].append(p)
        if (by_site["state"] or by_site["fused"]) and state is None:
            raise UserError("state/fused patches need a recurrent step at T (the fusion runs only there)")
        L = self.n_layers
        for d in resid:
            if not 0 <= d <= L:
                raise UserError(f"patch depth {d} out of range 0..{L}")
        reads = {}
        layers = self._layers()
        use_cache = cache is not None
        with torch.no_grad(), self.nn.trace(ids, mask, state=state, fuse_mask=fuse, cache=cache,
                                            use_cache=use_cache):
            if state is not None:
                if by_site["state"]:
                    args, kw = self.nn.fusion.inputs
                    st = args[0].clone()
                    for p in by_site["state"]:
                        st[:, p.pos] = p.value.to(st.dtype)
                    self.nn.fusion.inputs = ((st,) + tuple(args[1:]), kw)
                if read_cols:
                    reads[("state", -1)] = nnsight.save(self.nn.fusion.inputs[0][0][:, -1].clone())
                if by_site["fused"]:
                    fo = self.nn.fusion.output.clone()
                    for p in by_site["fused"]:
                        fo[:, p.pos] = p.value.to(fo.dtype)
                    self.nn.fusion.output = fo
            for d in range(L + 1):
                if d not in resid and not read_cols:
                    continue
                if d == 0:
                    args, kw = layers[0].inputs
                    h = args[0] if args else kw["hidden_states"]
                else:
                    out = layers[d - 1].output
                    h = out[0] if isinstance(out, tuple) else out
                if d in resid:
                    h = h.clone()
                    for p in resid[d]:
                        h[:, p.pos] = p.value.to(h.dtype)
                    if d == 0:
                        if args:
                            layers[0].inputs = ((h,) + tuple(args[1:]), kw)
                        else:
                            kw = dict(kw)
                            kw["hidden_states"] = h
                            layers[0].inputs = (args, kw)
                    elif isinstance(out, tuple):
                        layers[d - 1].output = (h,) + tuple(out[1:])
                    else:
                        layers[d - 1].output = h
                for c in read_cols:
                    reads[(d, c)] = nnsight.save(h[:, c].clone())
            top = nnsight.save(self.nn.output.top)
            logits = nnsight.save(self.nn.output.logits[:, -1])
        reads["logits"] = logits
        return top, reads

    # -- the generic routine ------------------------------------------------------------------------------
    def run(self, mode: str, patches=(), read: bool = False) -> RunOut:
        """Run `mode` on the whole batch with `patches`; logits at T (and every depth at T-1, T when read)."""
        if mode not in MODES:
            raise UserError(f"unknown mode {mode!r} for patching (use {' or '.join(MODES)})")
        patches = list(patches)
        for p in patches:
            if tuple(p.value.shape) != (self.batch.size, self.model.d_model):
                raise UserError(f"patch value must be [batch={self.batch.size}, d_model={self.model.d_model}], "
                                f"got {tuple(p.value.shape)}")
        ids, mask = self.batch.input_ids, self.batch.attention_mask
        if mode == "standard":
            if any(p.site != "resid" for p in patches):
                raise UserError("standard prefill has no fused state: only resid patches apply")
            _, reads = self._traced_forward(ids, mask, None, None, None, patches, POSITIONS if read else ())
            return RunOut(reads.pop("logits"), reads)
        if not self.model.has_fusion:
            raise UserError("this model has no fusion module: only the standard mode can be patched")
        pre = [p for p in patches if p.pos == -2]
        step = [p for p in patches if p.pos == -1]
        shared = not pre and not read
        if shared:
            cache, h_prev, pre_reads = self.cache, self.h_prev, {}
        else:
            cache, h_prev, pre_reads = self._prefix(ids, mask, pre, read)
        try:
            _, reads = self._traced_forward(ids[:, -1:], mask, h_prev[:, None], self.fuse, cache, step,
                                            (-1,) if read else ())
        finally:
            if shared:
                cache.crop(-1)  # restore the shared clean prefix
        pre_reads.pop("logits", None)
        reads.update(pre_reads)
        return RunOut(reads.pop("logits"), reads)

    # -- thin wrappers ------------------------------------------------------------------------------------
    def patch_state(self, states: torch.Tensor) -> torch.Tensor:
        """Logits at T with the state entering the fusion at T replaced by `states` [B, D]."""
        return self.run("recurrent-1", [Patch("state", states)]).logits

    def swap_state(self, donor: torch.Tensor) -> torch.Tensor:
        """Interchange: h_{T-1} of row donor[i] into row i."""
        return self.patch_state(self.h_prev[donor])

    def gate_bypass(self) -> torch.Tensor:
        """Feed e_T instead of the fused input at T (trained with feedback, decoded without)."""
        return self.run("recurrent-1", [Patch("fused", self.e_T)]).logits

    def patch_resid(self, mode: str, depth: int, pos: int, donor: torch.Tensor) -> torch.Tensor:
        """Residual stream at (depth, pos) from row donor[i]'s clean run of the same mode."""
        value = self.clean[mode].reads[(depth, pos)][donor]
        return self.run(mode, [Patch("resid", value, depth, pos)]).logits
