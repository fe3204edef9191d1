// RMSNorm and L2 normalization over the last axis for MLX's CPU backend, one MLX primitive a call
// (RMSNorm also with the residual sum before it).
// MLX computes either as a reduction plus an elementwise kernel (and, compiled shapeless, a node
// that counts the elements), and each node costs microseconds to schedule: a Qwen3.5-0.8B decode
// step makes 79 RMSNorms and 36 L2 normalizations (benchmarks/linear_attention_ops.py compares
// them with MLX's ops).
//
// Each row is a fixed sequence of float32 operations: the squares summed by FMA into 8 lanes
// (two accumulators, even and odd blocks of 8), the lanes reduced by a fixed tree, the tail past
// the last whole vector added in order; then y = x * (1 / sqrt(sum / D + eps)) * weight (sum + eps
// for the L2 form, no weight). So a row's bits are the same whatever rows come with it.
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

namespace {

// Values below this run on the calling thread (a decode step's row takes well under a
// microsecond, less than waking a helper).
constexpr long PARALLEL_MIN_VALUES = 1L << 16;
constexpr int ROWS_PER_PART = 16;

AVX2_FN float sum_of_squares(const float* x, int d) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        even = _mm256_fmadd_ps(a, a, even);
        odd = _mm256_fmadd_ps(b, b, odd);
    }
    if (i + 8 <= d) {
        __m256 a = _mm256_loadu_ps(x + i);
        even = _mm256_fmadd_ps(a, a, even);
        i += 8;
    }
    float total = sum_lanes(_mm256_add_ps(even, odd));
    for (; i < d; i++) total = std::fma(x[i], x[i], total);
    return total;
}

}  // namespace

AVX2_FN void mlx_hybrid::normalize_row(const Norm& n, const float* x, const float* weight, float* y) {
    float squares = sum_of_squares(x, n.dim);
    float scale = 1.0f / std::sqrt((n.mean ? squares / (float)n.dim : squares) + n.eps);
    const __m256 s = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= n.dim; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
        _mm256_storeu_ps(y + i, n.weighted ? _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)) : v);
    }
    for (; i < n.dim; i++) y[i] = n.weighted ? x[i] * scale * weight[i] : x[i] * scale;
}

namespace {

void compute(const Norm& n, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *weight = n.weighted ? in[1].data<float>() : nullptr;
    float* y = outs[0].data<float>();
    long rows = (long)(outs[0].size() / n.dim);
    int parts = (int)((rows + ROWS_PER_PART - 1) / ROWS_PER_PART);
    Pool::get().run(parts, rows * n.dim >= PARALLEL_MIN_VALUES, [&](int part) {
        long end = std::min(rows, (long)(part + 1) * ROWS_PER_PART);
        for (long r = (long)part * ROWS_PER_PART; r < end; r++)
            normalize_row(n, x + r * n.dim, weight, y + r * n.dim);
    });
}

using Normalize = mlx_hybrid::CpuPrimitive<Norm, compute>;

mx::array normalized(const mx::array& x, const std::optional<mx::array>& weight, float eps, bool mean) {
    if (x.ndim() < 1 || x.shape(-1) < 1 || x.dtype() != mx::float32)
        throw std::invalid_argument("norm: x [..., D] in float32");
    int dim = x.shape(-1);
    if (weight && (weight->ndim() != 1 || weight->shape(0) != dim || weight->dtype() != mx::float32))
        throw std::invalid_argument("norm: a float32 weight [D] for x [..., D]");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs{x};
    if (weight) inputs.push_back(*weight);
    auto primitive = std::make_shared<Normalize>(stream, Norm{dim, eps, mean, weight.has_value()},
                                                 mean ? "RmsNorm" : "L2Normalize");
    return mx::array(x.shape(), mx::float32, primitive, inputs);
}

// A residual sum and its RMSNorm at once (a decoder layer's x + attention(x) and the norm before
// its MLP): one node where two were, the same bits (the sum is one float32 add a value).
void add_then_normalize(const Norm& n, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *y = in[1].data<float>(), *weight = in[2].data<float>();
    float *sum = outs[0].data<float>(), *normed = outs[1].data<float>();
    long rows = (long)(outs[0].size() / n.dim);
    int parts = (int)((rows + ROWS_PER_PART - 1) / ROWS_PER_PART);
    Pool::get().run(parts, rows * n.dim >= PARALLEL_MIN_VALUES, [&](int part) {
        long end = std::min(rows, (long)(part + 1) * ROWS_PER_PART);
        for (long r = (long)part * ROWS_PER_PART; r < end; r++) {
            long at = r * n.dim;
            for (int i = 0; i < n.dim; i++) sum[at + i] = x[at + i] + y[at + i];
            normalize_row(n, sum + at, weight, normed + at);
        }
    });
}

using AddRmsNorm = mlx_hybrid::CpuPrimitive<Norm, add_then_normalize>;

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& y, const mx::array& weight, float eps) {
    if (x.ndim() < 1 || x.shape() != y.shape() || x.dtype() != mx::float32 || y.dtype() != mx::float32)
        throw std::invalid_argument("add_rms_norm: x and y [..., D] of one shape, float32");
    int dim = x.shape(-1);
    if (weight.ndim() != 1 || weight.shape(0) != dim || weight.dtype() != mx::float32)
        throw std::invalid_argument("add_rms_norm: a float32 weight [D] for x [..., D]");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto primitive = std::make_shared<AddRmsNorm>(stream, Norm{dim, eps, true, true}, "AddRmsNorm");
    return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32}, primitive, {x, y, weight});
}

}  // namespace

void mlx_hybrid::bind_norms(nb::module_& m) {
    m.def("add_rms_norm", &add_rms_norm, nb::arg("x"), nb::arg("y"), nb::arg("weight"), nb::arg("eps"),
          "[x + y, RMSNorm(x + y) * weight] over the last axis");
    m.def(
        "rms_norm",
        [](const mx::array& x, const mx::array& weight, float eps) { return normalized(x, weight, eps, true); },
        nb::arg("x"), nb::arg("weight"), nb::arg("eps"), "x / sqrt(mean(x^2) + eps) * weight over the last axis");
    m.def(
        "l2_normalize", [](const mx::array& x, float eps) { return normalized(x, std::nullopt, eps, false); },
        nb::arg("x"), nb::arg("eps"), "x / sqrt(sum(x^2) + eps) over the last axis");
}
