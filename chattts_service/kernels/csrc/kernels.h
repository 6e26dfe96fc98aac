// The C interface of the decode loop's kernels: what Python's ctypes bindings
// (chattts_service/kernels/bindings.py) mirror. Each kernel takes one argument struct, so the
// two sides agree on names and types, not on the position of twenty arguments; the bindings
// check CHATTS_ABI_VERSION and every struct's fields (name, offset and type, as
// chatts_args_layout reports them from offsetof) when they load the library, so a library
// built from other sources fails loudly instead of reading the wrong memory.
#pragma once

#include <cstdint>

#ifndef CHATTS_ABI_VERSION  // a test builds a library of another version to see it refused
#define CHATTS_ABI_VERSION 13
#endif

// What a kernel returns. chatts_status_message() gives each one's text.
enum ChattsStatus : int32_t {
    CHATTS_OK = 0,
    CHATTS_HEAD_DIM_TOO_LARGE = 1,     // attention: head dimension above 256
    CHATTS_CACHE_FULL = 2,             // attention: a sequence's cache holds no more positions
    CHATTS_WIDTH_NOT_MULTIPLE_OF_4 = 3,  // int8 linear: in_features % 4 != 0
    CHATTS_CPU_LACKS_PRODUCT = 4,      // int8 linear: the CPU cannot run the product asked for
    CHATTS_TOO_MANY_LEVELS = 5,        // int8 linear: activation levels beyond the product's
    CHATTS_UNKNOWN_PRODUCT = 6,        // int8 linear: not one of ChattsProduct
    CHATTS_BAD_SAMPLING = 7,           // sample: empty vocabulary or min_keep < 1
    CHATTS_BAD_TUNING = 8,             // int8/int4 linear: prefetch or pairing out of range
    CHATTS_BAD_GROUP = 9,              // int4 linear: group not 8..64 in 8s, or not dividing k
    CHATTS_BAD_READ = 10,              // read buffers: a negative count or prefetch, no thread
    CHATTS_NO_TILES = 11,              // int8 linear: tiles asked for, AMX not granted
    CHATTS_BAD_PEAK = 12,              // peak loop: no iteration, no thread, or unknown loop
    CHATTS_BAD_DEPTHWISE = 13,         // depthwise conv: an empty shape, dilation < 1, ...
};

// The int8 product's instructions.
enum ChattsProduct : int32_t {
    CHATTS_PRODUCT_AVX2 = 1,  // 7-bit activations (levels up to 63)
    CHATTS_PRODUCT_VNNI = 2,  // AVX512-VNNI, 8-bit activations (levels up to 127)
    // aarch64 (int8_linear_arm.cpp), all three with 8-bit activations (levels up to 127):
    CHATTS_PRODUCT_NEON = 3,     // Armv8.0 NEON: smull, sadalp
    CHATTS_PRODUCT_DOTPROD = 4,  // Armv8.2 DotProd: sdot
    CHATTS_PRODUCT_I8MM = 5,     // Armv8.6 I8MM: smmla
};

// The instruction loops chatts_peak_loop runs (csrc/peak.cpp).
enum ChattsPeak : int32_t {
    CHATTS_PEAK_AVX2 = 1,  // the AVX2 int8 product's: vpmaddubsw, vpmaddwd, vpaddd
    CHATTS_PEAK_VNNI = 2,  // the VNNI int8 product's: vpdpbusd
    CHATTS_PEAK_FP32 = 3,  // fp32 vfmadd231ps, 512-bit where the CPU has AVX-512, else 256-bit
    CHATTS_PEAK_BF16 = 4,  // bf16 pairs into fp32 sums, vdpbf16ps (AVX512-BF16), 512-bit
};

// How the int8 product streams its weights: chosen per CPU (kernels/tuning.py), never baked in.
struct ChattsTuning {
    int32_t prefetch_groups;         // prefetch this many 64-byte groups of weights ahead, 0..256
    int32_t prefetch_hint;           // 0: non-temporal (NTA), 1: into every cache level (T0)
    int32_t pair_blocks_from;        // VNNI: from this many rows (1..9) blocks go in pairs
    int32_t tiles_from;              // VNNI: from this many rows (2..65) on AMX tiles; 0: never
    int32_t quads_up_to;             // VNNI: up to this many rows (0..4) blocks go four at a time
    int32_t octs_up_to;              // VNNI: up to this many rows (0..2) blocks go eight at a time
    int32_t bare_up_to;              // up to this many rows (0..4) no prefetch: the hardware's alone
};

