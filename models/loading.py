"""Loading a model by name or path: a training preset's checkpoint (found along the checkpoint search path:
models.checkpoints), a full-bandwidth checkpoint folder, any plain HF causal LM folder, or the SmolLM2-135M of
the recirculation study.

    load_model(name_or_path, placement=None) -> (FullBandwidthLM, tokenizer or None, name)
"""
from __future__ import annotations

from pathlib import Path

from common.errors import UserError
from models.checkpoints import PRESET_NAMES, checkpoint_dir


def load_model(name_or_path: str, placement=None):
    """Load a model by shipped preset name, full-bandwidth checkpoint dir, or plain HF model dir.

    Returns (FullBandwidthLM, tokenizer or None, name). A plain HF LM is wrapped without a fusion module.
    Anything unreadable or inconsistent (config, weights, NaN/inf weights, tokenizer) is one UserError line.
    `placement` (common.placement.Placement; default float32 on the CPU): device, dtype and, for plain HF
    models, an accelerate device map.
    """
    from common.placement import CPU
    from models.full_bandwidth import FullBandwidthLM, check_finite_weights

    placement = placement or CPU
    p = model_dir(name_or_path)
    # --- the real pretrained model of the recirculation study, owned by models/smollm2.py ---
    if p is None:
        from models.smollm2 import load_smollm2

        model, tok, name = load_smollm2(**_hf_kw(placement))
        check_finite_weights(model, name)
        return placement.place(model), tok, name
    # ---
    cfg_file = p / "config.json"
    if _is_own_format(cfg_file):
        if placement.device_map != "none":
            raise UserError(f"--device-map is for plain HF models; {p} is a full-bandwidth checkpoint "
                            "(use --device)")
        from models.full_bandwidth import is_looped_checkpoint

        if is_looped_checkpoint(p):  # feedback in depth (models.looped)
            from models.looped import LoopedLM

            model = LoopedLM.from_pretrained(p)
        else:
            model = FullBandwidthLM.from_pretrained(p)
    else:
        model = FullBandwidthLM(_load_hf_lm(p, **_hf_kw(placement)), fusion=False).eval()
    return placement.place(model), _load_tokenizer(p, model), p.name


def _is_own_format(cfg_file: Path) -> bool:
    """Whether config.json is this project's checkpoint format: its top-level "format" key, not the string
    anywhere in the file (a plain HF config may mention it in a note)."""
    from common.jsonio import read_user_json
    from models.full_bandwidth import FORMAT

    if f'"{FORMAT}"' not in cfg_file.read_text(errors="replace"):  # most configs: no parse needed
        return False
    cfg = read_user_json(cfg_file, "corrupt model config")
    return isinstance(cfg, dict) and cfg.get("format") == FORMAT


def model_dir(name_or_path: str) -> Path | None:
    """The folder `load_model` would read (None: the SmolLM2-135M of models/smollm2.py), after the checks that need
    no file read beyond a listing: an unknown name, a preset without its checkpoint, a file, a folder without
    config.json are one line. CLIs call it before anything else runs (a task's own code included)."""
    p = Path(name_or_path)
    if not p.exists() and name_or_path == "smollm2-135m":
        return None
    if not p.exists() and name_or_path in PRESET_NAMES:
        p = checkpoint_dir(name_or_path)
        if not p.exists():
            raise UserError(f"preset {name_or_path!r} has no shipped checkpoint at {p}; train it with "
                            f"`python -m training.train --preset {name_or_path}`")
    if not p.exists():
        names = ", ".join(k for k in PRESET_NAMES if k != "smoke")
        raise UserError(f"unknown model {name_or_path!r}: not a preset ({names}) nor an existing directory")
    if not p.is_dir():
        raise UserError(f"model {name_or_path!r}: {p} is a file, not a model directory")
    if not (p / "config.json").is_file():
        raise UserError(f"{p} is not a model directory: it has no config.json")
    return p


def _hf_kw(placement) -> dict:
    """from_pretrained keywords of a placement: the dtype, and accelerate's device map when asked."""
    kw = {"dtype": placement.torch_dtype}
    if placement.device_map != "none":
        kw["device_map"] = placement.device_map
    return kw


def _load_hf_lm(p: Path, **from_pretrained_kw):
    """A plain HF causal LM from `p`; UserError if it cannot be read, has a config that makes a NaN or blind model
    (models.configs.check_config), non-floating, missing/mis-shaped or NaN/inf weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from common.jsonio import read_user_json
    from models.configs import check_config
    from models.full_bandwidth import check_finite_weights, check_runs, non_float_weights, one_line

    hf_logging.disable_progress_bar()  # a per-shard bar is noise for the small models loaded here
    raw = read_user_json(p / "config.json", "corrupt model config")  # huge ints, deep nesting, NaN: one line
    if isinstance(raw, dict):  # a family we cannot run (or none named): refused before HF reads anything
        from models.families import family_of

        family_of(raw)
    try:
        config = AutoConfig.from_pretrained(str(p))
    except Exception as e:  # OSError/ValueError, HF config validation errors
        raise UserError(f"cannot load a model from {p}: {one_line(e)}") from None
    check_config(config, p / "config.json")
    try:
        ints = non_float_weights(p)  # HF would cast them silently into the float parameters
        if not ints:
            lm, info = AutoModelForCausalLM.from_pretrained(str(p), config=config, output_loading_info=True,
                                                            **from_pretrained_kw)
    except Exception as e:  # OSError/ValueError, safetensors errors on corrupt files
        raise UserError(f"cannot load a model from {p}: {one_line(e)}") from None
    if ints:
        raise UserError(f"corrupt model weights in {p}: {len(ints)} stored in a non-floating type, first "
                        f"{ints[0][0]} ({ints[0][1]}); weights must be floating point")
    # HF fills missing or mis-shaped weights with fresh random init and only warns: refuse them here.
    missing = sorted(set(info.get("missing_keys") or ()))
    mismatched = list(info.get("mismatched_keys") or ())
    if missing or mismatched:
        what = f"{len(missing)} missing weights, first {missing[0]}" if missing else \
            f"{len(mismatched)} weights of the wrong shape, first {mismatched[0][0]}"
        raise UserError(f"corrupt model weights in {p}: {what}")
    # ... and drops weights the model built from config.json has no place for (a config of fewer layers than the
    # file: a smaller model, run silently). Old checkpoints' saved buffers (causal masks, rotary frequencies) aside.
    buffers = {name for name, _ in lm.named_buffers()}
    extra = sorted(k for k in set(info.get("unexpected_keys") or ())
                   if k not in buffers and not k.endswith((".masked_bias", ".attn.bias", "inv_freq")))
    if extra:
        raise UserError(f"{p}: {len(extra)} weights in its files have no place in the model its config.json describes, "
                        f"first {extra[0]} (a config of fewer layers or another shape than the weights?)")
    check_finite_weights(lm, str(p))
    check_runs(lm, str(p))
    return lm


def _load_tokenizer(p: Path, model):
    """The tokenizer saved beside the model (None if it has none: models.tokenizers.LOOKED_FOR); UserError if it is
    unreadable or holds token ids the model's embedding does not have."""
    from models.tokenizers import check_fits, load_tokenizer_dir

    tok = load_tokenizer_dir(p)
    if tok is not None:
        check_fits(tok, model, f"tokenizer in {p}")
    return tok
