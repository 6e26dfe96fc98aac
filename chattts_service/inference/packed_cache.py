"""The GPT's int8 (or int4) layers, packed once and kept on disk next to the model, mapped on
later starts.

Quantizing and packing the full-size GPT's linears takes seconds of every start; the packed
result (int8 blocks, channel offsets and scales, or int4 nibbles and group scales; the norms)
is a pure function of the GPT's files, the packing's layout and the kernels' product. It is
written once to ``<model dir>/.packed/gpt-<product>-<key>.pt`` (product: vnni or avx2 for
int8, int4 for int4; a temporary name, renamed when whole, so a
killed start never leaves half a file under the real name) and memory-mapped on later starts:
nothing is quantized, the fp32 weights are never read, and replicas on one host share the pages
(read into the page cache in 2 MB pages where the system allows: ``runtime/pages.py``).

The key names the GPT's files by path, size and modification time, the packing's version and
the kernels' ABI: a replaced model, a new layout or a new library makes another key, and the old
file is removed. A file that cannot be read or does not match the model is rebuilt, with a
warning, never used.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from chattts_service.inference.quantize import KernelLinear
from chattts_service.kernels.abi import ABI_VERSION
from chattts_service.kernels.int4 import Int4Packing
from chattts_service.kernels.int8 import Int8Packing
from chattts_service.runtime import pages
from chattts_service.runtime.files import identity_key, listing, replace_atomically

log = logging.getLogger(__name__)

PACKING_VERSION = 2  # bump when a packing's layout or what is stored changes
DIRECTORY = ".packed"
LINEARS = ("qkv", "out", "gate_up", "down")


def model_key(gpt_dir: Path) -> str:
    """The GPT's files as they are now (name, size and modification time of each), the
    packing's version and the kernels' ABI."""
    return identity_key({"packing": PACKING_VERSION, "abi": ABI_VERSION, "files": listing(gpt_dir)})


LINEAR_KINDS = ("int8", "int4")  # the packings the kernels' KernelLinear multiplies


class PackedCache:
    """The packed layers of the GPT in ``gpt_dir`` (under its model directory ``model_dir``),
    quantized as ``quantization`` says (int8 or int4)."""

    def __init__(self, model_dir: Path, gpt_dir: Path, quantization: str = "int8"):
        if quantization not in LINEAR_KINDS:
            raise ValueError(f"only {sorted(LINEAR_KINDS)} layers are packed, not {quantization}")
        self.directory = Path(model_dir) / DIRECTORY
        self.key = model_key(gpt_dir)
        self.quantization = quantization
        self.huge_pages = 0.0  # the fraction of the loaded file mapped 2 MB at a time

    def _product(self, kernels) -> str:
        """What the file's name says the layers are for: int8's product, or int4."""
        return kernels.int8_instructions if self.quantization == "int8" else "int4"

    def path(self, product: str) -> Path:
        return self.directory / f"gpt-{product}-{self.key}.pt"

    def load(self, kernels, config):
        """The layers and final norm from the cache, or None (no kernels, no file, or a file
        that does not fit: then it is rebuilt)."""
        from chattts_service.inference.transformer import Layer, RMSNorm

        if kernels is None:
            return None
        path = self.path(self._product(kernels))
        if not path.is_file():
            return None
        try:
            self.huge_pages = pages.settle(path)  # read into the page cache in 2 MB pages
            stored = torch.load(path, mmap=True, weights_only=True)
            if stored.get("key") != self.key or len(stored["layers"]) != config.num_hidden_layers:
                raise ValueError("it was made for another model")
            eps = config.rms_norm_eps
            layers = []
            for layer in stored["layers"]:
                qkv, out, gate_up, down = (self._linear(layer[name], kernels) for name in LINEARS)
                attention_norm = RMSNorm(layer["attention_norm"], eps)
                mlp_norm = RMSNorm(layer["mlp_norm"], eps)
                layers.append(Layer(qkv, out, gate_up, down, attention_norm, mlp_norm))
            if layers[0].qkv.in_features != config.hidden_size:
                raise ValueError("its shapes are not the model's")
            return layers, RMSNorm(stored["norm"], eps)
        except Exception as error:  # any unreadable or foreign file: rebuild, never use it
            log.warning("packed GPT cache %s is unusable (%s): packing again", path, error)
            return None

    def _linear(self, parts: dict, kernels):
        if parts.get("format", "int8") != self.quantization:
            raise ValueError(f"it holds {parts.get('format', 'int8')} layers")
        if self.quantization == "int4":
            packed = Int4Packing.from_parts(
                parts["packed"],
                parts["scales"],
                parts["scale"],
                parts["out_features"],
                parts["in_features"],
                parts["group"],
            )
            return KernelLinear(packed, kernels)
        if parts["instructions"] != kernels.int8_instructions:
            raise ValueError(f"it holds the {parts['instructions']} packing")
        packing = Int8Packing.from_parts(
            parts["packed"],
            parts["offsets"],
            parts["weight_scale"],
            parts["out_features"],
            parts["in_features"],
            parts["instructions"],
        )
        return KernelLinear(packing, kernels)

    def save(self, transformer) -> Path | None:
        """Write the transformer's packed layers (only when every linear is the kernels');
        None when there is nothing to keep or the directory cannot be written."""
        if transformer.kernels is None or not all(
            _is_kernel_linear(getattr(layer, name), self.quantization)
            for layer in transformer.layers
            for name in LINEARS
        ):
            return None
        product = self._product(transformer.kernels)
        stored = {
            "key": self.key,
            "layers": [
                {
                    **{name: _parts(getattr(layer, name).packing) for name in LINEARS},
                    "attention_norm": layer.attention_norm.weight,
                    "mlp_norm": layer.mlp_norm.weight,
                }
                for layer in transformer.layers
            ],
            "norm": transformer.norm.weight,
        }
        path = self.path(product)
        try:
            self.directory.mkdir(exist_ok=True)
            replace_atomically(path, lambda out: torch.save(stored, out))
        except OSError as error:
            log.warning(
                "cannot keep the packed GPT in %s (%s): later starts pack again",
                self.directory,
                error,
            )
            return None
        for old in self.directory.glob(f"gpt-{product}-*.pt"):
            if old != path:
                old.unlink(missing_ok=True)
        return path


def _parts(packing: Int8Packing | Int4Packing) -> dict:
    if isinstance(packing, Int4Packing):
        return {
            "format": "int4",
            "packed": packing.packed,
            "scales": packing.scales,
            "scale": packing.scale,
            "out_features": packing.out_features,
            "in_features": packing.in_features,
            "group": packing.group,
        }
    return {
        "format": "int8",
        "packed": packing.packed,
        "offsets": packing.offsets,
        "weight_scale": packing.weight_scale,
        "out_features": packing.out_features,
        "in_features": packing.in_features,
        "instructions": packing.instructions,
    }


def _is_kernel_linear(linear, quantization: str) -> bool:
    """A layer the kernels multiply, in the cache's quantization."""
    return isinstance(linear, KernelLinear) and (linear.kernel == "int4") == (
        quantization == "int4"
    )
