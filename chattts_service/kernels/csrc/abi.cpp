// The library's identity for the bindings: its ABI version, its structs' sizes, its messages.
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
        default: return -1;
    }
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
            return "prefetch distance must be 0-256 groups, hint 0 or 1, pairs from 2-9 rows";
        case CHATTS_BAD_READ: return "read needs a count and prefetch >= 0 and a thread";
        case CHATTS_BAD_GROUP:
            return "int4 groups must be 8 to 64 inputs, a multiple of 8, and divide in_features";
        default: return "unknown status";
    }
}
