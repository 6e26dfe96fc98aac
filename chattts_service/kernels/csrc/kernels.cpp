// The kernels' one translation unit: the library is built from this file alone.
//
// The kernels live one to a file; they are compiled together, in this order, so that GCC
// inlines and vectorises the helpers they share (bf16 conversions, exp, PreparedRow) the same
// way for all of them. The tests hold a row's int8 product to fbgemm's bits and to itself
// across batch sizes; separate translation units could compile the shared code differently in
// each, and the bits with it.
#include "common.h"

#include "attention.cpp"
#include "rms_norm.cpp"
#include "int8_linear.cpp"
#include "int4_linear.cpp"
#include "sample.cpp"
#include "decode_layers.cpp"
#include "read.cpp"
#include "peak.cpp"
#include "depthwise.cpp"
#include "abi.cpp"
