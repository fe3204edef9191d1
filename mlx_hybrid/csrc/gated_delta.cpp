// The gated delta rule token by token for MLX's CPU backend (decode steps, verify passes,
// prompts): the recurrence of mlx_hybrid/ops/reference.py, one MLX primitive a layer's call.
//
// Per value head and token, with D = exp(g) the decay (one per head, or one per key row: Kimi):
//   reads  = (q D, k D) @ S            one pass over S [Dk, Dv]
//   delta  = beta (v - reads_k),  out = reads_q + (q . k) delta
//   S'     = D S + k (x) delta         a second pass
// MLX's ops make each of these a pass over every head's state; here a copy of 32 columns of a head's
// state (16 KB) stays in the L1 cache through both passes and 16 tokens (rule_columns), and the heads
// are shared among the pool's threads (benchmarks/linear_attention_ops.py compares it with MLX's ops).
//
// Every output is a fixed sequence of float32 operations: each column's reads accumulate over
// the key rows in order by FMA, in vector lanes or, for a last partial vector, one at a time with
// the same FMAs. A token gives the same bits whatever batch, heads or tokens come with it, so a
// verify pass over k tokens reproduces k decode steps exactly.
#include <nanobind/stl/vector.h>

#include <algorithm>
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
    int count;  // the rule runs over the first `count` tokens (a verify pass's, replayed), <= tokens
    bool operator==(const Shape&) const = default;
};

// Token by token over columns [j0, j0 + 8 W) of S, for a chunk of tokens (their decays and decayed
// q and k in `t`, Dk apart): the reads in registers, delta and the output, then the update of those
// columns. A column's values depend on that column alone, so a chunk of several tokens copies its
// columns out of the state once, and through both passes and all its tokens the copy (16 KB at W = 4
// and Dk = 128) stays in the L1 cache, where the state's own rows, a power of two apart, evict each
// other (a Q4_K_M file's 512-token prompt: the rule 10% of its time in place, 6% on the copy). A
// token's state is written where the next token does not write over it (each snapshot, the last).
template <int W>
AVX2_FN void rule_columns(const DeltaRuleHead& h, const float* s_in, const DeltaRuleToken* tokens, int count,
                          DeltaRuleScratch& t, int j0) {
    const int dk = h.key_dim, dv = h.value_dim;
    // a token alone (a decode step's) reads the state where it is: a copy would only add a pass
    const bool copied = count > 1;
    float* columns = copied ? aligned_floats(t.columns, (size_t)dk * 8 * W) : nullptr;
    for (int i = 0; copied && i < dk; i++)
        for (int w = 0; w < W; w++)
            _mm256_store_ps(columns + (i * W + w) * 8, _mm256_loadu_ps(s_in + (long)i * dv + j0 + 8 * w));
    const long stride = copied ? 8 * W : dv;  // between key rows, in the copy or the state
    for (int n = 0; n < count; n++) {
        const DeltaRuleToken& token = tokens[n];
        const float* state = copied ? columns : (n == 0 ? s_in : tokens[n - 1].s_out) + j0;
        const float *a = t.q_decayed.data() + (long)n * dk, *b = t.k_decayed.data() + (long)n * dk;
        const float* decay = t.decay.data() + (long)n * dk;
        __m256 ra[W], rb[W];
        for (int w = 0; w < W; w++) ra[w] = rb[w] = _mm256_setzero_ps();
        for (int i = 0; i < dk; i++) {
            __m256 ai = _mm256_set1_ps(a[i]), bi = _mm256_set1_ps(b[i]);
            for (int w = 0; w < W; w++) {
                __m256 x = _mm256_loadu_ps(state + i * stride + 8 * w);
                ra[w] = _mm256_fmadd_ps(ai, x, ra[w]);
                rb[w] = _mm256_fmadd_ps(bi, x, rb[w]);
            }
        }
        __m256 delta[W];
        const __m256 beta = _mm256_set1_ps(token.beta), qk = _mm256_set1_ps(t.qk[n]);
        for (int w = 0; w < W; w++) {
            delta[w] = _mm256_mul_ps(beta, _mm256_sub_ps(_mm256_loadu_ps(token.v + j0 + 8 * w), rb[w]));
            _mm256_storeu_ps(token.out + j0 + 8 * w, _mm256_fmadd_ps(qk, delta[w], ra[w]));
        }
        const bool written = n == count - 1 || token.s_out != tokens[n + 1].s_out;
        for (int i = 0; i < dk; i++) {
            __m256 di = _mm256_set1_ps(decay[i]), ki = _mm256_set1_ps(token.k[i]);
            for (int w = 0; w < W; w++) {
                const float* value = state + i * stride + 8 * w;
                const __m256 updated = _mm256_fmadd_ps(_mm256_loadu_ps(value), di, _mm256_mul_ps(ki, delta[w]));
                if (copied) _mm256_store_ps(columns + (i * W + w) * 8, updated);
                if (written) _mm256_storeu_ps(token.s_out + (long)i * dv + j0 + 8 * w, updated);
            }
        }
    }
}

