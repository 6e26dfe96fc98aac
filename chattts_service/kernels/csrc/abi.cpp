// The library's identity for the bindings: its ABI version, its structs' sizes and layouts
// (every field's name, offset and type, from the compiler's own offsetof), its messages.
#include <cstddef>
#include <string>
#include <type_traits>

#include "kernels.h"

extern "C" int32_t chatts_abi_version() { return CHATTS_ABI_VERSION; }

extern "C" int64_t chatts_args_size(int32_t kind) {
    switch (kind) {
        case CHATTS_ARGS_ATTENTION: return sizeof(ChattsAttentionArgs);
        case CHATTS_ARGS_RMS_NORM: return sizeof(ChattsRmsNormArgs);
        case CHATTS_ARGS_INT8_LINEAR: return sizeof(ChattsInt8LinearArgs);
        case CHATTS_ARGS_SAMPLE: return sizeof(ChattsSampleArgs);
        case CHATTS_ARGS_DECODE_LAYERS: return sizeof(ChattsDecodeLayersArgs);
        case CHATTS_ARGS_LAYER_WEIGHTS: return sizeof(ChattsLayerWeights);
        case CHATTS_ARGS_INT4_LINEAR: return sizeof(ChattsInt4LinearArgs);
        case CHATTS_ARGS_READ: return sizeof(ChattsReadArgs);
        case CHATTS_ARGS_TUNING: return sizeof(ChattsTuning);
        case CHATTS_ARGS_LINEAR_WEIGHTS: return sizeof(ChattsLinearWeights);
        case CHATTS_ARGS_DEPTHWISE: return sizeof(ChattsDepthwiseArgs);
        default: return -1;
    }
}

