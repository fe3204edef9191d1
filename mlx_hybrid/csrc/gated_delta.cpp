// The gated delta rule token by token for MLX's CPU backend (decode steps, verify passes,
// prompts): the recurrence of mlx_hybrid/ops/reference.py, one MLX primitive a layer's call.
//
// Per value head and token, with D = exp(g) the decay (one per head, or one per key row: Kimi):
//   reads  = (q D, k D) @ S            one pass over S [Dk, Dv]
//   delta  = beta (v - reads_k),  out = reads_q + (q . k) delta
//   S'     = D S + k (x) delta         a second pass
// MLX's ops make each of these a pass over every head's state; here a head's 64 KB state stays
// in cache between its two passes and its tokens, and the heads are shared among the pool's
// threads (benchmarks/linear_attention_ops.py compares it with MLX's ops).
//
// Every output is a fixed sequence of float32 operations: each column's reads accumulate over
// the key rows in order by FMA, in vector lanes or, for a last partial vector, one at a time with
// the same FMAs. A token gives the same bits whatever batch, heads or tokens come with it, so a
// verify pass over k tokens reproduces k decode steps exactly.
#include <nanobind/stl/vector.h>

#include <cmath>
#include <stdexcept>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

namespace {

struct Shape {
    int batch, tokens, key_heads, value_heads, key_dim, value_dim;
    bool vector_gate;
    bool operator==(const Shape&) const = default;
};

// reads over columns [j0, j0 + 8 W) of S: W vectors of each read in registers
template <int W>
AVX2_FN void read_columns(const float* s, int dk, int dv, int j0, const float* a, const float* b, float* read_a,
                         float* read_b) {
    __m256 ra[W], rb[W];
    for (int w = 0; w < W; w++) ra[w] = rb[w] = _mm256_setzero_ps();
    for (int i = 0; i < dk; i++) {
        __m256 ai = _mm256_set1_ps(a[i]), bi = _mm256_set1_ps(b[i]);
        const float* row = s + (long)i * dv + j0;
        for (int w = 0; w < W; w++) {
            __m256 x = _mm256_loadu_ps(row + 8 * w);
            ra[w] = _mm256_fmadd_ps(ai, x, ra[w]);
            rb[w] = _mm256_fmadd_ps(bi, x, rb[w]);
        }
    }
    for (int w = 0; w < W; w++) {
        _mm256_storeu_ps(read_a + j0 + 8 * w, ra[w]);
        _mm256_storeu_ps(read_b + j0 + 8 * w, rb[w]);
    }
}

}  // namespace

AVX2_FN void mlx_hybrid::delta_rule_token(const DeltaRuleHead& shape, const float* s_in, float* s_out, const float* q,
                                          const float* k, const float* v, const float* g, float beta, float* out,
                                          DeltaRuleScratch& t) {
    int dk = shape.key_dim, dv = shape.value_dim;
    float* decay = t.decay.data();
    float head_decay = shape.vector_gate ? 0.0f : std::exp(g[0]);
    for (int i = 0; i < dk; i++) decay[i] = shape.vector_gate ? std::exp(g[i]) : head_decay;
    float qk = 0.0f;
    for (int i = 0; i < dk; i++) {
        qk = std::fma(q[i], k[i], qk);
        t.q_decayed[i] = q[i] * decay[i];
        t.k_decayed[i] = k[i] * decay[i];
    }
    int j = 0;
    for (; j + 32 <= dv; j += 32) read_columns<4>(s_in, dk, dv, j, t.q_decayed.data(), t.k_decayed.data(),
                                                  t.read_q.data(), t.read_k.data());
    for (; j + 8 <= dv; j += 8) read_columns<1>(s_in, dk, dv, j, t.q_decayed.data(), t.k_decayed.data(),
                                                t.read_q.data(), t.read_k.data());
    for (; j < dv; j++) {  // a last partial vector: the same FMAs, one column at a time
        float ra = 0.0f, rb = 0.0f;
        for (int i = 0; i < dk; i++) {
            float x = s_in[(long)i * dv + j];
            ra = std::fma(t.q_decayed[i], x, ra);
            rb = std::fma(t.k_decayed[i], x, rb);
        }
        t.read_q[j] = ra, t.read_k[j] = rb;
    }
    float* delta = t.delta.data();
    for (j = 0; j < dv; j++) {
        delta[j] = beta * (v[j] - t.read_k[j]);
        out[j] = std::fma(qk, delta[j], t.read_q[j]);
    }
    int vectors = dv / 8 * 8;
    for (int i = 0; i < dk; i++) {
        const float* row = s_in + (long)i * dv;
        float* row_out = s_out + (long)i * dv;
        __m256 di = _mm256_set1_ps(decay[i]), ki = _mm256_set1_ps(k[i]);
        for (j = 0; j < vectors; j += 8) {
            __m256 update = _mm256_mul_ps(ki, _mm256_loadu_ps(delta + j));
            _mm256_storeu_ps(row_out + j, _mm256_fmadd_ps(_mm256_loadu_ps(row + j), di, update));
        }
        for (; j < dv; j++) row_out[j] = std::fma(row[j], decay[i], k[i] * delta[j]);
    }
}

