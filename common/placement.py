"""Where a model runs: --device, --dtype and --device-map, one set of flags for every CLI that loads a model
(declared by common.cli.add_device_flags, read here by `Placement.from_args`).

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
        """The placement of a command's parsed flags; a flag the command does not declare takes its default."""
        p = cls(getattr(args, "device", "cpu"), getattr(args, "dtype", "float32"),
                getattr(args, "device_map", "none"))
        p.torch_device  # refuse cuda without a GPU before anything loads
        if p.device_map == "auto":
            from common.distributed import env_place

            if env_place()[0] > 1:
                raise UserError("--device-map auto spreads one model over every GPU; under torchrun each process "
                                "takes its own (LOCAL_RANK): drop the flag")
        if p.dtype == "float16" and p.torch_device.type == "cpu":
            where = "--device auto found no GPU" if p.device == "auto" else f"--device {p.device}"
            raise UserError(f"--dtype float16 needs a CUDA device ({where}); use bfloat16 on the CPU")
        return p

    @property
    def torch_device(self):
        import torch

        kind = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        if kind == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: this torch sees no CUDA device (use --device cpu or auto)")
        if kind == "cuda":  # under torchrun, each process's own GPU (not every process on cuda:0)
            from common.distributed import env_place

            world, _, local = env_place()
            if world > 1:
                return torch.device("cuda", local)
        return torch.device(kind)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def place(self, model):
        """The model in eval mode on this device and dtype (a device-mapped model keeps its map). The rotary
        embeddings' frequency buffers stay float32, as HF's `from_pretrained(dtype=...)` keeps them: `.to(dtype)`
        alone would round them too (bfloat16: the second frequency 0.6978 -> 0.6992), and every position's phase
        with them, so the model would not be HF's model in that dtype."""
        keep = {name: buf for name, buf in model.named_buffers()  # HF's rotary modules: [prefix]inv_freq, ...
                if name.endswith("inv_freq") and buf.is_floating_point() and buf.element_size() >= 4}
        if getattr(model, "hf_device_map", None) or getattr(getattr(model, "lm", None), "hf_device_map", None):
            model = model.to(dtype=self.torch_dtype)
        else:
            model = model.to(device=self.torch_device, dtype=self.torch_dtype)
        for name, buf in keep.items():
            owner, _, leaf = name.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            mod._buffers[leaf] = buf.to(mod._buffers[leaf].device)
        return model.eval()


CPU = Placement()
