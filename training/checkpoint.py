"""Checkpoints: the model, its tokenizer, the training log and the trainer state (optimizer + step, no pickle)."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

from common.errors import UserError
from common.io import atomic_write, current_umask, json_text, remove_stale_tmp
from common.jsonio import loads_user, read_user_json
from models.full_bandwidth import FullBandwidthLM, load_weights

STATE_FILE = "trainer_state.safetensors"  # optimizer state + step: tensors and JSON, no pickle
LEGACY_STATE_FILE = "trainer_state.pt"  # an earlier version's pickle: never loaded (see load_resume)
LOG_FILE = "train_log.json"

# The trainer state is tensors + JSON (safetensors with a JSON header), never a pickle: loading a pickle runs
# whatever code it names, so a crafted trainer_state.pt ran code on --resume. It is written last and records the
# digests of the model and log files it belongs to, so a save cut short (model newer than the optimizer) is
# refused on --resume instead of continuing from a mismatched pair.
STATE_FORMAT = "fbt-trainer-state/1"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flatten(obj, tensors: dict):
    """A state dict as JSON-able data, its tensors moved into `tensors` (named t0, t1, ...)."""
    if torch.is_tensor(obj):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _flatten(v, tensors) for k, v in obj.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):  # optimizer state: by param index
            return {"__int_keys__": {str(k): _flatten(v, tensors) for k, v in obj.items()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in the trainer state")


def _unflatten(obj, tensors: dict):
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__int_keys__"}:
            return {int(k): _unflatten(v, tensors) for k, v in obj["__int_keys__"].items()}
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    return obj


# A save writes the whole checkpoint into PENDING (a folder inside the run's folder) and only then moves its files
# over the previous ones, the trainer state last: a kill while writing leaves the previous checkpoint intact (and
# an incomplete PENDING, removed by the next run), a kill while moving leaves a complete PENDING (it holds the
# trainer state) whose move the next --resume or save finishes. Either way one complete checkpoint remains.
PENDING = ".checkpoint.tmp"


def _complete(pending: Path) -> bool:
    return (pending / STATE_FILE).is_file()


def pending_move(out: Path) -> bool:
    """A complete checkpoint waits in PENDING: a kill cut its move into `out` short (finish_pending completes it)."""
    return _complete(Path(out) / PENDING)


def finish_pending(out: Path) -> None:
    """Move a complete pending checkpoint's files into `out`, the trainer state last; each file gets the umask's
    mode. Idempotent, and safe when several processes (torchrun ranks resuming) run it at once."""
    pending = Path(out) / PENDING
    if not _complete(pending):
        return
    names = sorted(p.name for p in pending.iterdir() if p.name != STATE_FILE and not p.name.startswith("."))
    mode = 0o666 & ~current_umask()  # like a plain open(): safetensors' own writer leaves some files 0600
    for name in [*names, STATE_FILE]:
        try:
            os.chmod(pending / name, mode)
            os.replace(pending / name, Path(out) / name)
        except FileNotFoundError:  # another process moved it: it is in `out`
            pass
    shutil.rmtree(pending, ignore_errors=True)  # empty now (but for a temporary a kill may have left)


def remove_stale(out: Path) -> None:
    """Temporaries a killed earlier save left in `out` (SIGKILL skips every cleanup), and an incomplete pending
    checkpoint (a complete one is kept: it is the newest checkpoint, moved in by finish_pending)."""
    remove_stale_tmp(out, folders=False)  # the pending checkpoint is a `.tmp` folder: judged below
    pending = Path(out) / PENDING
    if pending.is_dir() and not pending.is_symlink() and not _complete(pending):
        shutil.rmtree(pending, ignore_errors=True)
    for name in ("model.safetensors.tmp", "config.json.tmp"):  # an earlier version's save_pretrained temporaries
        (out / name).unlink(missing_ok=True)
    for p in out.glob(".tokenizer.*.tmp"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(model, tok, opt, cfg, step, log, out: Path):
    """Model, tokenizer, log, then the trainer state (last, with the digests of the model and the log), written
    into `out`/PENDING and then moved over the previous checkpoint (finish_pending)."""
    from safetensors.torch import save_file

    out = Path(out)
    finish_pending(out)  # a complete checkpoint whose move a kill cut short goes in before it is replaced
    pending = out / PENDING
    if pending.exists():  # an incomplete one (a save cut short): the previous checkpoint in `out` is the good one
        shutil.rmtree(pending)
    pending.mkdir(parents=True)
    try:
        model.save_pretrained(pending, tokenizer=tok)
        log_text = json_text(log).encode()
        atomic_write(pending / LOG_FILE, log_text)
        tensors: dict = {}
        meta = {"format": STATE_FORMAT, "step": step, "config": cfg.to_dict(),
                "optimizer": _flatten(opt.state_dict(), tensors), "rng": _rng_state(tensors),
                "model_sha256": _sha256((pending / "model.safetensors").read_bytes()), "log_sha256": _sha256(log_text)}
        atomic_write(pending / STATE_FILE,
                     lambda tmp: save_file(tensors, tmp, metadata={"trainer_state": json_text(meta, None)}))
    except BaseException:  # an error or interrupt while writing: no temporary left, the previous checkpoint kept
        shutil.rmtree(pending, ignore_errors=True)
        raise
    finish_pending(out)  # the new checkpoint is complete: only now does it replace the previous one
    (out / LEGACY_STATE_FILE).unlink(missing_ok=True)  # an earlier version's pickle must not lie beside it


# torch's global generators: what attention dropout draws its masks from (everything else in a step is a pure
# function of (seed, step)). Kept with the checkpoint, so a resumed run draws the masks the straight run drew.
# Under torchrun rank 0's is kept: exact where every rank draws alike (the same rows per rank).
def _rng_state(tensors: dict) -> dict:
    keys = {"cpu": _flatten(torch.get_rng_state(), tensors)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        keys["cuda"] = _flatten(torch.cuda.get_rng_state(), tensors)
    return keys


def _set_rng_state(keys: dict, tensors: dict) -> None:
    torch.set_rng_state(_unflatten(keys["cpu"], tensors))
    if "cuda" in keys and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unflatten(keys["cuda"], tensors))


def read_trainer_state(out: Path, tensors: bool = True) -> tuple[dict, dict]:
    """(metadata, tensors) of `out`'s trainer state; no code is run, whatever the file holds. `tensors=False`: the
    header alone (the optimizer's tensors are not read)."""
    from safetensors import safe_open

    with safe_open(str(Path(out) / STATE_FILE), "pt") as f:
        meta = loads_user((f.metadata() or {})["trainer_state"], f"{STATE_FILE}'s header")
        data = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{STATE_FILE} is not a {STATE_FORMAT} trainer state")
    return meta, data


def saved_recipe(out: Path) -> dict:
    """The recipe (TrainConfig.to_dict()) of the checkpoint a --resume of `out` continues: the pending one where a
    kill cut its move short (finish_pending moves it in), else `out`'s. Read-only: the CLI builds the resumed
    recipe from it before any work."""
    check_resume_files(out)
    where = Path(out) / PENDING if pending_move(out) else Path(out)
    try:
        meta, _ = read_trainer_state(where, tensors=False)
        if not isinstance(meta.get("config"), dict):
            raise ValueError("no recipe in its header")
    except Exception as e:  # load_resume's words: the same file is refused there
        raise UserError(f"--resume: corrupt checkpoint in {out}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    return meta["config"]


def check_resume_files(out: Path) -> None:
    if not (out / STATE_FILE).is_file() and not _complete(out / PENDING):  # (the latter: moved in on resume)
        if (out / LEGACY_STATE_FILE).is_file():
            raise UserError(f"--resume: {out} holds {LEGACY_STATE_FILE}, an earlier version's trainer state (a "
                            "pickle, which can run code when loaded, so it is not loaded); start over with --overwrite")
        hint = ""
        if (out / "model.safetensors").is_file():  # e.g. a copy of a shipped checkpoint: they ship without it
            hint = (" (it holds weights only: the shipped checkpoints carry no optimizer state; fine-tune them with "
                    "--base DIR --base-fusion instead, or train the preset into a new --out and resume that)")
        raise UserError(f"--resume: no {STATE_FILE} in {out}{hint}")


def load_resume(model, opt, cfg, out: Path, tok=None):
    check_resume_files(out)
    finish_pending(out)  # the newest complete checkpoint, if a kill cut its move short
    saved = FullBandwidthLM.read_config(out)
    # a looped model saves its physical blocks (LoopedLM.physical_config); its live config counts the unrolled ones
    mine = model.physical_config() if hasattr(model, "physical_config") else model.lm.config.to_dict()
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "n_embd", "n_layer", "n_head", "n_inner",  # n_*: GPT-2 spells its sizes so
            # what each position attends to and how far: a window dropped on resume made every layer full attention
            "sliding_window", "layer_types", "max_position_embeddings", "n_positions")
    diff = [k for k in keys if saved["base_config"].get(k) != mine.get(k)]
    if diff:
        raise UserError(f"--resume: checkpoint in {out} has another architecture ({', '.join(diff)} differ; a run "
                        "started from --base resumes with the same --base)")
    if tok is not None:  # another --base of the same shape with other token ids: the run would go on in other words
        from models.tokenizers import load_tokenizer_dir

        theirs = load_tokenizer_dir(out)
        if theirs is not None and theirs.get_vocab() != tok.get_vocab():
            raise UserError(f"--resume: the run in {out} was trained with another tokenizer (other token ids) than "
                            "this one's; a run started from --base resumes with the same --base")
    try:
        meta, tensors = read_trainer_state(out)
        for name, digest in (("model.safetensors", meta["model_sha256"]), (LOG_FILE, meta["log_sha256"])):
            if not (out / name).is_file():
                raise ValueError(f"no {name}")
            if _sha256((out / name).read_bytes()) != digest:
                raise ValueError(f"{name} is not the one {STATE_FILE} was saved with (a save cut short?)")
        step = meta["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad step {step!r}")
        log = read_user_json(out / LOG_FILE)
        load_weights(model, out / "model.safetensors")  # names, shapes, finite values: one line each
        opt.load_state_dict(_unflatten(meta["optimizer"], tensors))
        if meta.get("rng"):  # (a state saved before it was kept has none: those runs drew no random numbers)
            _set_rng_state(meta["rng"], tensors)
    except Exception as e:
        raise UserError(f"--resume: corrupt checkpoint in {out}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    # The run that saved this kept a zero gradient (zero_grad(set_to_none=False)) on every parameter that has had
    # one, so AdamW went on stepping it (moments, weight decay) in steps that leave it unused, such as the fusion in
    # a 1-pass step; a fresh process has none, and AdamW would skip it. Those parameters are exactly the ones
    # with optimizer state: without this, a resume into a 1-pass step was not the run continued.
    for group in opt.param_groups:
        for p in group["params"]:
            if p in opt.state and p.grad is None:
                p.grad = torch.zeros_like(p)
    return step, log