struct ChattsAttentionArgs {
    int64_t rows, heads, dim, layer;
    float scale;
    int32_t threads;
    const float* q;                  // per row: heads * dim floats, rows q_row_stride apart
    int64_t q_row_stride;
    const float* k_new;              // the new token's key and value, likewise
    int64_t k_row_stride;
    const float* v_new;
    int64_t v_row_stride;
    void* const* keys;               // per row: its cache's first element
    void* const* values;
    float* const* key_scales;        // per row (int8 caches), or NULL (bf16 caches)
    float* const* value_scales;
    const int64_t* capacity;         // per row: positions its cache can hold
    const int64_t* lengths;          // per row: positions already held
    const float* cos;                // [positions, dim] rotary tables, or NULL
    const float* sin;
    float* out;                      // [rows, heads * dim]
};

struct ChattsRmsNormArgs {
#ifdef CHATTS_TEST_SWAPPED_FIELDS  // a test builds a library whose two fields trade places
    int64_t width, rows;
#else
    int64_t rows, width;
#endif
    const float* x;
    int64_t x_row_stride;
    const float* gain;               // or NULL: only divide by the largest magnitude
    float eps;
    float* out;                      // [rows, width]
    float* row_max;                  // [rows]
};

struct ChattsInt8LinearArgs {
    int64_t rows, n, k;
    const float* x;
    int64_t x_row_stride;
    const float* gain;               // RMSNorm gain, or NULL
    float eps;
    int32_t swiglu;                  // rows of x hold gate then up: multiply silu(gate) * up
    const int8_t* packed;            // the weights as Int8Packing lays them out
    const int32_t* offsets;
    const float* weight_scale;
    const float* residual;           // [rows, n] added to the result, or NULL
    int64_t residual_stride;
    float* out;
    int64_t out_stride;
    int32_t levels;                  // the activations' levels either side of zero
    int32_t product;                 // a ChattsProduct
    int32_t threads;
    ChattsTuning tuning;
};

// One GPT layer's weights for chatts_decode_layers: its two RMSNorm gains and its four int8
// projections as Int8Packing lays them out (q/k/v fused; gate/up fused).
struct ChattsLinearWeights {
    const void* packed;              // int8 (Int8Packing) or nibbles (Int4Packing)
    const int32_t* offsets;          // int8: as chatts_int8_linear takes them; int4: NULL
    const float* weight_scale;       // int8: per channel; int4: per group ([blocks, groups, 16])
    int64_t n, k;                    // out_features, in_features
    int64_t group;                   // int4: inputs a scale covers; int8: 0
    int32_t bits;                    // 8 or 4
    int32_t levels;                  // the activations' levels either side of zero
    int32_t product;                 // a ChattsProduct
};

struct ChattsLayerWeights {
    const float* attention_gain;
    const float* mlp_gain;
    ChattsLinearWeights qkv, out, gate_up, down;
};

// A decode step through every layer: per layer, the q/k/v projection of the RMSNorm-ed rows,
// attention (as chatts_decode_attention), the output projection plus the residual, and the
// MLP (RMSNorm, gate/up, SwiGLU, down plus the residual). The same kernels, in the same order,
// as the calls one layer at a time: the same bits.
struct ChattsDecodeLayersArgs {
    int64_t rows, hidden, heads, dim, intermediate, layer_count;
    float eps, scale;
    int32_t threads;
    ChattsTuning tuning;
    const ChattsLayerWeights* layers;  // [layer_count]
    float* x;                        // [rows, hidden]: the new tokens in, the last layer's out
    float* scratch;                  // rows * (5 * hidden + 2 * intermediate) floats
    void* const* keys;               // as ChattsAttentionArgs
    void* const* values;
    float* const* key_scales;
    float* const* value_scales;
    const int64_t* capacity;
    const int64_t* lengths;
    const float* cos;
    const float* sin;
    // 1: the rows are one sequence's prompt, its positions lengths[i] = i in one cache (every
    // row's key and value is stored before any row attends); 0: a decode step's rows
    int32_t prompt;
    // What follows the last layer, in the same call; each part needs the ones before it, and
    // NULL skips it and the rest: the final RMSNorm of x into `hiddens` (as chatts_rms_norm),
    // an int8 head on those into `logits` (as chatts_int8_linear), and the draw of each row's
    // tokens from the logits (as chatts_sample, whose `logits` must be this `logits`).
    const float* final_gain;         // [hidden]
    float* hiddens;                  // [rows, hidden]
    const ChattsLinearWeights* head; // an int8 head, head->k == hidden
    float* logits;                   // [rows, head->n]
    const struct ChattsSampleArgs* sample;
};

