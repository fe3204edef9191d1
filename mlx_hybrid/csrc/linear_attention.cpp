// A linear-attention layer's work between its projections, one MLX primitive for MLX's CPU
// backend: the causal conv + SiLU over q|k|v, q and k L2-normalised (q scaled), the rule's decay
// g = A softplus(a + dt_bias) and write strength beta = sigmoid(b), the gated delta rule, then the
// output RMSNorm times the activated gate (SiLU: Qwen's GDN; sigmoid: Kimi's KDA).
// Run as single ops these make 17 nodes a layer (the gates, the conv, a split, views, the two
// norms, a scale, the rule, the output norm, the activation, a product), each costing
// microseconds to schedule on MLX's one CPU stream, a third of a decode step's nodes before
// this primitive (benchmarks/step_graph.py counts them).
//
// The conv, the norms and the rule are the code their own kernels run (cpu_kernels.h): the conv's
// tail has the single kernel's bits; the gates come from the C library's e^x and log1p and the
// output's activation from `exp_ps`, each a few ulp from MLX's. A token gives the same bits
// whatever batch or tokens come with it: a verify pass reproduces the decode steps.
//
// The work is shared out by key head: a key head's q and k channels, and the channels of the
// value heads reading it, through every token.
//
// For a rollback (snapshots), it keeps the conv's tail after each token and each token's inputs to
// the rule (k, v, g, beta), not the state after each token: from these the gated delta kernel
// replays the state after any of the tokens, with the same bits, where one is read. A state a token
// (64 KB a layer on the bundled model, 1 MB on Qwen3.5-0.8B) is memory written of which a rollback
// reads one at most: over 16 tokens the bundled model's layer took 330 us with them, 120-150 keeping
// the inputs (benchmarks/verify_ops.py).
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

