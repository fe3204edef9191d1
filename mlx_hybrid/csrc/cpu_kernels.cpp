// The CPU kernels' Python module for MLX's CPU backend on x86-64 (AVX2, FMA, F16C): quantized
// products (quantized_matmul.cpp), the gated delta rule token by token (gated_delta.cpp) and the
// causal conv1d + SiLU before it (conv1d_silu.cpp), RMSNorm and L2 normalization (rms_norm.cpp),
// all of a linear-attention layer's steps between its projections at once (linear_attention.cpp),
// attention of a few query tokens over a KV cache and the rotary embedding (attention.cpp), SwiGLU's
// and the attention output's gates (gated_product.cpp), GGUF Q8_0 products with llama.cpp's 8-bit
// activations (int8_products.cpp), each an MLX primitive.
// mlx_hybrid/ops/cpu_extension.py builds it on first use with the nanobind sources and MLX's
// headers (NB_DOMAIN=mlx, so that arrays pass between this module and mlx.core).
#include <nanobind/stl/vector.h>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;

// MLX's own arrays start written (mx.zeros: one thread touching every page); a loader that fills an
// array from several threads lets each touch its own pages
static mx::array uninitialized(const std::vector<int>& shape, mx::Dtype dtype) {
    size_t bytes = mx::size_of(dtype);
    for (int d : shape) bytes *= (size_t)d;
    return mx::array(mx::allocator::malloc(bytes), mx::Shape(shape.begin(), shape.end()), dtype);
}

NB_MODULE(cpu_kernels_ext, m) {
    m.doc() = "mlx_hybrid's kernels for MLX's CPU backend";
    m.def("supported", &mlx_hybrid::cpu_supported, "whether this CPU runs the kernels (AVX2, FMA, F16C)");
    m.def("threads", [] { return mlx_hybrid::Pool::get().threads(); });
    m.def("keep_to_one_thread", [](bool value) { mlx_hybrid::Pool::get().keep_to_one_thread(value); },
          "whether the kernels run every job on MLX's thread alone, from the jobs computed after this call");
    m.def("kept_to_one_thread", [] { return mlx_hybrid::Pool::get().kept_to_one_thread(); });
    m.def("uninitialized", &uninitialized, nb::arg("shape"), nb::arg("dtype"),
          "an evaluated array whose memory is not yet written");
    mlx_hybrid::bind_quantized_matmul(m);
    mlx_hybrid::bind_gated_delta(m);
    mlx_hybrid::bind_conv1d_silu(m);
    mlx_hybrid::bind_norms(m);
    mlx_hybrid::bind_linear_attention(m);
    mlx_hybrid::bind_attention(m);
    mlx_hybrid::bind_gated_product(m);
    mlx_hybrid::bind_int8_products(m);
}
