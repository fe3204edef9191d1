// x * SiLU(gate) (SwiGLU's hidden layer: up * SiLU(gate)) or x * sigmoid(gate) (an attention
// output's gate), elementwise in float32, one MLX primitive for MLX's CPU backend; and GELU's tanh
// approximation (a vision tower's MLP), as x * sigmoid(2 sqrt(2 / pi) (x + 0.044715 x^3)), the same
// function (1 + tanh(z)) / 2 = sigmoid(2 z). MLX's compiled forms compute e^x (tanh) through a
// scalar call for each value and bring broadcast nodes of their scalars; here `exp_ps` in vectors,
// one node. Each value is a fixed sequence of operations: its bits do not depend on what comes with it.
#include <algorithm>
#include <stdexcept>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

namespace {

enum Kind { SILU = 0, SIGMOID = 1, GELU_TANH = 2 };

struct Gate {
    Kind kind;
    bool operator==(const Gate&) const = default;
};

constexpr long VALUES_PER_PART = 1L << 14;  // parts of the pool's work; a decode step's row is one

}  // namespace

AVX2_FN void mlx_hybrid::gate_values(const float* x, const float* gate, float* y, long n, bool sigmoid) {
    for (long i = 0; i < n; i += 8) {
        int lanes = (int)std::min(8L, n - i);
        __m256 z = load_lanes(gate + i, lanes);
        store_lanes(y + i, _mm256_mul_ps(load_lanes(x + i, lanes), sigmoid ? sigmoid_ps(z) : silu_ps(z)), lanes);
    }
}

namespace {

AVX2_FN void gelu_tanh_values(const float* x, float* y, long n) {
    const __m256 cubic = _mm256_set1_ps(0.044715f), twice_root = _mm256_set1_ps(1.5957691216057308f);  // 2 sqrt(2/pi)
    for (long i = 0; i < n; i += 8) {
        int lanes = (int)std::min(8L, n - i);
        __m256 v = load_lanes(x + i, lanes);
        __m256 z = _mm256_mul_ps(twice_root, _mm256_fmadd_ps(_mm256_mul_ps(cubic, v), _mm256_mul_ps(v, v), v));
        store_lanes(y + i, _mm256_mul_ps(v, sigmoid_ps(z)), lanes);
    }
}

void compute(const Gate& g, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *gate = in.back().data<float>();
    float* y = outs[0].data<float>();
    long n = (long)outs[0].size();
    int parts = (int)((n + VALUES_PER_PART - 1) / VALUES_PER_PART);
    Pool::get().run(parts, true, [&](int part) {
        long first = part * VALUES_PER_PART, count = std::min(VALUES_PER_PART, n - first);
        if (g.kind == GELU_TANH)
            gelu_tanh_values(x + first, y + first, count);
        else
            gate_values(x + first, gate + first, y + first, count, g.kind == SIGMOID);
    });
}

using GatedProduct = mlx_hybrid::CpuPrimitive<Gate, compute>;

// x, gate of one shape, float32 -> x * SiLU(gate) or x * sigmoid(gate)
mx::array gated_product(const mx::array& x, const mx::array& gate, bool sigmoid) {
    if (x.shape() != gate.shape() || x.dtype() != mx::float32 || gate.dtype() != mx::float32)
        throw std::invalid_argument("gated_product: x and gate of one shape, float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    Gate g{sigmoid ? SIGMOID : SILU};
    return mx::array(x.shape(), mx::float32, std::make_shared<GatedProduct>(stream, g, "GatedProduct"), {x, gate});
}

// x float32 -> GELU(x), the tanh approximation
mx::array gelu_tanh(const mx::array& x) {
    if (x.dtype() != mx::float32) throw std::invalid_argument("gelu_tanh: x float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    return mx::array(x.shape(), mx::float32, std::make_shared<GatedProduct>(stream, Gate{GELU_TANH}, "GeluTanh"), {x});
}

}  // namespace

void mlx_hybrid::bind_gated_product(nb::module_& m) {
    m.def("gated_product", &gated_product, nb::arg("x"), nb::arg("gate"), nb::arg("sigmoid"),
          "x * sigmoid(gate) (sigmoid) or x * SiLU(gate), elementwise");
    m.def("gelu_tanh", &gelu_tanh, nb::arg("x"), "GELU(x), its tanh approximation, elementwise");
}
