"""A lean forward pass over ChatTTS's GPT (a Llama body), with a KV cache of row slots.

Weights are taken once from the loaded transformers ``LlamaModel`` (which is then released):
q/k/v fused into one matrix and gate/up into another, so a layer costs four matrix products.
The KV cache holds one slot per sequence in the batch. A sequence's keys sit left-aligned in its
slot, so each row has its own position and no padding; active rows are kept in slots
``0..rows-1`` so the attention reads a view of the cache, never a gathered copy. Capacity grows
in chunks as sequences grow and is released when the batch empties.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .quantize import make_linear

CAPACITY_CHUNK = 256


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight.detach().float().clone()
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Layer:
    def __init__(self, hf_layer, quantization: str):
        attention, mlp = hf_layer.self_attn, hf_layer.mlp
        self.qkv = make_linear(torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                          attention.v_proj.weight]), quantization)
        self.out = make_linear(attention.o_proj.weight, quantization)
        self.gate_up = make_linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                   quantization)
        self.down = make_linear(mlp.down_proj.weight, quantization)
        self.attention_norm = RMSNorm(hf_layer.input_layernorm.weight,
                                      hf_layer.input_layernorm.variance_epsilon)
        self.mlp_norm = RMSNorm(hf_layer.post_attention_layernorm.weight,
                                hf_layer.post_attention_layernorm.variance_epsilon)

    @property
    def linear_bytes(self) -> int:
        return sum(m.nbytes for m in (self.qkv, self.out, self.gate_up, self.down))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Keys and values for up to ``max_rows`` sequences: [layers, rows, heads, capacity, dim]."""

    def __init__(self, layers: int, max_rows: int, heads: int, head_dim: int):
        self.shape = (layers, max_rows, heads, 0, head_dim)
        self.keys = torch.empty(self.shape)
        self.values = torch.empty(self.shape)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * 4 * 2

    def bytes_per_position(self) -> int:
        layers, _, heads, _, head_dim = self.shape
        return layers * heads * head_dim * 4 * 2

    @torch.inference_mode()
    def ensure(self, positions: int) -> None:
        if positions <= self.capacity:
            return
        capacity = math.ceil(positions / CAPACITY_CHUNK) * CAPACITY_CHUNK
        layers, rows, heads, _, head_dim = self.shape
        keys = torch.empty(layers, rows, heads, capacity, head_dim)
        values = torch.empty(layers, rows, heads, capacity, head_dim)
        if self.capacity:
            keys[:, :, :, : self.capacity].copy_(self.keys)
            values[:, :, :, : self.capacity].copy_(self.values)
        self.keys, self.values = keys, values

    @torch.inference_mode()
    def move(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's first ``length`` positions from one slot to another."""
        self.keys[:, target, :, :length].copy_(self.keys[:, source, :, :length])
        self.values[:, target, :, :length].copy_(self.values[:, source, :, :length])

    def release(self) -> None:
        layers, rows, heads, _, head_dim = self.shape
        self.keys = torch.empty(layers, rows, heads, 0, head_dim)
        self.values = torch.empty(layers, rows, heads, 0, head_dim)


class Transformer:
    def __init__(self, llama_model, quantization: str = "int8", max_rows: int = 8):
        config = llama_model.config
        self.hidden_size = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.heads
        if getattr(config, "num_key_value_heads", self.heads) != self.heads:
            raise ValueError("grouped-query attention is not used by ChatTTS and not supported")
        self.quantization = quantization
        self.layers = [Layer(layer, quantization) for layer in llama_model.layers]
        self.norm = RMSNorm(llama_model.norm.weight, llama_model.norm.variance_epsilon)
        positions = torch.arange(config.max_position_embeddings)[None]
        with torch.no_grad():
            cos, sin = llama_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()  # [P, dim]
        self.max_positions = config.max_position_embeddings
        self.cache = KVCache(len(self.layers), max_rows, self.heads, self.head_dim)

    @property
    def linear_bytes(self) -> int:
        return sum(layer.linear_bytes for layer in self.layers)

    def _project(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        rows, length, _ = x.shape
        qkv = layer.qkv(layer.attention_norm(x)).view(rows, length, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [rows, heads, length, dim]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _finish(self, layer: Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        rows, _, length, _ = attended.shape
        x = x + layer.out(attended.transpose(1, 2).reshape(rows, length, self.hidden_size))
        gate, up = layer.gate_up(layer.mlp_norm(x)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    @torch.inference_mode()
    def prefill(self, embeddings: torch.Tensor, slot: int) -> torch.Tensor:
        """Run one sequence's prompt [length, hidden] into ``slot``; return its last hidden state."""
        length = embeddings.shape[0]
        if length > self.max_positions:
            raise ValueError(f"prompt of {length} tokens exceeds {self.max_positions} positions")
        self.cache.ensure(length)
        cos, sin = self.cos[:length][None, None], self.sin[:length][None, None]
        x = embeddings.float()[None]
        for index, layer in enumerate(self.layers):
            q, k, v = self._project(layer, x, cos, sin)
            self.cache.keys[index, slot, :, :length].copy_(k[0])
            self.cache.values[index, slot, :, :length].copy_(v[0])
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._finish(layer, x, attended)
        return self.norm(x[0, -1])

    @torch.inference_mode()
    def step(self, embeddings: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One decode step for the sequences in slots ``0..rows-1``.

        ``embeddings`` [rows, hidden] are the new tokens; ``lengths`` [rows] how many positions
        each slot already holds (so also each new token's position). Returns [rows, hidden].
        """
        rows = embeddings.shape[0]
        longest = int(lengths.max()) + 1
        if longest > self.max_positions:
            raise ValueError(f"sequence would exceed {self.max_positions} positions")
        self.cache.ensure(longest)
        cos = self.cos[lengths][:, None, None]  # [rows, 1, 1, dim]
        sin = self.sin[lengths][:, None, None]
        # Attention runs per row over exactly that row's positions: the CPU kernels' summation
        # order depends on the key count, so padding a row to its neighbours' length would change
        # its result in the last bits, and a request's audio would depend on its batch.
        spans = [int(length) + 1 for length in lengths]
        x = embeddings.float()[:, None]
        attended = torch.empty(rows, self.heads, 1, self.head_dim)
        for index, layer in enumerate(self.layers):
            q, k, v = self._project(layer, x, cos, sin)
            keys, values = self.cache.keys[index], self.cache.values[index]
            for row, span in enumerate(spans):
                keys[row, :, span - 1].copy_(k[row, :, 0])
                values[row, :, span - 1].copy_(v[row, :, 0])
                attended[row] = F.scaled_dot_product_attention(
                    q[row], keys[row, :, :span], values[row, :, :span])
            x = self._finish(layer, x, attended)
        return self.norm(x[:, 0])