namespace {

// Heads with fewer state values than this (over all tokens) run on the calling thread.
constexpr long PARALLEL_MIN_VALUES = 1L << 17;

void compute(const Shape& s, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *q = in[0].data<float>(), *k = in[1].data<float>(), *v = in[2].data<float>();
    const float *g = in[3].data<float>(), *beta = in[4].data<float>(), *state = in[5].data<float>();
    float* out = outs[0].data<float>();
    bool snapshots = outs.size() > 2;
    long state_size = (long)s.key_dim * s.value_dim;
    int ratio = s.value_heads / s.key_heads, heads = s.batch * s.value_heads;
    bool parallel = heads > 1 && (long)heads * s.tokens * state_size >= PARALLEL_MIN_VALUES;
    Pool::get().run(heads, parallel, [&](int head) {
        thread_local DeltaRuleScratch scratch;
        DeltaRuleHead head_shape{s.key_dim, s.value_dim, s.vector_gate};
        scratch.fit(head_shape);
        int b = head / s.value_heads, h = head % s.value_heads;
        const float* s_in = state + head * state_size;
        for (int t = 0; t < s.tokens; t++) {
            long token = (long)b * s.tokens + t;  // [B, T] position
            long key_row = (token * s.key_heads + h / ratio) * s.key_dim;
            long value_head = token * s.value_heads + h;
            float* s_out = outs[snapshots ? 1 + t : 1].data<float>() + head * state_size;
            delta_rule_token(head_shape, s_in, s_out, q + key_row, k + key_row, v + value_head * s.value_dim,
                       g + value_head * (s.vector_gate ? s.key_dim : 1), beta[value_head],
                       out + value_head * s.value_dim, scratch);
            s_in = s_out;
        }
    });
}

using GatedDeltaRecurrence = mlx_hybrid::CpuPrimitive<Shape, compute>;

// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] or [B, T, Hv, Dk]; beta [B, T, Hv];
// state [B, Hv, Dk, Dv]. -> [out [B, T, Hv, Dv], the state after each token (snapshots) or
// after the last], all float32.
std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                   const mx::array& beta, const mx::array& state, bool snapshots) {
    if (q.ndim() != 4 || v.ndim() != 4 || q.shape() != k.shape())
        throw std::invalid_argument("gated_delta: q and k [B, T, Hk, Dk], v [B, T, Hv, Dv]");
    Shape s{q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3), g.ndim() == 4};
    mx::Shape gate{s.batch, s.tokens, s.value_heads}, per_head = gate;
    if (s.vector_gate) gate.push_back(s.key_dim);
    mx::Shape state_shape{s.batch, s.value_heads, s.key_dim, s.value_dim};
    if (v.shape(0) != s.batch || v.shape(1) != s.tokens || s.tokens < 1 || s.key_heads < 1 ||
        s.value_heads % s.key_heads || g.shape() != gate || beta.shape() != per_head || state.shape() != state_shape)
        throw std::invalid_argument("gated_delta: shapes that do not fit the rule (see ops/reference.py)");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs;
    for (auto* a : {&q, &k, &v, &g, &beta, &state})
        inputs.push_back(mx::astype(*a, mx::float32, stream));
    std::vector<mx::Shape> shapes{v.shape()};
    shapes.insert(shapes.end(), snapshots ? s.tokens : 1, state_shape);
    std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
    auto primitive = std::make_shared<GatedDeltaRecurrence>(stream, s, "GatedDeltaRecurrence");
    return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

}  // namespace

void mlx_hybrid::bind_gated_delta(nb::module_& m) {
    m.def("gated_delta", &gated_delta, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
          nb::arg("state"), nb::arg("snapshots"),
          "the gated delta rule token by token: [out, the state after each token (snapshots) or the last]");
}
