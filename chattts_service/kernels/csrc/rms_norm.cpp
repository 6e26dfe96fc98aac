#include "prepared_row.h"


// chatts_rms_norm_unit_rows: LlamaRMSNorm (x / rms(x) * gain) of each row, then the row divided
// by its largest magnitude, ready for the int8 kernel's fixed activation scale; `row_max`
// receives that magnitude, by which the int8 product is multiplied back. One pass over the
// row instead of the dozen operators of torch's rms_norm, absolute maximum and division.
// Without `gain`, the row is only divided by its largest magnitude.
static void rms_norm_unit_rows(
    int64_t rows, int64_t width, const float* x, int64_t x_row_stride, const float* gain,
    float eps, float* out, float* row_max) {
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t row = 0; row < rows; ++row) {
        const PreparedRow prepared(x + row * x_row_stride, width, gain, eps);
        float* unit = out + row * width;
        for (int64_t i = 0; i < width; ++i) unit[i] = prepared.value(i) / prepared.largest;
        row_max[row] = prepared.largest;
    }
}

extern "C" void chatts_rms_norm_unit_rows(const ChattsRmsNormArgs* a) {
    rms_norm_unit_rows(a->rows, a->width, a->x, a->x_row_stride, a->gain, a->eps, a->out,
                       a->row_max);
}

// chatts_rms_norm: LlamaRMSNorm of each row, x / rms(x) * gain, the values PreparedRow gives
// the int8 products (`row_max` is not used). The GPT's final norm where the kernels run the
// step, so the step's own call and the calls from Python give the same bits.
static void rms_norm_rows(int64_t rows, int64_t width, const float* x, int64_t x_row_stride,
                          const float* gain, float eps, float* out) {
    for (int64_t row = 0; row < rows; ++row) {
        const PreparedRow prepared(x + row * x_row_stride, width, gain, eps);
        float* normed = out + row * width;
        for (int64_t i = 0; i < width; ++i) normed[i] = prepared.value(i);
    }
}

extern "C" void chatts_rms_norm(const ChattsRmsNormArgs* a) {
    rms_norm_rows(a->rows, a->width, a->x, a->x_row_stride, a->gain, a->eps, a->out);
}
