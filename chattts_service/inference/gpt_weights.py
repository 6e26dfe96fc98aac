"""ChatTTS's GPT (a Llama body) read straight from its files: ``config.json`` and the
memory-mapped ``model.safetensors``, without transformers' model classes (whose import alone,
through ``transformers.modeling_utils``, costs about a second of every start).

Only what the lean transformer needs is read: the shapes, the norms' epsilon, the rotary
embedding's base, and the tensors it asks for by their transformers names
(``layers.0.self_attn.q_proj.weight``...). The rotary table is computed as transformers'
``LlamaRotaryEmbedding`` computes the default rope, to the bit (a test holds the two together).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class GptFilesError(ValueError):
    """The GPT's files describe a model this service does not run."""


@dataclass(frozen=True)
class GptConfig:
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    num_hidden_layers: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def read(cls, path: Path) -> GptConfig:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise GptFilesError(f"cannot read the GPT's config {path}: {error}") from None
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str) -> GptConfig:
        """The shapes from a transformers Llama config (a file's or a model's ``to_dict()``);
        refuses what the lean transformer does not run."""
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            config = cls(
                hidden_size=hidden,
                num_attention_heads=heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope(raw).get("rope_theta", 10000.0)),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise GptFilesError(f"cannot read the GPT's config {source}: {error}") from None
        if int(raw.get("num_key_value_heads") or heads) != heads:
            raise GptFilesError("grouped-query attention is not used by ChatTTS and not supported")
        if _rope(raw).get("rope_type", "default") != "default":
            raise GptFilesError(f"rope {_rope(raw)} is not ChatTTS's (the default rope)")
        return config


def _rope(raw: dict) -> dict:
    """The rope settings as transformers 5 writes them (``rope_parameters``) or as older
    releases did (``rope_theta``, ``rope_scaling``)."""
    parameters = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    if scaling:
        parameters.setdefault("rope_type", scaling.get("rope_type", scaling.get("type")))
    if "rope_theta" in raw:
        parameters.setdefault("rope_theta", raw["rope_theta"])
    return parameters


def rotary_table(config: GptConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] of the default rope, as ``LlamaRotaryEmbedding``."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inverse_frequency = 1.0 / (config.rope_theta**exponents)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
    frequencies = (inverse_frequency[:, None].float() @ positions[None, :].float()).transpose(0, 1)
    angles = torch.cat((frequencies, frequencies), dim=-1)
    return angles.cos().contiguous(), angles.sin().contiguous()


class GptWeights:
    """The GPT's tensors, read on demand from the memory-mapped safetensors file."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        directory = Path(directory)
        self.config = GptConfig.read(directory / "config.json")
        path = directory / "model.safetensors"
        try:
            self._file: Any = safe_open(str(path), framework="pt")  # or a _StateFile
        except Exception as error:  # safetensors raises its own error types
            raise GptFilesError(f"cannot open {path}: {error}") from None
        self._names = set(self._file.keys())
        self._prefix = "model." if "model.norm.weight" in self._names else ""

    def tensor(self, name: str) -> torch.Tensor:
        key = self._prefix + name
        if key not in self._names:
            raise GptFilesError(f"the GPT's weights have no {name}")
        return self._file.get_tensor(key)

    def layer(self, index: int, name: str) -> torch.Tensor:
        return self.tensor(f"layers.{index}.{name}.weight")

    @classmethod
    def from_module(cls, llama) -> GptWeights:
        """The same view of a transformers ``LlamaModel`` in memory (tests, benchmarks)."""
        weights = cls.__new__(cls)
        weights.config = GptConfig.from_dict(llama.config.to_dict(), "of the given model")
        state = llama.state_dict()
        weights._file, weights._names, weights._prefix = _StateFile(state), set(state), ""
        return weights


class _StateFile:
    def __init__(self, state: dict):
        self._state = state

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._state[name]