// rule_columns' arithmetic for a token alone (a decode step's) over a head of 128 value columns, with
// AVX-512: whole rows of the state at a time, its 64 KB read in order in both passes, which the
// hardware's prefetch follows (32 columns at a time read each 512-byte row in quarters, a head's rows
// four times over)
AVX512_FN void rule_rows_wide(const DeltaRuleHead& h, const float* s_in, const DeltaRuleToken& token,
                              const DeltaRuleScratch& t) {
    constexpr int V = 8;  // vectors a row
    const int dk = h.key_dim;
    const float *a = t.q_decayed.data(), *b = t.k_decayed.data(), *decay = t.decay.data();
    __m512 ra[V], rb[V];
    for (int w = 0; w < V; w++) ra[w] = rb[w] = _mm512_setzero_ps();
    for (int i = 0; i < dk; i++) {
        const __m512 ai = _mm512_set1_ps(a[i]), bi = _mm512_set1_ps(b[i]);
        for (int w = 0; w < V; w++) {
            const __m512 x = _mm512_loadu_ps(s_in + i * 16 * V + 16 * w);
            ra[w] = _mm512_fmadd_ps(ai, x, ra[w]);
            rb[w] = _mm512_fmadd_ps(bi, x, rb[w]);
        }
    }
    __m512 delta[V];
    const __m512 beta = _mm512_set1_ps(token.beta), qk = _mm512_set1_ps(t.qk[0]);
    for (int w = 0; w < V; w++) {
        delta[w] = _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(token.v + 16 * w), rb[w]));
        _mm512_storeu_ps(token.out + 16 * w, _mm512_fmadd_ps(qk, delta[w], ra[w]));
    }
    for (int i = 0; i < dk; i++) {
        const __m512 di = _mm512_set1_ps(decay[i]), ki = _mm512_set1_ps(token.k[i]);
        for (int w = 0; w < V; w++) {
            const long at = (long)i * 16 * V + 16 * w;
            _mm512_storeu_ps(token.s_out + at,
                             _mm512_fmadd_ps(_mm512_loadu_ps(s_in + at), di, _mm512_mul_ps(ki, delta[w])));
        }
    }
    leave_avx512();
}

// rule_columns' arithmetic for one column j (past the last whole vector), a value at a time
void rule_column(const DeltaRuleHead& h, const float* s_in, const DeltaRuleToken* tokens, int count,
                 const DeltaRuleScratch& t, int j) {
    const int dk = h.key_dim, dv = h.value_dim;
    for (int n = 0; n < count; n++) {
        const DeltaRuleToken& token = tokens[n];
        const float* src = n == 0 ? s_in : tokens[n - 1].s_out;
        const float *a = t.q_decayed.data() + (long)n * dk, *b = t.k_decayed.data() + (long)n * dk;
        const float* decay = t.decay.data() + (long)n * dk;
        float ra = 0.0f, rb = 0.0f;
        for (int i = 0; i < dk; i++) {
            float x = src[(long)i * dv + j];
            ra = std::fma(a[i], x, ra);
            rb = std::fma(b[i], x, rb);
        }
        const float delta = token.beta * (token.v[j] - rb);
        token.out[j] = std::fma(t.qk[n], delta, ra);
        for (int i = 0; i < dk; i++)
            token.s_out[(long)i * dv + j] = std::fma(src[(long)i * dv + j], decay[i], token.k[i] * delta);
    }
}

// tokens a chunk: their decays and decayed q and k (3 x 8 KB at Dk = 128) beside the columns in L1
constexpr int CHUNK_TOKENS = 16;

}  // namespace

