"""The kernels' C interface as ctypes sees it: a mirror of ``csrc/kernels.h``.

Each kernel takes one argument struct. ``declare`` compares the library's ABI version and every
struct, field by field (name, offset and type, which the library reports from the compiler's
own ``offsetof``), with these, so a library built from other sources is refused at load, with
the first field that differs, instead of reading the wrong memory: two fields of one type
swapped have the same size and would pass a size check.
"""

from __future__ import annotations

import ctypes

ABI_VERSION = 13

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p

# ChattsProduct
PRODUCT_AVX2 = 1
PRODUCT_VNNI = 2
PRODUCT_NEON = 3
PRODUCT_DOTPROD = 4
PRODUCT_I8MM = 5
# ChattsPeak: the instruction loops of chatts_peak_loop
PEAK_LOOPS = {"avx2": 1, "vnni": 2, "fp32": 3, "bf16": 4}


class Tuning(ctypes.Structure):
    _fields_ = [
        ("prefetch_groups", _i32),
        ("prefetch_hint", _i32),
        ("pair_blocks_from", _i32),
        ("tiles_from", _i32),
        ("quads_up_to", _i32),
        ("octs_up_to", _i32),
        ("bare_up_to", _i32),
    ]


def default_tuning() -> Tuning:
    """The product's tuning before kernels/tuning.py chooses one (its ``DEFAULT``): 1 KB of
    weights prefetched ahead, non-temporally; single blocks; no tiles."""
    return Tuning(
        prefetch_groups=16,
        prefetch_hint=0,
        pair_blocks_from=9,
        tiles_from=0,
        quads_up_to=0,
        octs_up_to=0,
        bare_up_to=0,
    )


