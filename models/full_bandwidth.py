"""FullBandwidthLM: any HF causal LM whose next input fuses the previous position's top state.

Address space (nnsight / named_modules):
    lm                      the wrapped HF causal LM (untouched; its blocks are `lm.<base>.layers.i` or `.h.i`)
    fusion                  Fusion(state, embed) -> fused input of block 0   [batch, pos, d_model]
    fusion.up / .gate / .norm  W_U, W_G and the post-fusion RMSNorm

The fed-back state is the vector the LM head reads (post-final-norm), which keeps its scale O(1).

Checkpoint format (a directory):
    config.json         {"format": "full-bandwidth-lm", "format_version": 1,
                         "base_config": <HF config dict of the wrapped LM>,
                         "fusion": {"enabled": bool, "d_model": int, "eps": float, "state": "post_final_norm"}}
    model.safetensors   state dict: "lm.*" (the HF model's own names under "lm."),
                        "fusion.up.weight", "fusion.gate.weight", "fusion.norm.weight" ([d_model, d_model],
                        [d_model, d_model], [d_model]); tied weights stored once.
    tokenizer.json etc. optional, written by the tokenizer's own save_pretrained.
    MODEL_CARD.md / train_log.json  optional, written by the trainer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.errors import UserError
from common.io import atomic_write
from common.jsonio import read_user_json
from models.configs import check_config
from models.families import family_of
from models.fusion import Fusion
from models.lean_step import StepPlan, lean_step, step_plan

FORMAT = "full-bandwidth-lm"
FORMAT_VERSION = 1
LOOP_FORMAT_VERSION = 2  # a looped model (models.looped): config.json adds "loop", the blocks are stored once
KNOWN_FORMAT_VERSIONS = (1, 2)  # the config.json format_versions this code reads


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one short line: its cause's message where it has one (HF wraps validation errors)."""
    cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__).strip() else e
    text = "; ".join(line.strip() for line in str(cause).splitlines() if line.strip()) or type(cause).__name__
    if isinstance(cause, KeyError):
        text = f"missing key {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_finite_weights(weights, where: str) -> None:
    """UserError naming the first tensor (in name order) with a NaN or inf, if any.

    `weights`: an nn.Module (its state_dict) or a {name: tensor} mapping; `where`: the checkpoint, for the message.
    """
    sd = weights.state_dict() if isinstance(weights, nn.Module) else weights
    bad = [k for k in sorted(sd) if torch.is_tensor(sd[k]) and (sd[k].is_floating_point() or sd[k].is_complex())
           and sd[k].device.type != "meta"  # offloaded by accelerate: not in memory to check
           and not bool(torch.isfinite(sd[k]).all())]
    if bad:
        t = sd[bad[0]]
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        more = f" (and {len(bad) - 1} more tensor{'s' * (len(bad) > 2)})" if len(bad) > 1 else ""
        raise UserError(f"non-finite weights in {where}: {bad[0]} {list(t.shape)} has {n_nan} NaN and {n_inf} inf "
                        f"values{more}")


def check_runs(lm, where: str) -> None:
    """HF's own forward over a 2-token prompt: a config HF builds but cannot run (Gemma 2 / 3 or Qwen2-MoE with no
    sliding_window: their mask code builds the sliding mask even where no layer slides) is refused in one line at
    loading, not a traceback at the first pass."""
    device = lm.get_input_embeddings().weight.device
    context = family_of(lm).context(lm.config)
    ids = torch.zeros(1, min(2, context or 2), dtype=torch.long,  # a 1-position model: 1 token
                      device="cpu" if device.type == "meta" else device)  # an embedding offloaded by accelerate
    try:
        with torch.no_grad():
            lm(input_ids=ids, use_cache=False)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # ValueError / TypeError / RuntimeError from HF's modelling code
        raise UserError(f"cannot run the model of {where}: HF's own forward fails on a 2-token prompt "
                        f"({one_line(e, 200)})") from None


def save_tokenizer(tok, out: str | Path) -> None:
    """tok.save_pretrained into a temporary folder, then each file renamed into place (atomic each)."""
    import shutil
    import tempfile

    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", suffix=".tmp", dir=out))
    try:
        tok.save_pretrained(str(tmp))
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class LMOutput:
    logits: torch.Tensor | None  # [batch, pos, vocab]; None from forward(head=False)
    top: torch.Tensor  # [batch, pos, d_model] post-final-norm state: what the LM head reads and what is fed back
    cache: object | None = None
    hidden: tuple | None = None  # with hidden_states=True: block 0's input and every block's output ([-1] = top)


