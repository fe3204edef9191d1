// The CPU kernels' Python module for MLX's CPU backend on x86-64 (AVX2, FMA, F16C): quantized
// products (quantized_matmul.cpp), the gated delta rule token by token (gated_delta.cpp) and the
// causal conv1d + SiLU before it (conv1d_silu.cpp), RMSNorm and L2 normalization (rms_norm.cpp),
// all of a linear-attention layer's steps between its projections at once (linear_attention.cpp),
// attention of a few query tokens over a KV cache and the rotary embedding (attention.cpp), SwiGLU's
// and the attention output's gates (gated_product.cpp), GGUF Q8_0 products with llama.cpp's 8-bit
// activations (int8_products.cpp), each an MLX primitive.
// mlx_hybrid/ops/cpu_extension.py builds it on first use with the nanobind sources and MLX's
// headers (NB_DOMAIN=mlx, so that arrays pass between this module and mlx.core).
#include "cpu_kernels.h"

NB_MODULE(cpu_kernels_ext, m) {
    m.doc() = "mlx_hybrid's kernels for MLX's CPU backend";
    m.def("supported", &mlx_hybrid::cpu_supported, "whether this CPU runs the kernels (AVX2, FMA, F16C)");
    m.def("threads", [] { return mlx_hybrid::Pool::get().threads(); });
    mlx_hybrid::bind_quantized_matmul(m);
    mlx_hybrid::bind_gated_delta(m);
    mlx_hybrid::bind_conv1d_silu(m);
    mlx_hybrid::bind_norms(m);
    mlx_hybrid::bind_linear_attention(m);
    mlx_hybrid::bind_attention(m);
    mlx_hybrid::bind_gated_product(m);
    mlx_hybrid::bind_int8_products(m);
}
