// Causal depthwise conv1d + SiLU for MLX's CPU backend: metal/conv1d_silu.metal's contract, one
// MLX primitive a layer's call where the pure-MLX form makes three ops (a concatenation, the
// conv and SiLU fused by mx.compile, a slice), each walking the channels with strides and SiLU
// through MLX's scalar power(). Eight channels a vector, token by token along the rows of the
// input behind its tail (benchmarks/linear_attention_ops.py compares it with MLX's ops).
//
// Each output is a fixed sequence of float32 operations, per channel: the taps summed oldest
// first by FMA, then x / (1 + e^-x) with `exp_ps` (cpu_kernels.h). Channels past the last full vector run
// the same vector code under a mask, so a token gives the same bits whatever batch or tokens
// come with it, and a verify pass reproduces the decode steps.
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

// Token by token along the rows of the padded input (the carried tail's K-1 rows, then x's), so
// that every pass reads along rows.
AVX2_FN void mlx_hybrid::conv_silu_channels(const ConvShape& s, int b, int first, int end, const float* x,
                                            const float* weight, const float* tail_in, float* y, long y_stride,
                                            float* tail_out, float* snapshots) {
    const int C = s.channels, tail = s.width - 1, count = end - first;
    auto padded = [&](int row) {
        return (row < tail ? tail_in + ((long)b * tail + row) * C : x + ((long)b * s.tokens + row - tail) * C) + first;
    };
    // the range's taps, tap-major: taps[j][i] = weight[first + i][j]
    alignas(32) float taps[CONV_MAX_WIDTH][CONV_MAX_RANGE];
    __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(s.width));
    for (int i = 0; i < count; i += 8) {
        __m256 lanes = _mm256_castsi256_ps(lane_mask(count - i));
        for (int j = 0; j < s.width; j++)
            _mm256_store_ps(taps[j] + i, _mm256_mask_i32gather_ps(_mm256_setzero_ps(),
                                                                   weight + (long)(first + i) * s.width + j, rows,
                                                                   lanes, 4));
    }
    for (int t = 0; t < s.tokens; t++) {
        float* out = y + t * y_stride;
        for (int i = 0; i < count; i += 8) {
            int lanes = std::min(8, count - i);
            // oldest input first, as the reference sums
            __m256 acc = _mm256_mul_ps(load_lanes(padded(t) + i, lanes), _mm256_load_ps(taps[0] + i));
            for (int j = 1; j < s.width; j++)
                acc = _mm256_fmadd_ps(load_lanes(padded(t + j) + i, lanes), _mm256_load_ps(taps[j] + i), acc);
            store_lanes(out + i, silu_ps(acc), lanes);
        }
        if (snapshots != nullptr)  // the tail after token t: padded rows t + 1 .. t + K - 1
            for (int j = 0; j < tail; j++)
                std::memcpy(snapshots + (((long)b * s.tokens + t) * tail + j) * C + first, padded(t + 1 + j),
                            count * sizeof(float));
    }
    for (int j = 0; j < tail; j++)
        std::memcpy(tail_out + ((long)b * tail + j) * C + first, padded(s.tokens + j), count * sizeof(float));
}

namespace {

// Channel-tokens below this run on the calling thread (a decode step's 6144 channels take
// microseconds, less than waking a helper).
constexpr long PARALLEL_MIN_VALUES = 1L << 16;

void compute(const ConvShape& s, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *weight = in[1].data<float>(), *tail_in = in[2].data<float>();
    float *y = outs[0].data<float>(), *tail_out = outs[1].data<float>();
    float* snapshots = s.snapshots ? outs[2].data<float>() : nullptr;
    int per_sequence = (s.channels + CONV_MAX_RANGE - 1) / CONV_MAX_RANGE;
    bool parallel = (long)s.batch * s.tokens * s.channels >= PARALLEL_MIN_VALUES;
    Pool::get().run(s.batch * per_sequence, parallel, [&](int part) {
        int b = part / per_sequence, first = part % per_sequence * CONV_MAX_RANGE;
        conv_silu_channels(s, b, first, std::min(s.channels, first + CONV_MAX_RANGE), x, weight, tail_in,
                           y + (long)b * s.tokens * s.channels + first, s.channels, tail_out, snapshots);
    });
}

using CausalConv1dSilu = mlx_hybrid::CpuPrimitive<ConvShape, compute>;

// x [B, T, C], weight [C, K], tail [B, K-1, C], float32 -> [y [B, T, C], tail after the last
// token [B, K-1, C], and with snapshots the tail after each token [B, T, K-1, C]].
std::vector<mx::array> conv1d_silu(const mx::array& x, const mx::array& weight, const mx::array& tail,
                                   bool snapshots) {
    if (x.ndim() != 3 || weight.ndim() != 2 || tail.ndim() != 3)
        throw std::invalid_argument("conv1d_silu: x [B, T, C], weight [C, K], tail [B, K-1, C]");
    ConvShape s{x.shape(0), x.shape(1), x.shape(2), weight.shape(1), snapshots};
    if (s.tokens < 1 || s.width < 2 || s.width > CONV_MAX_WIDTH || weight.shape(0) != s.channels ||
        tail.shape() != mx::Shape{s.batch, s.width - 1, s.channels})
        throw std::invalid_argument("conv1d_silu: shapes that do not fit (kernel widths 2 to 8)");
    if (x.dtype() != mx::float32 || tail.dtype() != mx::float32)
        throw std::invalid_argument("conv1d_silu: x and tail in float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs{x, mx::astype(weight, mx::float32, stream), tail};
    std::vector<mx::Shape> shapes{x.shape(), tail.shape()};
    if (snapshots) shapes.push_back({s.batch, s.tokens, s.width - 1, s.channels});
    std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
    auto primitive = std::make_shared<CausalConv1dSilu>(stream, s, "CausalConv1dSilu");
    return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

}  // namespace

void mlx_hybrid::bind_conv1d_silu(nb::module_& m) {
    m.def("conv1d_silu", &conv1d_silu, nb::arg("x"), nb::arg("weight"), nb::arg("tail"), nb::arg("snapshots"),
          "causal depthwise conv1d + SiLU over T tokens from a carried tail: [y, the tail after the last token, "
          "and with snapshots the tail after each token]");
}