def decoder_layers(lm: PreTrainedModel) -> nn.ModuleList:
    """The list of transformer blocks of an HF causal LM, where its family keeps them (models.families: Llama /
    Qwen / Gemma / GPT-NeoX `layers`, GPT-2 `h`); UserError (one line) for an unsupported family."""
    return family_of(lm).layers(lm)


def positions_from_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Position ids of the last q_len columns for a left-padded mask: count of real tokens before each."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos[:, -q_len:]


def embedding_rms(lm: PreTrainedModel) -> float:
    """RMS of the input token embeddings as the embedding module returns them (Gemma's scale included): the
    scale the blocks were built for."""
    scale = family_of(lm).embed_scale(lm)
    return float(lm.get_input_embeddings().weight.detach().float().pow(2).mean().sqrt()) * scale


class FullBandwidthLM(nn.Module):
    def __init__(self, lm: PreTrainedModel, fusion: bool = True, eps: float = 1e-6):
        super().__init__()
        self.lm = lm
        self.family = family_of(lm)  # models.families: where its blocks, norm and head live; refuses the unknown
        d_model = self.family.width(lm.config)
        # depth 0 is the embedding as block 0 reads it, the fused input replaces it, and the lens reads the top
        # through the final norm: a model that projects between embedding and residual stream (OPT-350m's
        # project_in / project_out) or has no final norm (its post-LN blocks) fits none of that
        width = self.family.embedding(lm).weight.shape[-1]
        if width != d_model:
            raise UserError(f"unsupported {lm.config.model_type} model: its token embeddings are {width} wide and its "
                            f"residual stream {d_model} (a projection between them, e.g. OPT-350m's project_in)")
        self.family.final_norm(lm)  # none (e.g. OPT-350m, post-LN): one line naming where it was looked for
        self.fusion = Fusion(d_model, eps) if fusion else None
        if self.fusion is not None:
            # Start the fused input at the scale of the token embeddings the blocks were built for.
            with torch.no_grad():
                self.fusion.norm.weight.fill_(embedding_rms(lm))

    # ----- construction -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, base_config, fusion: bool = True, seed: int | None = None) -> "FullBandwidthLM":
        """A randomly initialised model. `seed` seeds torch's global generator (HF initialises from it), which
        the caller's later draws then continue from (the tests' inputs rely on that order)."""
        if seed is not None:
            torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(base_config, dtype=torch.float32)  # see from_pretrained
        return cls(lm, fusion=fusion)

    @property
    def config(self):
        return self.lm.config

    @property
    def n_layers(self) -> int:
        return len(decoder_layers(self.lm))

    @property
    def d_model(self) -> int:
        return self.family.width(self.lm.config)

    @property
    def has_fusion(self) -> bool:
        return self.fusion is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm.get_input_embeddings()(input_ids)  # [batch, pos, d_model]

    def token_gate(self, input_ids: torch.Tensor) -> torch.Tensor:
        """sigmoid(W_G e_t) for these tokens: [batch, q, d_model] (pass it as forward's `gate` to reuse it)."""
        if self.fusion is None:
            raise UserError("this model has no fusion module: only standard (unfused) prefill is possible")
        return self.fusion.token_gate(self.embed(input_ids))

    # ----- forward ------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, q]
        attention_mask: torch.Tensor | None = None,  # [batch, past + q]
        state: torch.Tensor | None = None,  # [batch, q, d_model]; state[:, t] is the top state of position t-1
        fuse_mask: torch.Tensor | None = None,  # [batch, q] bool; where False the plain embedding is used
        cache=None,
        use_cache: bool = False,
        position_ids: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,  # [batch, q, d_model]: token_gate(input_ids), precomputed (see Fusion)
        hidden_states: bool = False,  # also return the residual stream after every block (LMOutput.hidden)
        last_logits: bool = False,  # the head at the last column only (logits [batch, 1, vocab]): a patched
        #                            run reads T alone, and the head over every column is ~19% of SmolLM2's pass
        head: bool = True,  # False: no head at all (logits None), for a caller that reads top states only
    ) -> LMOutput:
        x = self.embed(input_ids)
        if state is not None:
            if self.fusion is None:
                raise UserError("this model has no fusion module: only standard (unfused) prefill is possible")
            fused = self.fusion(state.to(x.dtype), x, gate)
            x = fused if fuse_mask is None else torch.where(fuse_mask[..., None], fused, x)
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape[0], input_ids.shape[1], dtype=torch.long,
                                        device=input_ids.device)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, input_ids.shape[1])
        padded = not bool(attention_mask.all())
        plan = step_plan(self.lm, self.family, x, cache) if use_cache and not hidden_states else None
        if isinstance(plan, StepPlan):  # a cached one-token step, bit for bit HF's at less cost (models.lean_step)
            top = lean_step(plan, self.lm.config, x, attention_mask if padded else None, position_ids, cache)
            return LMOutput(logits=self.head(top) if head else None, top=top, cache=cache)
        # CPU SDPA with an explicit padding mask falls back to a slow kernel (measured ~3x slower than eager
        # on the tiny presets); without padding the mask is dropped so SDPA takes its causal fast path. float32
        # only: in float64 HF's eager attention turns a padded row's fully masked queries into NaN (min + score
        # overflows to -inf), which the next layer's values carry into every real row; in bfloat16 eager and SDPA
        # round apart by a bf16 step, enough to flip a mixture of experts' routing (1.3 logits on a tiny Mixtral)
        # between this pass and recirculation's (SDPA with 4-D masks), so both stay HF's default kernel.
        impl = self.lm.config._attn_implementation
        use_eager = (padded and input_ids.shape[1] > 1 and impl == "sdpa" and x.dtype == torch.float32
                     and x.device.type == "cpu")
        if use_eager:
            self.lm.config._attn_implementation = "eager"
        try:
            out = self.lm.base_model(inputs_embeds=x, attention_mask=attention_mask if padded else None,
                                     position_ids=position_ids, cache=cache, use_cache=use_cache,
                                     **({"output_hidden_states": True} if hidden_states else {}))
        finally:
            self.lm.config._attn_implementation = impl
        top = out.last_hidden_state
        logits = None if not head else self.head(top[:, -1:] if last_logits else top)
        return LMOutput(logits=logits, top=top, cache=out.cache if use_cache else None,
                        hidden=tuple(out.hidden_states) if hidden_states else None)

    def head(self, top: torch.Tensor) -> torch.Tensor:
        """Logits [.., vocab] from post-final-norm states [.., d_model]: the LM head and the family's final
        soft-cap, if any (Gemma 2), as the HF causal LM computes them."""
        return self.family.logits(self.lm, top)

    # ----- persistence --------------------------------------------------------------------------------
    def fusion_settings(self) -> dict:
        return {"enabled": self.fusion is not None, "d_model": self.d_model,
                "eps": self.fusion.norm.eps if self.fusion is not None else 1e-6, "state": "post_final_norm"}

    def save_pretrained(self, path: str | Path, tokenizer=None) -> None:
        from safetensors.torch import save_model

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        base = self.lm.config.to_dict()
        if "tie_word_embeddings" in base:  # what the weights are: an untied model loaded from a folder whose config
            # said tied (HF keeps both tensors then) would load back with the head over the embedding
            inp, outp = self.lm.get_input_embeddings(), self.lm.get_output_embeddings()
            base["tie_word_embeddings"] = bool(outp is not None and inp.weight is outp.weight)
        cfg = {"format": FORMAT, "format_version": FORMAT_VERSION, "base_config": base,
               "fusion": self.fusion_settings()}
        # Temporary names, then rename (common.io.atomic_write): a crash never leaves a half-written checkpoint,
        # and no temporary survives an error or an interrupt.
        atomic_write(path / "model.safetensors", lambda tmp: save_model(self, tmp))
        atomic_write(path / "config.json", json.dumps(cfg, indent=2, sort_keys=True, default=str))
        if tokenizer is not None:
            save_tokenizer(tokenizer, path)

    @classmethod
    def read_config(cls, path: str | Path) -> dict:
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise UserError(f"no checkpoint directory at {path}")
        missing = [n for n in ("config.json", "model.safetensors") if not (path / n).is_file()]
        if missing:
            raise UserError(f"{path} is not a full-bandwidth checkpoint: no {' and no '.join(missing)} in it")
        cfg = read_user_json(cfg_file, "corrupt checkpoint config")  # huge ints, deep nesting, NaN: one line
        if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
            fmt = cfg.get("format") if isinstance(cfg, dict) else type(cfg).__name__
            raise UserError(f"{cfg_file} is not a {FORMAT} config (format={fmt!r})")
        base, fusion = cfg.get("base_config"), cfg.get("fusion")
        if not (isinstance(base, dict) and isinstance(base.get("model_type"), str)
                and isinstance(fusion, dict) and isinstance(fusion.get("enabled"), bool)):
            raise UserError(f"corrupt checkpoint config {cfg_file}: needs base_config.model_type and fusion.enabled")
        version = cfg.get("format_version")
        if isinstance(version, bool) or version not in KNOWN_FORMAT_VERSIONS:
            known = ", ".join(map(str, KNOWN_FORMAT_VERSIONS))
            raise UserError(f"{cfg_file} has format_version {version!r}; this code reads only format_version {known} "
                            f"(a checkpoint from another version of this project?)")
        if (version == LOOP_FORMAT_VERSION) != isinstance(cfg.get("loop"), dict):
            raise UserError(f"corrupt checkpoint config {cfg_file}: format_version {LOOP_FORMAT_VERSION} (a looped "
                            "model) and a \"loop\" section go together")
        eps = fusion.get("eps", 1e-6)
        if fusion["enabled"] and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
            raise UserError(f"corrupt checkpoint config {cfg_file}: fusion.eps must be a number in (0, 1), got {eps!r}")
        return cfg

    @classmethod
    def _from_parts(cls, lm, cfg: dict, path: Path) -> "FullBandwidthLM":
        """The model around the built HF LM, from the checkpoint's config (a subclass reads its own section)."""
        if "loop" in cfg:  # models.looped.LoopedLM reads it (models.loading picks the class)
            raise UserError(f"{path} is a looped model (format_version {LOOP_FORMAT_VERSION}): load it with "
                            "models.loading.load_model or models.looped.LoopedLM.from_pretrained")
        fusion = cfg["fusion"]
        return cls(lm, fusion=fusion["enabled"], eps=float(fusion.get("eps", 1e-6)))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "FullBandwidthLM":
        path = Path(path)
        cfg = cls.read_config(path)
        base = dict(cfg["base_config"])
        family_of(base)  # an unsupported family: one line, before HF builds its config
        model_type = base.pop("model_type")
        try:
            base_config = AutoConfig.for_model(model_type, **base)
        except Exception as e:  # ValueError/KeyError/TypeError, or HF's strict-dataclass validation errors
            raise UserError(f"cannot build the base model config of {path} (model_type={model_type!r}): "
                            f"{one_line(e, 200)}") from None
        family = family_of(base_config)
        check_config(base_config, path / "config.json")  # values HF accepts but that make a NaN or blind model
        fusion = cfg["fusion"]
        d_model = family.width(base_config)
        if fusion["enabled"] and fusion.get("d_model", d_model) != d_model:
            raise UserError(f"corrupt checkpoint config {path / 'config.json'}: fusion.d_model "
                            f"{fusion.get('d_model')!r} differs from the base model's hidden size {d_model!r}")
        try:  # float32, whatever base_config.dtype says: load_state_dict would round the file's weights into
            # it (bfloat16: 2e-3 off; float16: inf); Placement casts to the dtype asked for
            lm = AutoModelForCausalLM.from_config(base_config, dtype=torch.float32)
        except Exception as e:  # a config HF accepts but cannot build (e.g. heads that do not divide the width)
            raise UserError(f"cannot build the model of {path} from its config.json: {one_line(e, 200)}") from None
        model = cls._from_parts(lm, cfg, path)
        load_weights(model, path / "model.safetensors")
        model.eval()
        check_runs(model.lm, str(path))
        return model