class AttentionArgs(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("heads", _i64),
        ("dim", _i64),
        ("layer", _i64),
        ("scale", _f32),
        ("threads", _i32),
        ("q", _ptr),
        ("q_row_stride", _i64),
        ("k_new", _ptr),
        ("k_row_stride", _i64),
        ("v_new", _ptr),
        ("v_row_stride", _i64),
        ("keys", _ptr),
        ("values", _ptr),
        ("key_scales", _ptr),
        ("value_scales", _ptr),
        ("capacity", _ptr),
        ("lengths", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("out", _ptr),
    ]


class RmsNormArgs(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("width", _i64),
        ("x", _ptr),
        ("x_row_stride", _i64),
        ("gain", _ptr),
        ("eps", _f32),
        ("out", _ptr),
        ("row_max", _ptr),
    ]


class Int8LinearArgs(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("n", _i64),
        ("k", _i64),
        ("x", _ptr),
        ("x_row_stride", _i64),
        ("gain", _ptr),
        ("eps", _f32),
        ("swiglu", _i32),
        ("packed", _ptr),
        ("offsets", _ptr),
        ("weight_scale", _ptr),
        ("residual", _ptr),
        ("residual_stride", _i64),
        ("out", _ptr),
        ("out_stride", _i64),
        ("levels", _i32),
        ("product", _i32),
        ("threads", _i32),
        ("tuning", Tuning),
    ]


class LinearWeights(ctypes.Structure):
    _fields_ = [
        ("packed", _ptr),
        ("offsets", _ptr),
        ("weight_scale", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("group", _i64),
        ("bits", _i32),
        ("levels", _i32),
        ("product", _i32),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("attention_gain", _ptr),
        ("mlp_gain", _ptr),
        ("qkv", LinearWeights),
        ("out", LinearWeights),
        ("gate_up", LinearWeights),
        ("down", LinearWeights),
    ]


class DecodeLayersArgs(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("hidden", _i64),
        ("heads", _i64),
        ("dim", _i64),
        ("intermediate", _i64),
        ("layer_count", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("threads", _i32),
        ("tuning", Tuning),
        ("layers", _ptr),
        ("x", _ptr),
        ("scratch", _ptr),
        ("keys", _ptr),
        ("values", _ptr),
        ("key_scales", _ptr),
        ("value_scales", _ptr),
        ("capacity", _ptr),
        ("lengths", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("prompt", _i32),
        ("final_gain", _ptr),
        ("hiddens", _ptr),
        ("head", _ptr),
        ("logits", _ptr),
        ("sample", _ptr),
    ]


class Int4LinearArgs(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("n", _i64),
        ("k", _i64),
        ("group", _i64),
        ("x", _ptr),
        ("x_row_stride", _i64),
        ("gain", _ptr),
        ("eps", _f32),
        ("swiglu", _i32),
        ("packed", _ptr),
        ("scales", _ptr),
        ("residual", _ptr),
        ("residual_stride", _i64),
        ("out", _ptr),
        ("out_stride", _i64),
        ("levels", _i32),
        ("product", _i32),
        ("threads", _i32),
        ("tuning", Tuning),
    ]


class SampleArgs(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("width", _i64),
        ("vocabulary", _i64),
        ("logits", _ptr),
        ("parameters", _ptr),
        ("top_k", _ptr),
        ("min_keep", _i64),
        ("windows", _ptr),
        ("window", _i64),
        ("banned", _ptr),
        ("uniforms", _ptr),
        ("tokens", _ptr),
        ("threads", _i32),
    ]


class ReadArgs(ctypes.Structure):
    _fields_ = [
        ("count", _i64),
        ("buffers", _ptr),
        ("bytes", _ptr),
        ("prefetch_bytes", _i64),
        ("threads", _i32),
        ("streams", _i32),
        ("checksum", ctypes.c_uint64),
    ]


class DepthwiseArgs(ctypes.Structure):
    _fields_ = [
        ("batch", _i64),
        ("channels", _i64),
        ("time", _i64),
        ("kernel", _i64),
        ("dilation", _i64),
        ("padding", _i64),
        ("x", _ptr),
        ("x_float", _i32),
        ("weights", _ptr),
        ("bias", _ptr),
        ("out", _ptr),
        ("threads", _i32),
        ("float32", _i32),
    ]


# ChattsArgsKind: the library reports each struct's size by this number
STRUCTS = {
    0: AttentionArgs,
    1: RmsNormArgs,
    2: Int8LinearArgs,
    3: SampleArgs,
    4: DecodeLayersArgs,
    5: LayerWeights,
    6: Int4LinearArgs,
    7: ReadArgs,
    8: Tuning,
    9: LinearWeights,
    10: DepthwiseArgs,
}
# the library's type codes (chatts_args_layout) for these bindings' field types
_TYPE_CODES = {_i64: "q", _i32: "i", ctypes.c_uint64: "Q", _f32: "f", _ptr: "P"}


class AbiMismatch(RuntimeError):
    """The library was built from sources whose interface differs from these bindings."""


def declare(library: ctypes.CDLL) -> None:
    """Give every exported function its types, and check the library against this module
    (``AbiMismatch`` where it differs, or lacks a function: another library altogether)."""
    try:
        _declare(library)
    except AttributeError as error:  # ctypes: an undefined symbol
        raise AbiMismatch(f"not the kernels' library: {error}") from error


def _declare(library: ctypes.CDLL) -> None:
    library.chatts_abi_version.restype = _i32
    library.chatts_abi_version.argtypes = []
    library.chatts_args_size.restype = _i64
    library.chatts_args_size.argtypes = [_i32]
    library.chatts_args_layout.restype = ctypes.c_char_p
    library.chatts_args_layout.argtypes = [_i32]
    library.chatts_status_message.restype = ctypes.c_char_p
    library.chatts_status_message.argtypes = [_i32]
    library.chatts_amx_tiles.restype = _i32
    library.chatts_amx_tiles.argtypes = []
    library.chatts_int8_products.restype = _i32
    library.chatts_int8_products.argtypes = []
    library.chatts_peak_loop.restype = _i64
    library.chatts_peak_loop.argtypes = [_i32, _i64, _i32, ctypes.POINTER(ctypes.c_uint64)]
    for name, struct, result in (
        ("chatts_decode_attention", AttentionArgs, _i32),
        ("chatts_rms_norm_unit_rows", RmsNormArgs, None),
        ("chatts_rms_norm", RmsNormArgs, None),
        ("chatts_int8_linear", Int8LinearArgs, _i32),
        ("chatts_sample", SampleArgs, _i32),
        ("chatts_decode_layers", DecodeLayersArgs, _i32),
        ("chatts_int4_linear", Int4LinearArgs, _i32),
        ("chatts_read_buffers", ReadArgs, _i32),
        ("chatts_depthwise_conv1d", DepthwiseArgs, _i32),
    ):
        function = getattr(library, name)
        function.restype = result
        function.argtypes = [ctypes.POINTER(struct)]
    version = library.chatts_abi_version()
    if version != ABI_VERSION:
        raise AbiMismatch(
            f"the kernel library has ABI version {version}, these bindings "
            f"{ABI_VERSION}: rebuild it (python -m chattts_service.kernels.build)"
        )
    for kind, declared in STRUCTS.items():
        size = library.chatts_args_size(kind)
        if size != ctypes.sizeof(declared):
            raise AbiMismatch(
                f"{declared.__name__} is {size} bytes in the kernel library and "
                f"{ctypes.sizeof(declared)} in the bindings"
            )
        theirs = (library.chatts_args_layout(kind) or b"").decode().split(",")
        ours = layout(declared)
        for index in range(max(len(theirs), len(ours))):
            library_field = theirs[index] if index < len(theirs) else "nothing"
            binding_field = ours[index] if index < len(ours) else "nothing"
            if library_field != binding_field:
                raise AbiMismatch(
                    f"{declared.__name__}'s field {index} is {library_field} (name:offset:type) "
                    f"in the kernel library and {binding_field} in the bindings: rebuild the "
                    "library from these sources (python -m chattts_service.kernels.build)"
                )


def layout(struct) -> list[str]:
    """A struct's fields as the library reports its own: ``name:offset:type``."""
    fields = []
    for name, field_type in struct._fields_:
        code = _TYPE_CODES.get(field_type) or field_type.__name__  # a nested struct: its name
        fields.append(f"{name}:{getattr(struct, name).offset}:{code}")
    return fields


def status_message(library: ctypes.CDLL, status: int) -> str:
    return library.chatts_status_message(status).decode()
