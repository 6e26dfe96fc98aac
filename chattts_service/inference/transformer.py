"""A lean forward pass over ChatTTS's GPT (a Llama body), with a KV cache per sequence.

Weights are read once from the GPT's memory-mapped files (``gpt_weights``), or from the packed
cache of an earlier start (``packed_cache``): q/k/v fused into one matrix and gate/up into
another, so a layer costs four matrix products.
Each sequence has its own KV cache with its own positions, so sequences of any lengths share a
step without padding, and attention reads each cache in place, never a gathered copy: in a decode
step through the C++ kernel of ``kernels.py`` (one call per layer for all rows, over a bf16
cache, or an int8 one with a scale per position and head), or else torch's
``scaled_dot_product_attention`` once per row (over an fp32 cache). With the kernels, the
RMSNorm before a projection is fused with the int8 kernel's per-row scaling.
Longer than most modules: the KV cache, the layers, the step and the prefill in pieces share the
cache's layout and the kernels' call, and each path has its torch fallback beside it.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F

from chattts_service.config import KV_CACHE_DTYPES
from chattts_service.inference.gpt_weights import GptWeights, rotary_table
from chattts_service.inference.quantize import KernelLinear, Linear, make_linear
from chattts_service.kernels import bindings as cpp_kernels
from chattts_service.kernels import tuning
from chattts_service.kernels.layers import DecodeLayers

CAPACITY_CHUNK = 256
CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
PREFIX_ENTRIES = 64  # prompt beginnings whose keys and values are kept (~0.2 MB each, full size)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight.detach().float().clone()
        self.shape = tuple(self.weight.shape)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # one fused operator instead of the five of transformers' LlamaRMSNorm
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class KernelRMSNorm(RMSNorm):
    """The final norm where the C++ kernels run the whole step: their RMSNorm, which the step
    also applies inside its own call (``DecodeLayers.step_and_draw``), so a step's hidden
    states have the same bits however it was called."""

    def __init__(self, norm: RMSNorm, kernels):
        super().__init__(norm.weight, norm.eps)
        self.kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Layer:
    def __init__(self, qkv, out, gate_up, down, attention_norm: RMSNorm, mlp_norm: RMSNorm):
        self.qkv, self.out, self.gate_up, self.down = qkv, out, gate_up, down
        # the C++ int8 layers add the residual and do SwiGLU in their own call
        self.fused_epilogue = all(
            isinstance(linear, KernelLinear) for linear in (self.out, self.down)
        )
        self.attention_norm, self.mlp_norm = attention_norm, mlp_norm

    @classmethod
    def from_weights(cls, weights: GptWeights, index: int, quantization: str, kernels=None):
        """Layer ``index`` of the GPT's weights: q/k/v fused into one product, gate/up into
        another, each quantized as ``quantization`` says."""

        def weight(name: str) -> torch.Tensor:
            return weights.layer(index, name)

        eps = weights.config.rms_norm_eps
        qkv = torch.cat(
            [weight("self_attn.q_proj"), weight("self_attn.k_proj"), weight("self_attn.v_proj")]
        )
        gate_up = torch.cat([weight("mlp.gate_proj"), weight("mlp.up_proj")])
        return cls(
            make_linear(qkv, quantization, kernels),
            make_linear(weight("self_attn.o_proj"), quantization, kernels),
            make_linear(gate_up, quantization, kernels),
            make_linear(weight("mlp.down_proj"), quantization, kernels),
            RMSNorm(weight("input_layernorm"), eps),
            RMSNorm(weight("post_attention_layernorm"), eps),
        )

    @property
    def linear_bytes(self) -> int:
        return sum(m.nbytes for m in (self.qkv, self.out, self.gate_up, self.down))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """One sequence's keys and values, [layers, heads, capacity, dim] each as Python sees them,
    stored position-major, [layers, capacity, heads, dim] (the views ``keys`` and ``values``
    are permuted): one layer's keys lie in one run that grows at its end, which the attention
    kernel reads as one stream (attention.cpp).

    Each sequence owns its cache, so memory follows the sequences actually running (not the
    longest one times the batch size) and a finished sequence's memory is freed at once.
    ``reserve`` allocates a sequence's worst case up front: the pages of a large allocation
    only become resident when first written, so memory still grows with the positions used,
    and there is never a copy (or a moment holding two copies) when the sequence grows."""

    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        reserve: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        self.shape = (layers, heads, 0, head_dim)
        self.dtype = dtype
        self.keys = _position_major(self.shape, dtype)
        self.values = _position_major(self.shape, dtype)
        # int8: each (layer, head, position)'s key and value has its own scale
        self.key_scales: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        if dtype == torch.int8:
            self.key_scales = _position_major(self.shape[:3], torch.float32)
            self.value_scales = _position_major(self.shape[:3], torch.float32)
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)
        if reserve:
            self.ensure(reserve)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @torch.inference_mode()
    def ensure(self, positions: int) -> None:
        if positions <= self.capacity:
            return
        capacity, held = rounded_positions(positions), self.capacity

        def grown(tensor: torch.Tensor) -> torch.Tensor:
            """``tensor`` [layers, heads, positions, ...] with room for ``capacity`` positions,
            the ``held`` ones copied."""
            shape = (*tensor.shape[:2], capacity, *tensor.shape[3:])
            larger = _position_major(shape, tensor.dtype)
            larger[:, :, :held].copy_(tensor)
            return larger

        self.keys, self.values = grown(self.keys), grown(self.values)
        if self.key_scales is not None and self.value_scales is not None:
            self.key_scales, self.value_scales = grown(self.key_scales), grown(self.value_scales)
        # per-layer views, made once rather than on every step
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)

    def _tensors(self) -> list[torch.Tensor]:
        scales: list[torch.Tensor] = []
        if self.key_scales is not None and self.value_scales is not None:
            scales = [self.key_scales, self.value_scales]
        return [self.keys, self.values, *scales]

    @torch.inference_mode()
    def snapshot(self, positions: int) -> list[torch.Tensor]:
        """A copy of what the first ``positions`` hold, for ``restore``."""
        return [tensor[:, :, :positions].clone() for tensor in self._tensors()]

    @torch.inference_mode()
    def restore(self, snapshot: list[torch.Tensor]) -> None:
        """Put a ``snapshot``'s positions back at the start of this cache (room for them
        ``ensure``d first)."""
        for tensor, held in zip(self._tensors(), snapshot, strict=True):
            tensor[:, :, : held.shape[2]].copy_(held)

    @torch.inference_mode()
    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` [heads, positions, dim] (float) at positions ``start``...
        of ``layer``: as they are, rounded to the cache's float type, or quantized per (head,
        position) as the C++ kernel quantizes the positions it writes itself."""
        end = start + keys.shape[1]
        if self.key_scales is None or self.value_scales is None:
            self.keys[layer, :, start:end].copy_(keys)
            self.values[layer, :, start:end].copy_(values)
            return
        for source, target, scales in (
            (keys, self.keys, self.key_scales),
            (values, self.values, self.value_scales),
        ):
            quantized, scale = quantize_vectors(source)
            target[layer, :, start:end].copy_(quantized)
            scales[layer, :, start:end].copy_(scale)