def is_looped_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint folder holds a looped model (config.json with a "loop" section)."""
    return "loop" in FullBandwidthLM.read_config(path)


def load_weights(model: FullBandwidthLM, weights_file: Path) -> None:
    """Load a checkpoint's model.safetensors into `model`, or UserError (one line) if it is unreadable, does not
    match the model built from its config.json (names, shapes) or holds a NaN/inf."""
    from safetensors.torch import load_file

    try:
        sd = load_file(str(weights_file))
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise UserError(f"corrupt checkpoint weights {weights_file}: {one_line(e)}") from None
    own = model.state_dict()
    # Tied weights (one tensor under two names, e.g. the LM head and the input embedding) are stored once, under
    # either name; anything else missing is a broken checkpoint.
    def storage(t):
        return t.untyped_storage().data_ptr() if t.numel() else None

    stored = {storage(own[k]) for k in own.keys() & sd.keys()} - {None}
    tied = {k for k in own.keys() - sd.keys() if storage(own[k]) in stored}
    missing, unexpected = sorted(own.keys() - sd.keys() - tied), sorted(sd.keys() - own.keys())
    if missing or unexpected:
        raise UserError(f"checkpoint {weights_file.parent} does not match its config ({len(missing)} missing: "
                        f"{missing[:3]}, {len(unexpected)} unexpected: {unexpected[:3]})")
    wrong = [k for k in sorted(sd) if sd[k].shape != own[k].shape]
    if wrong:
        k = wrong[0]
        raise UserError(f"corrupt checkpoint weights {weights_file}: {len(wrong)} tensor{'s' * (len(wrong) > 1)} of "
                        f"the wrong shape for its config.json, first {k}: {list(sd[k].shape)} in the file, "
                        f"{list(own[k].shape)} in the model")
    # load_state_dict would cast integer tensors into the float parameters: a model of rounded weights
    ints = [k for k in sorted(sd) if own[k].is_floating_point() and not sd[k].is_floating_point()]
    if ints:
        raise UserError(f"corrupt checkpoint weights {weights_file}: {len(ints)} tensor{'s' * (len(ints) > 1)} of a "
                        f"non-floating type, first {ints[0]} ({sd[ints[0]].dtype}); weights must be floating point")
    # One tensor in the model under two names (tied by config.json), two different ones in the file: loading would
    # keep whichever comes last (the head over the input embedding): not the model that was saved
    by_storage: dict = {}
    for k in sorted(own.keys() & sd.keys()):
        by_storage.setdefault(storage(own[k]), []).append(k)
    for ptr, names in by_storage.items():
        if ptr is not None and len(names) > 1 and any(not torch.equal(sd[names[0]], sd[k]) for k in names[1:]):
            raise UserError(f"checkpoint {weights_file.parent}: its config.json ties {' and '.join(names)} (one tensor, "
                            "e.g. tie_word_embeddings), and the file holds different tensors for them: set "
                            "tie_word_embeddings to false in its base_config if they are two")
    check_finite_weights(sd, str(weights_file))
    model.load_state_dict(sd, strict=False)


def non_float_weights(directory: Path) -> list[tuple[str, str]]:
    """(name, dtype) of every `*.weight` tensor stored in a non-floating type in a plain HF model folder's weight
    files (safetensors: read from the headers; pytorch_model.bin: memory-mapped, no pickle code run).
    HF's from_pretrained casts them silently into the float parameters."""
    from safetensors import safe_open

    directory = Path(directory)
    files = [directory / "model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = read_user_json(index, "corrupt weight index")
        if not isinstance(data, dict):
            raise UserError(f"corrupt weight index {index}: a JSON object with a weight_map, not a {type(data).__name__}")
        weight_map = data.get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()}) if isinstance(weight_map, dict) else []
    out = []
    for f in files:
        if f.is_file():
            with safe_open(str(f), "pt") as st:
                out += [(k, st.get_slice(k).get_dtype()) for k in st.keys()
                        if not st.get_slice(k).get_dtype().startswith(("F", "BF"))]
    if not (directory / "model.safetensors").is_file() and (directory / "pytorch_model.bin").is_file():
        import zipfile

        bin_file = directory / "pytorch_model.bin"  # mmap needs torch's zip format (not the legacy one)
        sd = torch.load(bin_file, map_location="cpu", mmap=zipfile.is_zipfile(bin_file), weights_only=True)
        out += [(k, str(v.dtype)) for k, v in sd.items() if torch.is_tensor(v) and not v.is_floating_point()]
    return [(k, d) for k, d in sorted(out) if k.endswith(".weight")]