namespace {

template <typename T>
const char* type_code() {
    if constexpr (std::is_pointer_v<T>) return "P";
    else if constexpr (std::is_same_v<T, int64_t>) return "q";
    else if constexpr (std::is_same_v<T, int32_t>) return "i";
    else if constexpr (std::is_same_v<T, uint64_t>) return "Q";
    else if constexpr (std::is_same_v<T, float>) return "f";
    else if constexpr (std::is_same_v<T, ChattsTuning>) return "Tuning";
    else if constexpr (std::is_same_v<T, ChattsLinearWeights>) return "LinearWeights";
    else static_assert(sizeof(T) == 0, "a field type the layout check does not know");
}

#define CHATTS_FIELD(Struct, name) \
    out += std::string(#name ":") + std::to_string(offsetof(Struct, name)) + ":" + \
           type_code<decltype(Struct::name)>() + ","

std::string layout(int32_t kind) {
    std::string out;
    switch (kind) {
        case CHATTS_ARGS_ATTENTION: {
            using S = ChattsAttentionArgs;
            CHATTS_FIELD(S, rows); CHATTS_FIELD(S, heads); CHATTS_FIELD(S, dim);
            CHATTS_FIELD(S, layer); CHATTS_FIELD(S, scale); CHATTS_FIELD(S, threads);
            CHATTS_FIELD(S, q); CHATTS_FIELD(S, q_row_stride); CHATTS_FIELD(S, k_new);
            CHATTS_FIELD(S, k_row_stride); CHATTS_FIELD(S, v_new); CHATTS_FIELD(S, v_row_stride);
            CHATTS_FIELD(S, keys); CHATTS_FIELD(S, values); CHATTS_FIELD(S, key_scales);
            CHATTS_FIELD(S, value_scales); CHATTS_FIELD(S, capacity); CHATTS_FIELD(S, lengths);
            CHATTS_FIELD(S, cos); CHATTS_FIELD(S, sin); CHATTS_FIELD(S, out);
            break;
        }
        case CHATTS_ARGS_RMS_NORM: {
            using S = ChattsRmsNormArgs;
            CHATTS_FIELD(S, rows); CHATTS_FIELD(S, width); CHATTS_FIELD(S, x);
            CHATTS_FIELD(S, x_row_stride); CHATTS_FIELD(S, gain); CHATTS_FIELD(S, eps);
            CHATTS_FIELD(S, out); CHATTS_FIELD(S, row_max);
            break;
        }
        case CHATTS_ARGS_INT8_LINEAR: {
            using S = ChattsInt8LinearArgs;
            CHATTS_FIELD(S, rows); CHATTS_FIELD(S, n); CHATTS_FIELD(S, k); CHATTS_FIELD(S, x);
            CHATTS_FIELD(S, x_row_stride); CHATTS_FIELD(S, gain); CHATTS_FIELD(S, eps);
            CHATTS_FIELD(S, swiglu); CHATTS_FIELD(S, packed); CHATTS_FIELD(S, offsets);
            CHATTS_FIELD(S, weight_scale); CHATTS_FIELD(S, residual);
            CHATTS_FIELD(S, residual_stride); CHATTS_FIELD(S, out); CHATTS_FIELD(S, out_stride);
            CHATTS_FIELD(S, levels); CHATTS_FIELD(S, product); CHATTS_FIELD(S, threads);
            CHATTS_FIELD(S, tuning);
            break;
        }
        case CHATTS_ARGS_SAMPLE: {
            using S = ChattsSampleArgs;
            CHATTS_FIELD(S, rows); CHATTS_FIELD(S, width); CHATTS_FIELD(S, vocabulary);
            CHATTS_FIELD(S, logits); CHATTS_FIELD(S, parameters); CHATTS_FIELD(S, top_k);
            CHATTS_FIELD(S, min_keep); CHATTS_FIELD(S, windows); CHATTS_FIELD(S, window);
            CHATTS_FIELD(S, banned); CHATTS_FIELD(S, uniforms); CHATTS_FIELD(S, tokens);
            CHATTS_FIELD(S, threads);
            break;
        }
        case CHATTS_ARGS_DECODE_LAYERS: {
            using S = ChattsDecodeLayersArgs;
            CHATTS_FIELD(S, rows); CHATTS_FIELD(S, hidden); CHATTS_FIELD(S, heads);
            CHATTS_FIELD(S, dim); CHATTS_FIELD(S, intermediate); CHATTS_FIELD(S, layer_count);
            CHATTS_FIELD(S, eps); CHATTS_FIELD(S, scale); CHATTS_FIELD(S, threads);
            CHATTS_FIELD(S, tuning); CHATTS_FIELD(S, layers); CHATTS_FIELD(S, x);
            CHATTS_FIELD(S, scratch); CHATTS_FIELD(S, keys); CHATTS_FIELD(S, values);
            CHATTS_FIELD(S, key_scales); CHATTS_FIELD(S, value_scales);
            CHATTS_FIELD(S, capacity); CHATTS_FIELD(S, lengths); CHATTS_FIELD(S, cos);
            CHATTS_FIELD(S, sin); CHATTS_FIELD(S, prompt); CHATTS_FIELD(S, final_gain);
            CHATTS_FIELD(S, hiddens); CHATTS_FIELD(S, head); CHATTS_FIELD(S, logits);
            CHATTS_FIELD(S, sample);
            break;
        }
        case CHATTS_ARGS_LAYER_WEIGHTS: {
            using S = ChattsLayerWeights;
            CHATTS_FIELD(S, attention_gain); CHATTS_FIELD(S, mlp_gain); CHATTS_FIELD(S, qkv);
            CHATTS_FIELD(S, out); CHATTS_FIELD(S, gate_up); CHATTS_FIELD(S, down);
            break;
        }
        case CHATTS_ARGS_INT4_LINEAR: {
            using S = ChattsInt4LinearArgs;
            CHATTS_FIELD(S, rows); CHATTS_FIELD(S, n); CHATTS_FIELD(S, k); CHATTS_FIELD(S, group);
            CHATTS_FIELD(S, x); CHATTS_FIELD(S, x_row_stride); CHATTS_FIELD(S, gain);
            CHATTS_FIELD(S, eps); CHATTS_FIELD(S, swiglu); CHATTS_FIELD(S, packed);
            CHATTS_FIELD(S, scales); CHATTS_FIELD(S, residual); CHATTS_FIELD(S, residual_stride);
            CHATTS_FIELD(S, out); CHATTS_FIELD(S, out_stride); CHATTS_FIELD(S, levels);
            CHATTS_FIELD(S, product); CHATTS_FIELD(S, threads); CHATTS_FIELD(S, tuning);
            break;
        }
        case CHATTS_ARGS_READ: {
            using S = ChattsReadArgs;
            CHATTS_FIELD(S, count); CHATTS_FIELD(S, buffers); CHATTS_FIELD(S, bytes);
            CHATTS_FIELD(S, prefetch_bytes); CHATTS_FIELD(S, threads); CHATTS_FIELD(S, streams);
            CHATTS_FIELD(S, checksum);
            break;
        }
        case CHATTS_ARGS_TUNING: {
            using S = ChattsTuning;
            CHATTS_FIELD(S, prefetch_groups); CHATTS_FIELD(S, prefetch_hint);
            CHATTS_FIELD(S, pair_blocks_from); CHATTS_FIELD(S, tiles_from);
            CHATTS_FIELD(S, quads_up_to); CHATTS_FIELD(S, octs_up_to);
            CHATTS_FIELD(S, bare_up_to);
            break;
        }
        case CHATTS_ARGS_LINEAR_WEIGHTS: {
            using S = ChattsLinearWeights;
            CHATTS_FIELD(S, packed); CHATTS_FIELD(S, offsets); CHATTS_FIELD(S, weight_scale);
            CHATTS_FIELD(S, n); CHATTS_FIELD(S, k); CHATTS_FIELD(S, group); CHATTS_FIELD(S, bits);
            CHATTS_FIELD(S, levels); CHATTS_FIELD(S, product);
            break;
        }
        case CHATTS_ARGS_DEPTHWISE: {
            using S = ChattsDepthwiseArgs;
            CHATTS_FIELD(S, batch); CHATTS_FIELD(S, channels); CHATTS_FIELD(S, time);
            CHATTS_FIELD(S, kernel); CHATTS_FIELD(S, dilation); CHATTS_FIELD(S, padding);
            CHATTS_FIELD(S, x); CHATTS_FIELD(S, x_float); CHATTS_FIELD(S, weights);
            CHATTS_FIELD(S, bias); CHATTS_FIELD(S, out); CHATTS_FIELD(S, threads);
            CHATTS_FIELD(S, float32);
            break;
        }
        default: return "";
    }
    if (!out.empty()) out.pop_back();
    return out;
}

#undef CHATTS_FIELD

}  // namespace

extern "C" const char* chatts_args_layout(int32_t kind) {
    static const std::string layouts[] = {layout(0), layout(1), layout(2), layout(3), layout(4),
                                          layout(5), layout(6), layout(7), layout(8), layout(9),
                                          layout(10)};
    if (kind < 0 || kind >= static_cast<int32_t>(std::size(layouts))) return nullptr;
    return layouts[kind].c_str();
}

extern "C" const char* chatts_status_message(int32_t status) {
    switch (status) {
        case CHATTS_OK: return "ok";
        case CHATTS_HEAD_DIM_TOO_LARGE: return "head dimension above 256";
        case CHATTS_CACHE_FULL: return "a sequence's cache is full";
        case CHATTS_WIDTH_NOT_MULTIPLE_OF_4: return "int8_linear needs in_features % 4 == 0";
        case CHATTS_CPU_LACKS_PRODUCT: return "this CPU lacks the int8 product's instructions";
        case CHATTS_TOO_MANY_LEVELS:
            return "too many activation levels for the int8 product's instructions";
        case CHATTS_UNKNOWN_PRODUCT: return "unknown int8 product";
        case CHATTS_BAD_SAMPLING: return "sample needs a vocabulary and min_keep >= 1";
        case CHATTS_BAD_TUNING:
            return "prefetch distance must be 0-256 groups, hint 0 or 1, pairs from 1-9 rows, "
                   "tiles from 2-65 rows or never (0), quads up to 0-4 rows, octs up to 0-2, "
                   "no prefetch up to 0-4";
        case CHATTS_NO_TILES: return "AMX tiles asked for, but this CPU or its OS has none";
        case CHATTS_BAD_READ:
            return "read needs a count and prefetch >= 0, a thread and 1-16 streams";
        case CHATTS_BAD_PEAK: return "a peak loop needs a known kind, an iteration and a thread";
        case CHATTS_BAD_DEPTHWISE:
            return "a depthwise convolution needs channels, time, a kernel, dilation >= 1, "
                   "padding >= 0 and a thread (in float32: a float32 input)";
        case CHATTS_BAD_GROUP:
            return "int4 groups must be 8 to 64 inputs, a multiple of 8, and divide in_features";
        default: return "unknown status";
    }
}