namespace {

struct Layer {
    int batch, tokens, key_heads, value_heads, key_dim, value_dim, width;
    bool vector_gate, sigmoid_gate, snapshots;
    float q_scale, l2_eps, norm_eps;
    bool operator==(const Layer&) const = default;
};

// State values (over all heads and tokens) below this run on the calling thread, as the rule's
// kernel does.
constexpr long PARALLEL_MIN_VALUES = 1L << 17;

struct Buffers {
    const float *x, *conv_weight, *tail_in, *a, *b, *A, *dt_bias, *gate, *norm_weight, *state;
    float *out, *tail_out, *state_out;
    float *tail_snapshots, *keys, *values, *gates, *betas;  // with snapshots: each token's (else null)
};

void key_head(const Layer& s, const Buffers& io, int b, int kh) {
    thread_local mlx_hybrid::LineVector<float> conv_buffer, row_buffer;
    thread_local std::vector<DeltaRuleToken> tokens;
    thread_local DeltaRuleScratch scratch;
    const int Dk = s.key_dim, Dv = s.value_dim, ratio = s.value_heads / s.key_heads;
    const int unit_channels = 2 * Dk + ratio * Dv;
    const long state_size = (long)Dk * Dv;
    // the conv over this key head's channels, every token: q, k, then its value heads' v
    float* mixed = aligned_floats(conv_buffer, (size_t)s.tokens * unit_channels);
    ConvShape conv{s.batch, s.tokens, 2 * s.key_heads * Dk + s.value_heads * Dv, s.width, s.snapshots};
    const int starts[3] = {kh * Dk, (s.key_heads + kh) * Dk, 2 * s.key_heads * Dk + kh * ratio * Dv};
    const int counts[3] = {Dk, Dk, ratio * Dv}, offsets[3] = {0, Dk, 2 * Dk};
    for (int part = 0; part < 3; part++)
        for (int c = 0; c < counts[part]; c += CONV_MAX_RANGE)
            conv_silu_channels(conv, b, starts[part] + c, starts[part] + std::min(counts[part], c + CONV_MAX_RANGE),
                               io.x, io.conv_weight, io.tail_in, mixed + offsets[part] + c, unit_channels,
                               io.tail_out, io.tail_snapshots);
    // each token's q and k (normalised), each value head's g and beta, then each value head's rule
    // over all the tokens, then its outputs normalised and gated
    const int gates = s.vector_gate ? Dk : 1;  // g's values a head
    const long row_floats = 2 * Dk + ratio * (gates + 1 + Dv);  // q, k, then each value head's g, beta, rule output
    float* rows = aligned_floats(row_buffer, (size_t)s.tokens * row_floats);
    auto value_head_at = [&](int t, int r) { return rows + (long)t * row_floats + 2 * Dk + r * (gates + 1 + Dv); };
    const Norm l2{Dk, s.l2_eps, false, false}, rms{Dv, s.norm_eps, true, true};
    for (int t = 0; t < s.tokens; t++) {
        const float* row = mixed + (long)t * unit_channels;
        float *q = rows + (long)t * row_floats, *k = q + Dk;
        normalize_row(l2, row, nullptr, q);
        for (int i = 0; i < Dk; i++) q[i] *= s.q_scale;
        normalize_row(l2, row + Dk, nullptr, k);
        const long token = (long)b * s.tokens + t;  // [B, T] position
        if (s.snapshots) std::copy(k, k + Dk, io.keys + (token * s.key_heads + kh) * Dk);
        for (int r = 0; r < ratio; r++) {
            const int h = kh * ratio + r;
            const long value_head = token * s.value_heads + h;
            float* g = value_head_at(t, r);
            for (int i = 0; i < gates; i++) {  // softplus as MLX's logaddexp(u, 0) computes it
                float u = io.a[value_head * gates + i] + io.dt_bias[h * gates + i];
                g[i] = io.A[h] * (std::max(u, 0.0f) + std::log1p(std::exp(-std::fabs(u))));
            }
            g[gates] = 1.0f / (1.0f + std::exp(-io.b[value_head]));  // beta
            if (!s.snapshots) continue;
            std::copy(g, g + gates, io.gates + value_head * gates);
            io.betas[value_head] = g[gates];
            const float* v = row + 2 * Dk + r * Dv;
            std::copy(v, v + Dv, io.values + value_head * Dv);
        }
    }
    tokens.resize(s.tokens);
    for (int r = 0; r < ratio; r++) {
        const int h = kh * ratio + r;
        const long state_at = ((long)b * s.value_heads + h) * state_size;
        for (int t = 0; t < s.tokens; t++) {
            const float* q = rows + (long)t * row_floats;
            float* g = value_head_at(t, r);  // g, then beta, then the rule's output
            tokens[t] = {q, q + Dk, mixed + (long)t * unit_channels + 2 * Dk + r * Dv, g, g[gates], g + gates + 1,
                         io.state_out + state_at};
        }
        delta_rule_tokens({Dk, Dv, s.vector_gate}, io.state + state_at, tokens.data(), s.tokens, scratch);
        for (int t = 0; t < s.tokens; t++) {
            const long value_head = ((long)b * s.tokens + t) * s.value_heads + h;
            float* y = io.out + value_head * Dv;
            normalize_row(rms, tokens[t].out, io.norm_weight, y);
            gate_values(y, io.gate + value_head * Dv, y, Dv, s.sigmoid_gate);
        }
    }
}

void compute(const Layer& s, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    auto kept = [&](int i) { return s.snapshots ? outs[i].data<float>() : nullptr; };
    Buffers io{in[0].data<float>(), in[1].data<float>(), in[2].data<float>(), in[3].data<float>(),
               in[4].data<float>(), in[5].data<float>(), in[6].data<float>(), in[7].data<float>(),
               in[8].data<float>(), in[9].data<float>(),
               outs[0].data<float>(), outs[1].data<float>(), outs[2].data<float>(),
               kept(3), kept(4), kept(5), kept(6), kept(7)};
    int units = s.batch * s.key_heads;
    long values = (long)s.batch * s.value_heads * s.tokens * s.key_dim * s.value_dim;
    Pool::get().run(units, units > 1 && values >= PARALLEL_MIN_VALUES,
                    [&](int unit) { key_head(s, io, unit / s.key_heads, unit % s.key_heads); });
}

using LinearAttentionLayer = mlx_hybrid::CpuPrimitive<Layer, compute>;

// x [B, T, 2 Hk Dk + Hv Dv] (q|k|v before the conv), conv_weight [C, K], tail [B, K-1, C];
// a [B, T, Hv] or [B, T, Hv, Dk] and dt_bias [Hv] or [Hv Dk] (the decay's, per head or key
// channel), A [Hv]; b [B, T, Hv]; gate [B, T, Hv Dv]; norm_weight [Dv]; state [B, Hv, Dk, Dv].
// -> [out [B, T, Hv Dv], the conv's tail after the last token, the state after the last token, and
// with snapshots: the tail after each token [B, T, K-1, C] and the rule's inputs, k [B, T, Hk, Dk]
// (normalised), v [B, T, Hv, Dv], g as a's shape, beta [B, T, Hv]], all float32.
std::vector<mx::array> linear_attention(const mx::array& x, const mx::array& conv_weight, const mx::array& tail,
                                        const mx::array& a, const mx::array& b, const mx::array& A,
                                        const mx::array& dt_bias, const mx::array& gate,
                                        const mx::array& norm_weight, const mx::array& state, int key_heads,
                                        float q_scale, float l2_eps, float norm_eps, bool sigmoid_gate,
                                        bool snapshots) {
    if (x.ndim() != 3 || conv_weight.ndim() != 2 || tail.ndim() != 3 || state.ndim() != 4 || norm_weight.ndim() != 1)
        throw std::invalid_argument(
            "linear_attention: x [B, T, C], conv_weight [C, K], tail [B, K-1, C], state [B, Hv, Dk, Dv], "
            "norm_weight [Dv]");
    Layer s{x.shape(0), x.shape(1), key_heads, state.shape(1), state.shape(2), state.shape(3), conv_weight.shape(1),
            a.ndim() == 4, sigmoid_gate, snapshots, q_scale, l2_eps, norm_eps};
    int channels = 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim;
    mx::Shape per_head{s.batch, s.tokens, s.value_heads}, gate_shape = per_head;
    if (s.vector_gate) gate_shape.push_back(s.key_dim);
    if (s.tokens < 1 || s.key_heads < 1 || s.value_heads % s.key_heads || x.shape(2) != channels ||
        s.width < 2 || s.width > CONV_MAX_WIDTH || conv_weight.shape(0) != channels ||
        tail.shape() != mx::Shape{s.batch, s.width - 1, channels} || state.shape(0) != s.batch ||
        a.shape() != gate_shape || b.shape() != per_head || A.shape() != mx::Shape{s.value_heads} ||
        dt_bias.shape() != mx::Shape{s.value_heads * (s.vector_gate ? s.key_dim : 1)} ||
        gate.shape() != mx::Shape{s.batch, s.tokens, s.value_heads * s.value_dim} ||
        norm_weight.shape(0) != s.value_dim)
        throw std::invalid_argument("linear_attention: shapes that do not fit the layer (see ops/reference.py)");
    if (x.dtype() != mx::float32 || tail.dtype() != mx::float32)
        throw std::invalid_argument("linear_attention: x and tail in float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> inputs;
    for (auto* input : {&x, &conv_weight, &tail, &a, &b, &A, &dt_bias, &gate, &norm_weight, &state})
        inputs.push_back(mx::astype(*input, mx::float32, stream));
    std::vector<mx::Shape> shapes{gate.shape(), tail.shape(), state.shape()};
    if (snapshots)
        shapes.insert(shapes.end(), {{s.batch, s.tokens, s.width - 1, channels},
                                     {s.batch, s.tokens, s.key_heads, s.key_dim},
                                     {s.batch, s.tokens, s.value_heads, s.value_dim},
                                     gate_shape,
                                     per_head});
    std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
    auto primitive = std::make_shared<LinearAttentionLayer>(stream, s, "LinearAttentionLayer");
    return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

}  // namespace

void mlx_hybrid::bind_linear_attention(nb::module_& m) {
    m.def("linear_attention", &linear_attention, nb::arg("x"), nb::arg("conv_weight"), nb::arg("tail"), nb::arg("a"),
          nb::arg("b"), nb::arg("A"), nb::arg("dt_bias"), nb::arg("gate"), nb::arg("norm_weight"), nb::arg("state"),
          nb::arg("key_heads"),
          nb::arg("q_scale"), nb::arg("l2_eps"), nb::arg("norm_eps"), nb::arg("sigmoid_gate"), nb::arg("snapshots"),
          "a linear-attention layer between its projections: [out, the conv's tail and the state after the last "
          "token, with snapshots the tail after each token and each token's k, v, g and beta for the rule]");
}