// The int4 product (csrc/int4_linear.cpp): x as chatts_int8_linear takes it.
struct ChattsInt4LinearArgs {
    int64_t rows, n, k, group;
    const float* x;
    int64_t x_row_stride;
    const float* gain;
    float eps;
    int32_t swiglu;
    const uint8_t* packed;           // the weights as Int4Packing lays them out
    const float* scales;             // [blocks, k / group, 16]: each group's scale / levels
    const float* residual;
    int64_t residual_stride;
    float* out;
    int64_t out_stride;
    int32_t levels;                  // the activations' levels either side of zero (<= 63)
    int32_t product;                 // a ChattsProduct: the same bits either way
    int32_t threads;
    ChattsTuning tuning;
};

struct ChattsSampleArgs {
    int64_t rows, width, vocabulary;
    const float* logits;             // [rows, width * vocabulary]
    const float* parameters;         // [rows, 3]: temperature, repetition penalty, 1 - top_p
    const int64_t* top_k;            // [rows]
    int64_t min_keep;                // tokens top-p and top-k always keep (ChatTTS: 3)
    const int64_t* windows;          // [rows, width, window]: recent tokens, `vocabulary` = none
    int64_t window;
    const int64_t* banned;           // [rows]: a token to forbid, or -1
    const float* uniforms;           // [rows, width], in [0, 1)
    int64_t* tokens;                 // [rows, width], out
    int32_t threads;
};

// Buffers read once (csrc/read.cpp): the least a pass over them costs.
struct ChattsReadArgs {
    int64_t count;
    const void* const* buffers;      // [count]
    const int64_t* bytes;            // [count]
    int64_t prefetch_bytes;          // T0 prefetch this far ahead; 0: none
    int32_t threads;
    int32_t streams;                 // runs each thread reads side by side, 1..16
    uint64_t checksum;               // out: the bytes folded together
};

// A depthwise 1-D convolution (csrc/depthwise.cpp) over channels-last inputs, as the audio
// decoder's ConvNeXt blocks run it in bf16, or in float32.
struct ChattsDepthwiseArgs {
    int64_t batch, channels, time, kernel, dilation, padding;
    const void* x;                   // [batch, time, channels]: bf16, or float32 (rounded to bf16)
    int32_t x_float;                 // 1: x holds float32
    const float* weights;            // [kernel, channels]
    const float* bias;               // [channels], or NULL
    void* out;                       // [batch, time, channels] bf16, or float32 with `float32`
    int32_t threads;
    int32_t float32;                 // 1: in float32 throughout (x_float too; x not rounded)
};

// Argument structs by number, for chatts_args_size and chatts_args_layout.
enum ChattsArgsKind : int32_t {
    CHATTS_ARGS_ATTENTION = 0,
    CHATTS_ARGS_RMS_NORM = 1,
    CHATTS_ARGS_INT8_LINEAR = 2,
    CHATTS_ARGS_SAMPLE = 3,
    CHATTS_ARGS_DECODE_LAYERS = 4,
    CHATTS_ARGS_LAYER_WEIGHTS = 5,
    CHATTS_ARGS_INT4_LINEAR = 6,
    CHATTS_ARGS_READ = 7,
    CHATTS_ARGS_TUNING = 8,
    CHATTS_ARGS_LINEAR_WEIGHTS = 9,
    CHATTS_ARGS_DEPTHWISE = 10,
};

extern "C" {
int32_t chatts_abi_version();
int64_t chatts_args_size(int32_t kind);  // sizeof the struct, or -1 for an unknown kind
// the struct's fields in order, "name:offset:type" joined by ",", types q (int64), i (int32),
// Q (uint64), f (float), P (any pointer) or a nested struct's name; NULL for an unknown kind
const char* chatts_args_layout(int32_t kind);
const char* chatts_status_message(int32_t status);
int32_t chatts_decode_attention(const ChattsAttentionArgs* args);
void chatts_rms_norm_unit_rows(const ChattsRmsNormArgs* args);
int32_t chatts_int8_linear(const ChattsInt8LinearArgs* args);
int32_t chatts_sample(const ChattsSampleArgs* args);
int32_t chatts_decode_layers(const ChattsDecodeLayersArgs* args);
void chatts_rms_norm(const ChattsRmsNormArgs* args);
int32_t chatts_int4_linear(const ChattsInt4LinearArgs* args);
int32_t chatts_read_buffers(ChattsReadArgs* args);
int32_t chatts_depthwise_conv1d(const ChattsDepthwiseArgs* args);
int32_t chatts_amx_tiles();  // 1: the int8 product may use AMX tiles here (tiles_from)
int32_t chatts_int8_products();  // the int8 products this CPU runs: a mask of 1 << ChattsProduct
// `kind`'s loop (ChattsPeak), `iterations` times on each of `threads` threads: the
// multiply-adds done, or minus a ChattsStatus; `checksum` (may be NULL) adds up the results
int64_t chatts_peak_loop(int32_t kind, int64_t iterations, int32_t threads, uint64_t* checksum);
}
