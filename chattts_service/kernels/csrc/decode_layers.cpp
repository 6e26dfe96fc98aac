// chatts_decode_layers: a decode step through every layer of the GPT in one call, and after
// them, where asked, the final norm, the code head and the draw of the tokens.
//
// One call per projection and per attention from Python paid for argument checks, ctypes and
// torch allocations each time, and a step makes 100 of them (20 layers): a large part of the
// step itself at batch 1. Here the step calls the same kernels in the same order
// with the same arguments (int8_linear, decode_attention), so every row gets the bits the
// layer-by-layer calls give it; the bindings check every pointer and shape once, when the
// layers are gathered, and per step only what changes (the rows and their caches).

namespace {

// The scratch rows: q/k/v, the attention's output, the residual stream between the two halves
// of a layer, and gate/up.
struct StepScratch {
    float* qkv;        // [rows, 3 * hidden]
    float* attended;   // [rows, hidden]
    float* middle;     // [rows, hidden]
    float* gate_up;    // [rows, 2 * intermediate]

    StepScratch(float* scratch, int64_t rows, int64_t hidden)
        : qkv(scratch),
          attended(qkv + rows * 3 * hidden),
          middle(attended + rows * hidden),
          gate_up(middle + rows * hidden) {}
};

int32_t project(const ChattsDecodeLayersArgs& a, const ChattsLinearWeights& w, const float* x,
                int64_t x_stride, const float* gain, int swiglu, const float* residual,
                float* out) {
    const int64_t residual_stride = residual == nullptr ? 0 : w.n;
    if (w.bits == 4) {
        ChattsInt4LinearArgs args{};
        args.rows = a.rows;
        args.n = w.n;
        args.k = w.k;
        args.group = w.group;
        args.x = x;
        args.x_row_stride = x_stride;
        args.gain = gain;
        args.eps = a.eps;
        args.swiglu = swiglu;
        args.packed = static_cast<const uint8_t*>(w.packed);
        args.scales = w.weight_scale;
        args.residual = residual;
        args.residual_stride = residual_stride;
        args.out = out;
        args.out_stride = w.n;
        args.levels = w.levels;
        args.product = w.product;
        args.threads = a.threads;
        args.tuning = a.tuning;
        return int4_linear(args);
    }
    if (w.bits != 8) return CHATTS_UNKNOWN_PRODUCT;
    return int8_linear(a.rows, w.n, w.k, x, x_stride, gain, a.eps, swiglu,
                       static_cast<const int8_t*>(w.packed), w.offsets, w.weight_scale, residual,
                       residual_stride, out, w.n, w.levels, w.product, a.threads, a.tuning);
}

}  // namespace

static int32_t decode_layers(const ChattsDecodeLayersArgs& a) {
    const int64_t hidden = a.hidden, rows = a.rows;
    StepScratch scratch(a.scratch, rows, hidden);
    for (int64_t index = 0; index < a.layer_count; ++index) {
        const ChattsLayerWeights& layer = a.layers[index];
        int32_t status = project(a, layer.qkv, a.x, hidden, layer.attention_gain, 0, nullptr,
                                 scratch.qkv);
        if (status != CHATTS_OK) return status;
        // a prompt's rows are one sequence's positions: all stored before any attends
        const auto attention = [&](AttentionPass pass) {
            return attention_pass(pass, rows, a.heads, a.dim, index, a.scale, a.threads,
                                  scratch.qkv, 3 * hidden, scratch.qkv + hidden, 3 * hidden,
                                  scratch.qkv + 2 * hidden, 3 * hidden, a.keys, a.values,
                                  a.key_scales, a.value_scales, a.capacity, a.lengths, a.cos,
                                  a.sin, scratch.attended);
        };
        status = attention(a.prompt ? kStore : kStoreAndAttend);
        if (status == CHATTS_OK && a.prompt) status = attention(kAttend);
        if (status != CHATTS_OK) return status;
        // x + out(attended), then x' = middle + down(silu(gate) * up) back into x
        status = project(a, layer.out, scratch.attended, hidden, nullptr, 0, a.x, scratch.middle);
        if (status != CHATTS_OK) return status;
        status = project(a, layer.gate_up, scratch.middle, hidden, layer.mlp_gain, 0, nullptr,
                         scratch.gate_up);
        if (status != CHATTS_OK) return status;
        status = project(a, layer.down, scratch.gate_up, 2 * a.intermediate, nullptr, 1,
                         scratch.middle, a.x);
        if (status != CHATTS_OK) return status;
    }
    // the tail: the hidden states the decoder keeps, the head's logits, the tokens drawn
    if (a.final_gain == nullptr) return CHATTS_OK;
    rms_norm_rows(rows, hidden, a.x, hidden, a.final_gain, a.eps, a.hiddens);
    if (a.head == nullptr) return CHATTS_OK;
    if (a.head->bits != 8 || a.head->k != hidden) return CHATTS_UNKNOWN_PRODUCT;
    const int32_t status = project(a, *a.head, a.hiddens, hidden, nullptr, 0, nullptr, a.logits);
    if (status != CHATTS_OK || a.sample == nullptr) return status;
    return chatts_sample(a.sample);
}

extern "C" int32_t chatts_decode_layers(const ChattsDecodeLayersArgs* a) {
    return decode_layers(*a);
}
