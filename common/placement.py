"""Where a model runs: --device, --dtype and --device-map, one set of flags for every CLI that loads a model.

    --device cpu | cuda | auto   (auto = cuda when torch sees one, else cpu)
    --dtype float32 | bfloat16 | float16   (float16 only on cuda: CPU half matmuls are slow or missing)
    --device-map none | auto     (accelerate: a plain HF model too big for one device spread over the devices;
                                  full-bandwidth checkpoints and the fusion stay on --device)

Probes and interventions move only what they read (activations, logits at T) to the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("none", "auto")


def add_placement_flags(p) -> None:
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the model runs: cpu (default), cuda, or auto (cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations: float32 (default), bfloat16, or float16 (cuda only)")
    p.add_argument("--device-map", choices=DEVICE_MAPS, default="none",
                   help="'auto': let accelerate spread a plain HF model over the available devices "
                        "(for models that do not fit one; default none)")


@dataclass(frozen=True)
class Placement:
    device: str = "cpu"
    dtype: str = "float32"
    device_map: str = "none"

    def __post_init__(self):
        for name, value, allowed in (("device", self.device, DEVICES), ("dtype", self.dtype, DTYPES),
                                     ("device_map", self.device_map, DEVICE_MAPS)):
            if value not in allowed:
                raise UserError(f"--{name.replace('_', '-')} {value!r}: use one of {', '.join(allowed)}")

    @classmethod
    def from_args(cls, args) -> "Placement":
        p = cls(args.device, args.dtype, args.device_map)
        p.torch_device  # refuse cuda without a GPU before anything loads
        if p.dtype == "float16" and p.torch_device.type == "cpu":
            raise UserError("--dtype float16 needs --device cuda (use bfloat16 on CPU)")
        return p

    @property
    def torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: this torch sees no CUDA device (use --device cpu or auto)")
        return torch.device(self.device)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def place(self, model):
        """The model in eval mode on this device and dtype (a device-mapped model keeps its map)."""
        if getattr(model, "hf_device_map", None) or getattr(getattr(model, "lm", None), "hf_device_map", None):
            return model.to(dtype=self.torch_dtype).eval()
        return model.to(device=self.torch_device, dtype=self.torch_dtype).eval()


CPU = Placement()
