"""The engine's one hook helper: read or rewrite the residual stream at a depth, or the fusion output.

Every reader and writer inside the engine's own loops is built on :func:`on_depth` / :func:`on_output`: the
residual recorder, the interventions' patches, recirculation's mixing and the model-call counter. nnsight
(probes.collect) reads the same addresses from outside, one trace per batch; inside the engine's cached
one-token steps a trace per step would cost more than the step, so the engine hooks directly.

Depths: 0 = the vector entering block 0 (embedding or fused input), l = the output of 0-based block l - 1, the
input of block l (its raw output, before the final norm for l = L). A hook function gets the tensor [batch, cols, d_model] of the current call
and returns a replacement or None (read only).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from models.full_bandwidth import FullBandwidthLM, decoder_layers
from models.lean_step import RESIDUAL_HOOK


def on_depth(layers: nn.ModuleList, depth: int, fn):
    """Register fn(h) -> h' | None on the residual stream at `depth`; returns the removable handle."""
    if depth == 0:
        def pre(mod, args, kwargs):
            h = fn(args[0] if args else kwargs["hidden_states"])
            if h is None:
                return None
            if args:
                return (h,) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        setattr(pre, RESIDUAL_HOOK, True)  # models.lean_step may call it in its one-token steps
        return layers[0].register_forward_pre_hook(pre, with_kwargs=True)

    def post(mod, args, out):
        h = fn(out[0] if isinstance(out, tuple) else out)
        if h is None:
            return None
        return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

    setattr(post, RESIDUAL_HOOK, True)
    return layers[depth - 1].register_forward_hook(post)


BLOCK_SITES = ("attn_out", "mlp_out", "head")  # inside block `layer` (0-based), as TransformerLens'
#   blocks.{layer}.hook_attn_out / hook_mlp_out / attn.hook_z (one head's output, before the output projection)


def blocks_addressable(model) -> bool:
    """Whether every decoder block of an engine model is its own module (a looped model's unrolled blocks share
    theirs: a hook inside one would fire at every iteration, so its attention / MLP / head sites are not
    addressable; its residual sites are)."""
    return not hasattr(model, "iterations")


def on_block(lm, layer: int, site: str, fn, head: int | None = None):
    """Register fn(x) -> x' | None inside decoder block `layer` of an HF causal LM: on what the attention adds to
    the residual stream (`attn_out`, [batch, cols, d_model]: its output, after its post-norm in a sandwich-norm
    model), what the MLP adds (`mlp_out`) or one head's output (`head`: the slice
    [batch, cols, head_dim] of head `head` in the output projection's input). Modules come from the model's
    family adapter (models.families)."""
    from models.families import family_of

    fam = family_of(lm)
    block = decoder_layers(lm)[layer]
    if site == "head":
        dh = fam.head_dim(lm.config)

        def pre(mod, args):
            x = args[0]
            sl = slice(head * dh, (head + 1) * dh)
            y = fn(x[..., sl])
            if y is None:
                return None
            x = x.clone()
            x[..., sl] = y.to(x.dtype)
            return (x,) + tuple(args[1:])

        return fam.attn_out(block).register_forward_pre_hook(pre)
    mod = fam.residual_update(block, site, lm.config.model_type)  # after a sandwich norm's post-norm, if any
    rows_flat = site == "mlp_out" and fam.flat_mlp  # [batch * cols, d_model] (OPT): fn sees [batch, cols, d_model]
    batch = {}

    def post(mod, args, out):
        x = out[0] if isinstance(out, tuple) else out
        flat = rows_flat and x.ndim == 2
        y = fn(x.view(batch["n"], -1, x.shape[-1]) if flat else x)
        if y is None:
            return None
        y = y.reshape(x.shape) if flat else y
        return (y,) + tuple(out[1:]) if isinstance(out, tuple) else y

    if rows_flat:  # the block's input gives the batch size the flat rows came from
        def remember(mod, args, kwargs):
            batch["n"] = (args[0] if args else kwargs["hidden_states"]).shape[0]

        return _Handles(block.register_forward_pre_hook(remember, with_kwargs=True), mod.register_forward_hook(post))
    return mod.register_forward_hook(post)


class _Handles:
    """Hook handles removed together (one site that needs two hooks)."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def on_output(module: nn.Module, fn):
    """Register fn(out) -> out' | None on a module's output (the fusion site)."""
    return module.register_forward_hook(lambda mod, args, out: fn(out))


class Hooks:
    """A set of hook handles removed together (a context manager)."""

    def __init__(self):
        self.handles = []

    def add(self, handle) -> None:
        self.handles.append(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class ResidualRecorder(Hooks):
    """Records the residual stream at every depth, at chosen columns of the current call (`cols`; None =
    record nothing), for `take()`."""

    def __init__(self, model: FullBandwidthLM):
        super().__init__()
        self.layers = decoder_layers(model.lm)
        self.cols: torch.Tensor | None = None
        self.buf: list[torch.Tensor | None] = [None] * (len(self.layers) + 1)

    def __enter__(self):
        for depth in range(len(self.layers) + 1):
            self.add(on_depth(self.layers, depth, lambda h, depth=depth: self._keep(depth, h)))
        return self

    def _keep(self, depth: int, h: torch.Tensor) -> None:
        if self.cols is not None:
            self.buf[depth] = h[:, self.cols].detach()

    @property
    def recorded(self) -> bool:
        """Whether every depth was recorded since the last `take()` (a run may call no model at all)."""
        return all(b is not None for b in self.buf)

    def take(self) -> torch.Tensor:
        out = torch.stack(self.buf, dim=2)  # [batch, n_cols, L+1, d_model]
        self.buf = [None] * len(self.buf)
        return out


@contextmanager
def maybe_record(model: FullBandwidthLM, collect: bool):
    """A ResidualRecorder when `collect`, else None."""
    if collect:
        with ResidualRecorder(model) as rec:
            yield rec
    else:
        yield None


def put_columns(h: torch.Tensor, items) -> torch.Tensor:
    """A copy of h [batch, cols, D] with column c replaced by value [batch, D] for each (c, value); a value may
    be an engine.edits object, applied to the column's current value."""
    h = h.clone()
    for c, v in items:
        h[:, c] = v(h[:, c]) if callable(v) else v.to(h.dtype)
    return h


@contextmanager
def patched(model: FullBandwidthLM, fused=(), resid=None, blocks=None):
    """Substitute columns of the fusion output (`fused`: [(col, value)]), of the residual stream
    (`resid`: {depth: [(col, value)]}) and of sites inside blocks (`blocks`: {(site, layer, head): [(col,
    value)]}, engine.hooks.on_block) in every model call inside the block."""
    layers = decoder_layers(model.lm)
    with Hooks() as hooks:
        if fused:
            hooks.add(on_output(model.fusion, lambda out: put_columns(out, fused)))
        for depth, items in (resid or {}).items():
            hooks.add(on_depth(layers, depth, lambda h, items=items: put_columns(h, items)))
        for (site, layer, head), items in (blocks or {}).items():
            hooks.add(on_block(model.lm, layer, site, lambda x, items=items: put_columns(x, items), head))
        yield


class CallCounter(Hooks):
    """Counts the model calls (calls of block 0) made inside the block."""

    def __init__(self, model: FullBandwidthLM):
        super().__init__()
        self.n = 0
        self.layers = decoder_layers(model.lm)

    def __enter__(self):
        self.add(on_depth(self.layers, 0, self._count))
        return self

    def _count(self, h):
        self.n += 1
