"""A decode step through every GPT layer in one C++ call (``csrc/decode_layers.cpp``).

Layer by layer from Python, a step made 100 kernel calls (20 layers of four projections and an
attention), each paying for argument checks, ctypes and allocation: a large part of a batch-1
step. ``DecodeLayers`` checks the layers' weights and gathers their
pointers once, when the model loads; a step then passes only the rows, their caches and one
scratch buffer. The C side calls the same kernels in the same order, so the bits are those of
the calls one layer at a time (a test holds the two equal).

``prompt`` runs a sequence's prompt through the same call (its positions as the rows, each
stored in the cache before any attends), where from Python a prefill made 80 product calls and
a hundred small operators around torch's attention.

``step_and_draw`` goes on in the same call to what a speech step does next: the final norm,
the code head and the draw of every row's tokens. From Python those were three more calls and
a dozen small operators, and the first of them paid for caches the layers' weights had just
swept; the bits are again those of the separate calls.
"""

from __future__ import annotations

import ctypes

import torch

from chattts_service.kernels import abi
from chattts_service.kernels.bindings import (
    Kernels,
    SampleCall,
    StepRows,
    _check_gain,
    check_rotary,
)
from chattts_service.kernels.int4 import Int4Packing
from chattts_service.kernels.int8 import INT8_INSTRUCTIONS, Int8Packing


def _linear(packing, int4_instructions: str) -> abi.LinearWeights:
    """An ``Int8Packing`` or an ``Int4Packing`` (multiplied with ``int4_instructions``, the
    kernels' int8 product) as the C step reads it."""
    if isinstance(packing, Int4Packing):
        return abi.LinearWeights(
            packed=packing.packed.data_ptr(),
            offsets=None,
            weight_scale=packing.scales.data_ptr(),
            n=packing.out_features,
            k=packing.in_features,
            group=packing.group,
            bits=4,
            levels=packing.levels,
            product=INT8_INSTRUCTIONS[int4_instructions][0],
        )
    packed, offsets, weight_scale = packing.pointers
    product, levels = INT8_INSTRUCTIONS[packing.instructions]
    return abi.LinearWeights(
        packed=packed,
        offsets=offsets,
        weight_scale=weight_scale,
        n=packing.out_features,
        k=packing.in_features,
        group=0,
        bits=8,
        levels=levels,
        product=product,
    )