def _position_major(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An empty [layers, heads, positions, ...] view of [layers, positions, heads, ...]
    storage."""
    layers, heads, positions, *rest = shape
    return torch.empty((layers, positions, heads, *rest), dtype=dtype).transpose(1, 2)


def quantize_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 vectors along the last dimension: round(x * 127 / max |x|) and the scale
    max |x| / 127 (0 for a zero vector), so x ~ q * scale; computed in float32 as the C++
    kernel computes them."""
    largest = x.abs().amax(dim=-1)
    inverse = torch.where(largest > 0, torch.tensor(127.0) / largest, torch.zeros(()))
    quantized = torch.round(x * inverse[..., None]).to(torch.int8)
    return quantized, largest / 127.0


def rounded_positions(positions: int) -> int:
    return math.ceil(positions / CAPACITY_CHUNK) * CAPACITY_CHUNK


class PrefixStore:
    """The keys and values of prompt beginnings that recur (ChatTTS starts every speech
    prompt with the same three tokens for a voice and speed), keyed by the bytes of their input
    embeddings, which are all a position's keys and values depend on (the layers are the
    process's own and causal). At most ``entries``, the least recently used dropped first."""

    def __init__(self, entries: int = PREFIX_ENTRIES):
        self.entries = entries
        self._held: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(embeddings: torch.Tensor) -> bytes:
        data = embeddings.contiguous().numpy().tobytes()
        digest = hashlib.blake2b(data, digest_size=20).digest()
        return digest + len(embeddings).to_bytes(4, "little")

    def get(self, key: bytes) -> list[torch.Tensor] | None:
        held = self._held.get(key)
        if held is None:
            self.misses += 1
            return None
        self.hits += 1
        self._held.move_to_end(key)
        return held

    def put(self, key: bytes, snapshot: list[torch.Tensor]) -> None:
        self._held[key] = snapshot
        self._held.move_to_end(key)
        while len(self._held) > self.entries:
            self._held.popitem(last=False)

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


class Transformer:
    """``source``: the GPT's weights (``GptWeights``, or a transformers ``LlamaModel``).
    ``packed(kernels)`` may give the layers and final norm instead, as a packed cache holds
    them (``packed_cache``), or None; the weights then only give the shapes."""

    def __init__(
        self,
        source,
        quantization: str = "int8",
        kernels: str = "auto",
        int8_product: str = "auto",
        kv_cache: str = "bf16",
        kernel_dir: str = "",
        packed=None,
    ):
        weights = source if isinstance(source, GptWeights) else GptWeights.from_module(source)
        config = weights.config
        self.hidden_size = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.kernels = cpp_kernels.load(kernels, int8_product, kernel_dir)
        if kv_cache not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_DTYPES}, not {kv_cache!r}")
        self.kv_cache = kv_cache  # where the kernels attend; torch's attention reads fp32
        loaded = packed(self.kernels) if packed is not None else None
        self.from_packed_cache = loaded is not None
        if loaded is not None:
            self.layers, self.norm = loaded
        else:
            self.layers = [
                Layer.from_weights(weights, index, quantization, self.kernels)
                for index in range(config.num_hidden_layers)
            ]
            self.norm = RMSNorm(weights.tensor("norm.weight"), config.rms_norm_eps)
        self.cos, self.sin = rotary_table(config)  # [P, dim]
        self.max_positions = config.max_position_embeddings
        self.scale = 1.0 / math.sqrt(self.head_dim)  # scaled_dot_product_attention's default
        self.decode_layers = self._gather_layers()
        if self.decode_layers is not None:
            self.norm = KernelRMSNorm(self.norm, self.kernels)
        # how the products prefetch and pair blocks, once chosen (tuning.py)
        self.tuning: tuning.Choice | None = None
        self.prefixes = PrefixStore()

    def kernel_packings(self) -> list:
        """Every int8 or int4 packing the kernels multiply by, layer by layer (empty without
        them)."""
        return [
            linear.packing
            for layer in self.layers
            for linear in (layer.qkv, layer.out, layer.gate_up, layer.down)
            if isinstance(linear, KernelLinear)
        ]

    def _gather_layers(self) -> DecodeLayers | None:
        """Every layer in one C++ call a decode step, where the kernels multiply every
        projection (int8 or int4; else None: one call per layer from Python)."""
        linears = [(layer.qkv, layer.out, layer.gate_up, layer.down) for layer in self.layers]
        norms = [(layer.attention_norm, layer.mlp_norm) for layer in self.layers]
        if self.kernels is None or not all(
            isinstance(linear, KernelLinear) for group in linears for linear in group
        ):
            return None
        if len({norm.eps for pair in norms for norm in pair} | {self.norm.eps}) != 1:
            return None
        return DecodeLayers(
            self.kernels,
            [
                (*(linear.packing for linear in group), first.weight, second.weight)
                for group, (first, second) in zip(linears, norms)
            ],
            self.heads,
            self.head_dim,
            norms[0][0].eps,
            self.scale,
            (self.cos, self.sin),
            self.norm.weight,
        )

    @property
    def cache_kind(self) -> str:
        """What the KV cache holds: where the kernels attend, bf16 (half the bytes of fp32 to
        read and hold) or int8 (``kv_cache``; a quarter, plus a scale per position and head);
        else fp32."""
        return self.kv_cache if self.kernels is not None else "fp32"

    @property
    def cache_dtype(self) -> torch.dtype:
        return CACHE_DTYPES[self.cache_kind]

    def new_cache(self, reserve: int = 0) -> KVCache:
        return KVCache(len(self.layers), self.heads, self.head_dim, reserve, self.cache_dtype)

    def bytes_per_position(self) -> int:
        element = torch.empty(0, dtype=self.cache_dtype).element_size()
        scales = 4 if self.cache_dtype == torch.int8 else 0  # a float per head and position
        return len(self.layers) * self.heads * (self.head_dim * element + scales) * 2

    @property
    def linear_bytes(self) -> int:
        return sum(layer.linear_bytes for layer in self.layers)

    @property
    def linear_kernel(self) -> str:
        """What multiplies the linear layers: vnni, avx2, int4, fbgemm, int_mm or fp32."""
        return self.layers[0].qkv.kernel

    def _normed(self, norm: RMSNorm, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """``linear(norm(x))``, the norm fused into the product's call where it can be."""
        if linear.fused_norm:
            return linear.normed(x, norm.weight, norm.eps)
        return linear(norm(x))

    def _project(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        rows, length, _ = x.shape
        qkv = self._normed(layer.attention_norm, layer.qkv, x).view(
            rows, length, 3, self.heads, self.head_dim
        )
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, rows, heads, length, dim]
        qk = qkv[:2] * cos + _rotate_half(qkv[:2]) * sin  # q and k rotated together
        return qk[0], qk[1], qkv[2]

    def _finish(self, layer: Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        rows, _, length, _ = attended.shape
        attended = attended.transpose(1, 2).reshape(rows, length, self.hidden_size)
        if layer.fused_epilogue:
            x = layer.out(attended, residual=x)
            return layer.down.swiglu(self._normed(layer.mlp_norm, layer.gate_up, x), x)
        x = x + layer.out(attended)
        gate, up = self._normed(layer.mlp_norm, layer.gate_up, x).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    @torch.inference_mode()
    def prefill(self, embeddings: torch.Tensor, cache: KVCache, shared: int = 0) -> torch.Tensor:
        """Run one sequence's prompt [length, hidden] into its empty ``cache``; return the last
        position's hidden state (``PromptFill`` run whole). ``shared``: how many of its first
        positions begin other prompts too; where the kernels run the layers, their keys and
        values are kept (``prefixes``) and copied, not computed again, when a prompt begins
        with the same embeddings: the same bits, as a position's keys and values depend on its
        own and the earlier positions' embeddings alone."""
        hidden = PromptFill(self, embeddings, cache, shared).run()
        assert hidden is not None  # run whole: the prompt is in
        return hidden

    @property
    def prefills_in_pieces(self) -> bool:
        """Whether a prompt can be prefilled a few positions at a time (``PromptFill.run``
        with a limit): where the kernels run the layers, each position attends to the cache
        as the whole prompt's would, so pieces give the whole prompt's bits. Torch's path
        prefills a prompt in one call."""
        return self.decode_layers is not None

    def _prefill_with_torch(self, embeddings: torch.Tensor, cache: KVCache) -> torch.Tensor:
        length = embeddings.shape[0]
        cos, sin = self.cos[:length][None, None], self.sin[:length][None, None]
        x = embeddings.float()[None]
        for index, layer in enumerate(self.layers):
            q, k, v = self._project(layer, x, cos, sin)
            cache.write(index, 0, k[0], v[0])
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._finish(layer, x, attended)
        return self.norm(x[0, -1])

    def _make_room(self, caches: list[KVCache], lengths: list[int]) -> None:
        if max(lengths) + 1 > self.max_positions:
            raise ValueError(f"sequence would exceed {self.max_positions} positions")
        for cache, length in zip(caches, lengths):
            cache.ensure(length + 1)

    @torch.inference_mode()
    def step_and_draw(
        self, embeddings: torch.Tensor, caches: list[KVCache], lengths: list[int], head, sampling
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` and, in the same C++ call, the int8 ``head`` (an ``Int8Packing``) on its
        hidden states and the draw of each row's tokens (``sampling``: ``Kernels.sample``'s
        arguments after the logits): the hidden states [rows, hidden] and the tokens
        [rows, width], the bits of ``step``, ``Kernels.int8_linear`` and ``Kernels.sample``
        called one after the other. Only where ``decode_layers`` is."""
        self._make_room(caches, lengths)
        x = embeddings.to(torch.float32, copy=True).contiguous()
        if self.decode_layers is None:
            raise RuntimeError("step_and_draw needs the C++ layers")
        return self.decode_layers.step_and_draw(
            x, cpp_kernels.StepRows(caches, lengths), head, sampling
        )

    def _attend_per_row(self, index: int, q, k, v, caches, lengths, attended) -> None:
        k_rows, v_rows = k[:, :, 0].unbind(0), v[:, :, 0].unbind(0)
        # Attention runs per row over exactly that row's positions: the CPU kernels'
        # summation order depends on the key count, so padding a row to its neighbours'
        # length would change its result in the last bits, and a request's audio would
        # depend on its batch.
        for row, (cache, length) in enumerate(zip(caches, lengths)):
            keys, values = cache.layer_keys[index], cache.layer_values[index]
            keys[:, length] = k_rows[row]
            values[:, length] = v_rows[row]
            attended[row] = F.scaled_dot_product_attention(
                q[row], keys[:, : length + 1], values[:, : length + 1]
            )

    @torch.inference_mode()
    def step(
        self, embeddings: torch.Tensor, caches: list[KVCache], lengths: list[int]
    ) -> torch.Tensor:
        """One decode step for several sequences.

        ``embeddings`` [rows, hidden] are the new tokens; ``lengths[i]`` is how many positions
        ``caches[i]`` already holds, so also the new token's position. Returns [rows, hidden].
        """
        rows = embeddings.shape[0]
        self._make_room(caches, lengths)
        if self.decode_layers is not None:
            x = embeddings.to(torch.float32, copy=True).contiguous()
            self.decode_layers(x, cpp_kernels.StepRows(caches, lengths))
            return self.norm(x)
        x = embeddings.float()[:, None]
        attended = torch.empty(rows, self.heads, 1, self.head_dim)
        if self.kernels is not None:
            # the kernel rotates q and k itself, straight from the fused projection's output
            step_rows = cpp_kernels.StepRows(caches, lengths)
            for index, layer in enumerate(self.layers):
                qkv = self._normed(layer.attention_norm, layer.qkv, x).view(
                    rows, 3, self.heads, self.head_dim
                )
                self.kernels.attention(
                    index,
                    qkv[:, 0],
                    qkv[:, 1],
                    qkv[:, 2],
                    step_rows,
                    attended,
                    self.scale,
                    (self.cos, self.sin),
                )
                x = self._finish(layer, x, attended)
            return self.norm(x[:, 0])
        positions = torch.tensor(lengths)
        cos = self.cos[positions][:, None, None]  # [rows, 1, 1, dim]
        sin = self.sin[positions][:, None, None]
        for index, layer in enumerate(self.layers):
            q, k, v = self._project(layer, x, cos, sin)
            self._attend_per_row(index, q, k, v, caches, lengths, attended)
            x = self._finish(layer, x, attended)
        return self.norm(x[:, 0])


class PromptFill:
    """One prompt's prefill into its sequence's ``cache``, whole or a few positions at a time
    (``run(limit)``), so a long prompt (a voice's recorded sample, a long segment) never holds
    the other rows for longer than a piece takes. Where the kernels run the layers, the
    positions ``0..done`` are in the cache before each piece, and each new position attends to
    them and to the piece's earlier ones: the bits of the whole prompt in one call (tested).
    A beginning other prompts share (``shared``) is copied from the transformer's kept
    prefixes when held, and kept once computed."""

    def __init__(
        self, transformer: Transformer, embeddings: torch.Tensor, cache: KVCache, shared=0
    ):
        length = embeddings.shape[0]
        if length > transformer.max_positions:
            raise ValueError(
                f"prompt of {length} tokens exceeds {transformer.max_positions} positions"
            )
        self.transformer, self.cache, self.length = transformer, cache, length
        self.done = 0  # positions in the cache
        self._embeddings = embeddings
        self._prefix_key = None  # a shared beginning to keep once computed
        self._shared = shared
        cache.ensure(length)
        if transformer.decode_layers is None:
            return
        self._x = embeddings.to(torch.float32, copy=True).contiguous()
        if 0 < shared < length:
            key = transformer.prefixes.key(self._x[:shared])
            held = transformer.prefixes.get(key)
            if held is None:
                self._prefix_key = key
            else:
                cache.restore(held)
                self.done = shared

    @property
    def remaining(self) -> int:
        return self.length - self.done

    def run(self, limit: int | None = None) -> torch.Tensor | None:
        """Prefill up to ``limit`` more positions (all when None, or where pieces are not
        possible); the last position's hidden state once the whole prompt is in, else None."""
        transformer = self.transformer
        if transformer.decode_layers is None:
            self.done = self.length
            return transformer._prefill_with_torch(self._embeddings, self.cache)
        end = self.length if limit is None else min(self.length, self.done + max(1, limit))
        out = transformer.decode_layers.prompt(self._x[self.done : end], self.cache, self.done)
        if self._prefix_key is not None and self.done < self._shared <= end:
            transformer.prefixes.put(self._prefix_key, self.cache.snapshot(self._shared))
            self._prefix_key = None
        self.done = end
        return transformer.norm(out[-1]) if end == self.length else None