void mlx_hybrid::delta_rule_tokens(const DeltaRuleHead& h, const float* s_in, const DeltaRuleToken* tokens,
                                   int count, DeltaRuleScratch& t) {
    const int dk = h.key_dim, dv = h.value_dim;
    for (auto* v : {&t.decay, &t.q_decayed, &t.k_decayed}) v->resize((size_t)CHUNK_TOKENS * dk);
    t.qk.resize(CHUNK_TOKENS);
    for (int first = 0; first < count; first += CHUNK_TOKENS) {
        const int chunk = std::min(CHUNK_TOKENS, count - first);
        const DeltaRuleToken* run = tokens + first;
        for (int n = 0; n < chunk; n++) {
            float* decay = t.decay.data() + (long)n * dk;
            const float head_decay = h.vector_gate ? 0.0f : std::exp(run[n].g[0]);
            for (int i = 0; i < dk; i++) decay[i] = h.vector_gate ? std::exp(run[n].g[i]) : head_decay;
            float qk = 0.0f;
            for (int i = 0; i < dk; i++) {
                qk = std::fma(run[n].q[i], run[n].k[i], qk);
                t.q_decayed[(long)n * dk + i] = run[n].q[i] * decay[i];
                t.k_decayed[(long)n * dk + i] = run[n].k[i] * decay[i];
            }
            t.qk[n] = qk;
        }
        const float* src = first == 0 ? s_in : tokens[first - 1].s_out;
        if (count == 1 && dv == 128 && avx512_in_use()) {
            rule_rows_wide(h, src, run[0], t);
            continue;
        }
        int j = 0;
        for (; j + 32 <= dv; j += 32) rule_columns<4>(h, src, run, chunk, t, j);
        for (; j + 8 <= dv; j += 8) rule_columns<1>(h, src, run, chunk, t, j);
        for (; j < dv; j++) rule_column(h, src, run, chunk, t, j);
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
    bool parallel = heads > 1 && (long)heads * s.count * state_size >= PARALLEL_MIN_VALUES;
    Pool::get().run(heads, parallel, [&](int head) {
        thread_local DeltaRuleScratch scratch;
        thread_local std::vector<DeltaRuleToken> tokens;
        tokens.resize(s.count);
        int b = head / s.value_heads, h = head % s.value_heads;
        for (int t = 0; t < s.count; t++) {
            long token = (long)b * s.tokens + t;  // [B, T] position in the inputs
            long key_row = (token * s.key_heads + h / ratio) * s.key_dim;
            long value_head = token * s.value_heads + h;
            long out_head = ((long)b * s.count + t) * s.value_heads + h;
            tokens[t] = {q + key_row, k + key_row, v + value_head * s.value_dim,
                         g + value_head * (s.vector_gate ? s.key_dim : 1), beta[value_head],
                         out + out_head * s.value_dim,
                         outs[snapshots ? 1 + t : 1].data<float>() + head * state_size};
        }
        delta_rule_tokens({s.key_dim, s.value_dim, s.vector_gate}, state + head * state_size, tokens.data(), s.count,
                          scratch);
    });
}

using GatedDeltaRecurrence = mlx_hybrid::CpuPrimitive<Shape, compute>;

// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] or [B, T, Hv, Dk]; beta [B, T, Hv];
// state [B, Hv, Dk, Dv]; count: the rule over the first `count` tokens (-1: all T). -> [out [B, count,
// Hv, Dv], the state after each token (snapshots) or after the last], all float32.
std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                   const mx::array& beta, const mx::array& state, bool snapshots, int count) {
    if (q.ndim() != 4 || v.ndim() != 4 || q.shape() != k.shape())
        throw std::invalid_argument("gated_delta: q and k [B, T, Hk, Dk], v [B, T, Hv, Dv]");
    Shape s{q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3), g.ndim() == 4,
            count < 0 ? q.shape(1) : count};
    mx::Shape gate{s.batch, s.tokens, s.value_heads}, per_head = gate;
    if (s.vector_gate) gate.push_back(s.key_dim);
    mx::Shape state_shape{s.batch, s.value_heads, s.key_dim, s.value_dim};
    if (v.shape(0) != s.batch || v.shape(1) != s.tokens || s.tokens < 1 || s.key_heads < 1 ||
        s.value_heads % s.key_heads || g.shape() != gate || beta.shape() != per_head || state.shape() != state_shape ||
        s.count < 1 || s.count > s.tokens)
        throw std::invalid_argument("gated_delta: shapes that do not fit the rule (see ops/reference.py)");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs;
    for (auto* a : {&q, &k, &v, &g, &beta, &state})
        inputs.push_back(mx::astype(*a, mx::float32, stream));
    std::vector<mx::Shape> shapes{{s.batch, s.count, s.value_heads, s.value_dim}};
    shapes.insert(shapes.end(), snapshots ? s.count : 1, state_shape);
    std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
    auto primitive = std::make_shared<GatedDeltaRecurrence>(stream, s, "GatedDeltaRecurrence");
    return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

}  // namespace

void mlx_hybrid::bind_gated_delta(nb::module_& m) {
    m.def("gated_delta", &gated_delta, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
          nb::arg("state"), nb::arg("snapshots"), nb::arg("count") = -1,
          "the gated delta rule token by token over the first `count` tokens (-1: all): [out, the state after each "
          "token (snapshots) or the last]");
}