class DecodeLayers:
    """The layers' packings and norm gains, checked and gathered for one call a step.

    ``layers``: per layer (qkv, out, gate_up, down packings: ``Int8Packing`` or
    ``Int4Packing``, attention gain, mlp gain); ``rotary``: the (cos, sin) tables
    [positions, head_dim]; ``final_gain``: the final RMSNorm's gain (``step_and_draw``)."""

    def __init__(
        self,
        kernels: Kernels,
        layers: list[tuple],
        heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        rotary: tuple[torch.Tensor, torch.Tensor],
        final_gain: torch.Tensor,
    ):
        if not layers:
            raise ValueError("no layers to gather")
        self.kernels = kernels
        self.heads, self.head_dim = heads, head_dim
        self.hidden = heads * head_dim
        self.intermediate = layers[0][2].out_features // 2  # gate_up: twice the MLP's width
        instructions = {
            packing.instructions
            if isinstance(packing, Int8Packing)
            else f"int4 on {kernels.int8_instructions}"
            for layer in layers
            for packing in layer[:4]
        }
        self.instructions = "/".join(sorted(instructions))
        hidden, intermediate = self.hidden, self.intermediate
        shapes = (
            (3 * hidden, hidden),
            (hidden, hidden),
            (2 * intermediate, hidden),
            (hidden, intermediate),
        )
        self.weights = (abi.LayerWeights * len(layers))()
        self._held = []  # what the pointers point into, alive as long as this
        for index, (*packings, attention_gain, mlp_gain) in enumerate(layers):
            for packing, shape in zip(packings, shapes):
                if (packing.out_features, packing.in_features) != shape:
                    raise ValueError(
                        f"layer {index}: a projection of {packing.out_features}x"
                        f"{packing.in_features}, not {shape[0]}x{shape[1]}"
                    )
            for gain in (attention_gain, mlp_gain):
                _check_gain(gain, hidden)
            gains = (attention_gain, mlp_gain)
            self._held.append((packings, gains))
            self.weights[index] = abi.LayerWeights(
                gains[0].data_ptr(),
                gains[1].data_ptr(),
                *(_linear(p, kernels.int8_instructions) for p in packings),
            )
        _check_gain(final_gain, hidden)
        self.final_gain = final_gain
        self.eps, self.scale = eps, scale
        self.positions = check_rotary(rotary, head_dim)
        self.cos, self.sin = rotary

    def __len__(self) -> int:
        return len(self.weights)

    def scratch_floats(self, rows: int) -> int:
        return rows * (5 * self.hidden + 2 * self.intermediate)

    def __call__(self, x: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """Run the new tokens ``x`` [rows, hidden] float32 through every layer, writing each
        row's key and value into its cache at position ``rows.lengths[i]``; returns the last
        layer's output (``x`` itself, overwritten)."""
        self._run(x, rows)
        return x

    def prompt(self, x: torch.Tensor, cache, start: int = 0) -> torch.Tensor:
        """A sequence's prompt ``x`` [length, hidden] float32 through every layer into its
        ``cache`` at positions start..start+length-1, after the ``start`` it holds already
        (causal attention, every position's key and value stored before any attends); returns
        the last layer's output (``x`` itself)."""
        length = x.shape[0]
        self._run(x, StepRows([cache] * length, list(range(start, start + length))), prompt=True)
        return x

    def step_and_draw(
        self, x: torch.Tensor, rows: StepRows, head, sampling: tuple
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(x, rows)``, then in the same call the final RMSNorm of each row (as
        ``Kernels.rms_norm``), the int8 ``head`` (an ``Int8Packing``) on the normed rows (as
        ``Kernels.int8_linear``) and the draw (as ``Kernels.sample`` with ``sampling``: its
        arguments after the logits). Returns the normed rows [rows, hidden] and the tokens
        [rows, width]."""
        if not isinstance(head, Int8Packing) or head.in_features != self.hidden:
            raise ValueError(f"the head must be an int8 packing of {self.hidden} inputs")
        count = x.shape[0]
        hiddens = torch.empty(count, self.hidden)
        logits = torch.empty(count, head.out_features)
        draw = SampleCall(logits, *sampling)
        if draw.tokens.shape[0] != count:
            raise ValueError("one sampling row per row")
        weights = _linear(head, self.kernels.int8_instructions)
        tail = {
            "final_gain": self.final_gain.data_ptr(),
            "hiddens": hiddens.data_ptr(),
            "head": ctypes.addressof(weights),
            "logits": logits.data_ptr(),
            "sample": ctypes.addressof(draw.arguments),
        }
        self._run(x, rows, tail, head.instructions)
        return hiddens, draw.tokens

    def _run(
        self,
        x: torch.Tensor,
        rows: StepRows,
        tail: dict | None = None,
        head: str = "",
        prompt: bool = False,
    ) -> None:
        count = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (count, self.hidden):
            raise ValueError(f"x must be a contiguous float32 [rows, {self.hidden}] tensor")
        if len(rows.lengths) != count:
            raise ValueError("one cache per row")
        rows.check_positions(self.positions)
        shapes = {tuple(cache.keys.shape[:2]) + (cache.keys.shape[3],) for cache in rows.caches}
        if shapes != {(len(self), self.heads, self.head_dim)}:
            raise ValueError("a cache of another shape than the layers'")
        scratch = torch.empty(self.scratch_floats(count))
        kernels = self.kernels
        arguments = abi.DecodeLayersArgs(
            rows=count,
            hidden=self.hidden,
            heads=self.heads,
            dim=self.head_dim,
            intermediate=self.intermediate,
            layer_count=len(self),
            eps=self.eps,
            scale=self.scale,
            threads=torch.get_num_threads(),
            tuning=kernels.tuning,
            layers=ctypes.addressof(self.weights),
            x=x.data_ptr(),
            scratch=scratch.data_ptr(),
            **rows.pointers(),
            cos=self.cos.data_ptr(),
            sin=self.sin.data_ptr(),
            prompt=int(prompt),
            **(tail or {}),
        )
        instructions = "/".join(sorted({self.instructions, head} - {""}))
        kernels.check(kernels.library.chatts_decode_layers(ctypes.byref(arguments)), instructions)
