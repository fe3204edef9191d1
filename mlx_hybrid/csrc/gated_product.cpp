// x * SiLU(gate) (SwiGLU's hidden layer: up * SiLU(gate)) or x * sigmoid(gate) (an attention
// output's gate), elementwise in float32, one MLX primitive for MLX's CPU backend. MLX's compiled
// form computes e^x through a scalar power() for each value and brings two broadcast nodes of its
// scalars; here `exp_ps` in vectors, one node. Each value is a fixed sequence of operations: its
// bits do not depend on what comes with it.
#include <algorithm>
#include <stdexcept>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

namespace {

struct Gate {
    bool sigmoid;  // else SiLU
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

void compute(const Gate& g, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *gate = in[1].data<float>();
    float* y = outs[0].data<float>();
    long n = (long)outs[0].size();
    int parts = (int)((n + VALUES_PER_PART - 1) / VALUES_PER_PART);
    Pool::get().run(parts, true, [&](int part) {
        long first = part * VALUES_PER_PART;
        gate_values(x + first, gate + first, y + first, std::min(VALUES_PER_PART, n - first), g.sigmoid);
    });
}

using GatedProduct = mlx_hybrid::CpuPrimitive<Gate, compute>;

// x, gate of one shape, float32 -> x * SiLU(gate) or x * sigmoid(gate)
mx::array gated_product(const mx::array& x, const mx::array& gate, bool sigmoid) {
    if (x.shape() != gate.shape() || x.dtype() != mx::float32 || gate.dtype() != mx::float32)
        throw std::invalid_argument("gated_product: x and gate of one shape, float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    return mx::array(x.shape(), mx::float32, std::make_shared<GatedProduct>(stream, Gate{sigmoid}, "GatedProduct"),
                     {x, gate});
}

}  // namespace

void mlx_hybrid::bind_gated_product(nb::module_& m) {
    m.def("gated_product", &gated_product, nb::arg("x"), nb::arg("gate"), nb::arg("sigmoid"),
          "x * sigmoid(gate) (sigmoid) or x * SiLU(gate), elementwise");
}
