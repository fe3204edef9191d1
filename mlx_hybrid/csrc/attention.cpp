// Scaled dot-product attention of a few query tokens (decode steps, verify passes) over a KV
// cache, and the rotary embedding before it, each one MLX primitive for MLX's CPU backend. The
// attention has mx.fast.scaled_dot_product_attention's contract (grouped heads, a causal mask
// aligned to the last key). On the CPU MLX runs it as about 15 ops (the scale, views for the
// grouped heads, two matmuls, the softmax), each costing microseconds to schedule. Here each
// query row is a fixed sequence of float32 operations whatever rows come with it (a verify pass
// reproduces its decode steps), and the cache's keys and values are read where they lie (a slice
// of the cache's grown buffer, by its strides).
//
// Up to FEW_TOKENS query tokens, per query row: q scaled (as MLX scales it), each key's score the
// dot product by FMA into 8 lanes reduced by a fixed tree; the softmax over the keys the mask
// leaves, e^(score - max) with `exp_ps`, normalised by 1 / sum; the output the values summed in key
// order by FMA. Rows are taken a few at a time (each key and value read once for them) and the
// blocks shared among threads.
//
// More query tokens (a prompt's chunk): the BLAS's products, with the softmax between them carried
// across blocks of keys (`prompt_rows`): no score matrix beyond one block's, and no exponentials
// but ours (MLX's op spends two thirds of a long prompt's attention in its elementwise exp).
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "cpu_kernels.h"

// The BLAS sgemm MLX calls (see quantized_matmul.cpp): OpenBLAS where mlx_hybrid loaded it.
extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                            int);

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlx_hybrid;

namespace {

struct Attention {
    int batch, heads, kv_heads, tokens, keys, key_dim, value_dim;
    float scale;
    bool causal;
    bool operator==(const Attention&) const = default;
};

// How many keys query token t sees: all, or with the causal mask aligned to the last key, as MLX's.
int keys_seen(const Attention& a, int t) { return a.causal ? a.keys - a.tokens + t + 1 : a.keys; }

// Multiply-adds below this run on the calling thread.
constexpr long PARALLEL_MIN_VALUES = 1L << 16;

// Query rows are taken ROWS at a time, so that each key and value row read from memory serves
// them all (a prompt's rows over a long cache would otherwise each stream the whole cache); every
// row's arithmetic is the one it does alone: the same FMAs into the same lanes in the same order.
constexpr int ROWS = 4;

// scores[r][s] = q_r . k_s for the block's R rows, keys s < keys: per row, 16 features a step
// into two accumulators (even and odd 8-lane halves), the tail into even then odd, reduced by
// sum_lanes(even + odd). R is a template argument so that the accumulators stay in registers.
template <int R>
AVX2_FN void dots(const float* const* q, const float* k, long k_stride, int keys, int n, float* const* scores) {
    for (int s = 0; s < keys; s++) {
        const float* key = k + s * k_stride;
        __m256 even[R], odd[R];
        for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= n; i += 16) {
            __m256 k0 = _mm256_loadu_ps(key + i), k1 = _mm256_loadu_ps(key + i + 8);
            for (int r = 0; r < R; r++) {
                even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), k0, even[r]);
                odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i + 8), k1, odd[r]);
            }
        }
        if (i < n) {
            int lanes = std::min(8, n - i);
            __m256 k0 = load_lanes(key + i, lanes);
            for (int r = 0; r < R; r++) even[r] = _mm256_fmadd_ps(load_lanes(q[r] + i, lanes), k0, even[r]);
            i += 8;
        }
        if (i < n) {
            int lanes = n - i;
            __m256 k1 = load_lanes(key + i, lanes);
            for (int r = 0; r < R; r++) odd[r] = _mm256_fmadd_ps(load_lanes(q[r] + i, lanes), k1, odd[r]);
        }
        for (int r = 0; r < R; r++) scores[r][s] = sum_lanes(_mm256_add_ps(even[r], odd[r]));
    }
}

void dots(const float* const* q, int rows, const float* k, long k_stride, int keys, int n, float* const* scores) {
    switch (rows) {
        case 1: return dots<1>(q, k, k_stride, keys, n, scores);
        case 2: return dots<2>(q, k, k_stride, keys, n, scores);
        case 3: return dots<3>(q, k, k_stride, keys, n, scores);
        default: return dots<ROWS>(q, k, k_stride, keys, n, scores);
    }
}

// scores[0..n) -> e^(score - max) / sum
AVX2_FN void softmax(float* scores, int n) {
    float top = scores[0];
    for (int s = 1; s < n; s++) top = std::max(top, scores[s]);
    __m256 sum8 = _mm256_setzero_ps(), minus_top = _mm256_set1_ps(-top);
    for (int s = 0; s < n; s += 8) {
        int lanes = std::min(8, n - s);
        __m256 e = exp_ps(_mm256_add_ps(load_lanes(scores + s, lanes), minus_top));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(lanes)));  // lanes past n add nothing
        store_lanes(scores + s, e, lanes);
        sum8 = _mm256_add_ps(sum8, e);
    }
    __m256 inverse = _mm256_set1_ps(1.0f / sum_lanes(sum8));
    for (int s = 0; s < n; s += 8) {
        int lanes = std::min(8, n - s);
        store_lanes(scores + s, _mm256_mul_ps(load_lanes(scores + s, lanes), inverse), lanes);
    }
}

// out_r [Dv] = sum over s < seen[r] of p_r[s] v[s], in key order, for the block's R rows (seen
// rises with r: a causal block's last row sees the most keys)
template <int R>
AVX2_FN void weighted_values(const float* const* p, const int* seen, const float* v, long v_stride, int dv,
                             float* const* out) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < dv; j += 8) store_lanes(out[r] + j, _mm256_setzero_ps(), std::min(8, dv - j));
    int first = 0;  // the rows from `first` on see key s
    for (int s = 0; s < seen[R - 1]; s++) {
        while (seen[first] <= s) first++;
        const float* row = v + s * v_stride;
        __m256 weight[R];
        for (int r = first; r < R; r++) weight[r] = _mm256_set1_ps(p[r][s]);
        for (int j = 0; j < dv; j += 8) {
            int lanes = std::min(8, dv - j);
            __m256 values = load_lanes(row + j, lanes);
            for (int r = first; r < R; r++) {
                __m256 acc = load_lanes(out[r] + j, lanes);
                store_lanes(out[r] + j, _mm256_fmadd_ps(weight[r], values, acc), lanes);
            }
        }
    }
}

void weighted_values(const float* const* p, const int* seen, int rows, const float* v, long v_stride, int dv,
                     float* const* out) {
    switch (rows) {
        case 1: return weighted_values<1>(p, seen, v, v_stride, dv, out);
        case 2: return weighted_values<2>(p, seen, v, v_stride, dv, out);
        case 3: return weighted_values<3>(p, seen, v, v_stride, dv, out);
        default: return weighted_values<ROWS>(p, seen, v, v_stride, dv, out);
    }
}

// query rows t0 .. t0 + ROWS (within the tokens) of head h in batch b
void block(const Attention& a, const mx::array& q_in, const mx::array& k_in, const mx::array& v_in, float* out,
           int b, int h, int t0) {
    thread_local std::vector<float> buffer;
    const int group = a.heads / a.kv_heads, kvh = h / group, rows = std::min(ROWS, a.tokens - t0);
    const float* k = k_in.data<float>() + b * k_in.strides()[0] + kvh * k_in.strides()[1];
    const float* v = v_in.data<float>() + b * v_in.strides()[0] + kvh * v_in.strides()[1];
    long k_stride = k_in.strides()[2], v_stride = v_in.strides()[2];
    long row_floats = (a.keys + 7) / 8 * 8;  // each row's scores start on a 32-byte boundary
    float* scratch = aligned_floats(buffer, ROWS * (row_floats + a.key_dim + 8));
    const float* q[ROWS];
    float* scores[ROWS];
    float* outs[ROWS];
    int seen[ROWS];
    int keys = 0;
    for (int r = 0; r < rows; r++) {
        int t = t0 + r;
        const float* q_row = q_in.data<float>() + (((long)b * a.heads + h) * a.tokens + t) * a.key_dim;
        float* scaled = scratch + ROWS * row_floats + r * (a.key_dim + 8);
        for (int i = 0; i < a.key_dim; i++) scaled[i] = a.scale * q_row[i];
        q[r] = scaled;
        scores[r] = scratch + r * row_floats;
        outs[r] = out + (((long)b * a.heads + h) * a.tokens + t) * a.value_dim;
        seen[r] = keys_seen(a, t);
        keys = std::max(keys, seen[r]);
    }
    dots(q, rows, k, k_stride, keys, a.key_dim, scores);  // a row's scores past its seen keys go unread
    for (int r = 0; r < rows; r++) softmax(scores[r], seen[r]);
    weighted_values(scores, seen, rows, v, v_stride, a.value_dim, outs);
}

// Query tokens up to this many take the per-row path (decode steps, verify passes: a row's bits
// whatever rows come with it); more, the BLAS's (`prompt_rows`).
constexpr int FEW_TOKENS = 16;
// The prompt path's blocks: query rows of a KV head's group, and keys, a pair of products at a time.
constexpr int PROMPT_ROWS = 512, KEY_BLOCK = 512;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

// The probabilities of one block's scores for rows [first, last) of a prompt unit, the softmax
// carried over from earlier blocks: per row, e^(score - max) over its `valid` keys (0 past them),
// the running max and sum updated, and the row's output so far rescaled by e^(old max - new max).
AVX2_FN void carry_softmax(float* scores, const int* valid, float* top, float* sum, float* out, int dv, int first,
                           int last) {
    for (int r = first; r < last; r++) {
        float* row = scores + (long)r * KEY_BLOCK;
        int n = valid[r];
        if (n <= 0) {  // the row sees none of these keys: they weigh nothing
            std::fill(row, row + KEY_BLOCK, 0.0f);
            continue;
        }
        float block_top = row[0];
        for (int s = 1; s < n; s++) block_top = std::max(block_top, row[s]);
        float new_top = std::max(top[r], block_top), rescale = std::exp(top[r] - new_top);  // first block: 0
        __m256 sum8 = _mm256_setzero_ps(), minus_top = _mm256_set1_ps(-new_top);
        for (int s = 0; s < n; s += 8) {
            int lanes = std::min(8, n - s);
            __m256 e = exp_ps(_mm256_add_ps(load_lanes(row + s, lanes), minus_top));
            e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(lanes)));
            store_lanes(row + s, e, lanes);
            sum8 = _mm256_add_ps(sum8, e);
        }
        std::fill(row + n, row + KEY_BLOCK, 0.0f);  // masked keys
        sum[r] = sum[r] * rescale + sum_lanes(sum8);
        top[r] = new_top;
        float* o = out + (long)r * dv;
        for (int j = 0; j < dv; j++) o[j] *= rescale;
    }
}

// Rows [r0, r0 + rows) of KV head kvh's group in batch b: the group's heads' query rows [group * T,
// Dk] lie together in q, as their outputs do in out. Per block of keys: scores = scale q k^T (one
// sgemm), the carried softmax, out += p v (a second); then each row divided by its sum.
void prompt_rows(const Attention& a, const mx::array& q_in, const mx::array& k_in, const mx::array& v_in, float* out,
                 int b, int kvh, int r0, int rows) {
    thread_local std::vector<float> buffer;
    const int group = a.heads / a.kv_heads;
    const long first_row = ((long)b * a.heads + (long)kvh * group) * a.tokens + r0;
    const float* q = q_in.data<float>() + first_row * a.key_dim;
    const float* k = k_in.data<float>() + b * k_in.strides()[0] + kvh * k_in.strides()[1];
    const float* v = v_in.data<float>() + b * v_in.strides()[0] + kvh * v_in.strides()[1];
    const int k_stride = (int)k_in.strides()[2], v_stride = (int)v_in.strides()[2];
    float* o = out + first_row * a.value_dim;
    float* scores = aligned_floats(buffer, (size_t)PROMPT_ROWS * KEY_BLOCK + 3 * PROMPT_ROWS);
    float *top = scores + (long)PROMPT_ROWS * KEY_BLOCK, *sum = top + PROMPT_ROWS;
    int* valid = (int*)(sum + PROMPT_ROWS);
    int keys = 0;  // the most any row sees
    for (int r = 0; r < rows; r++) {
        keys = std::max(keys, keys_seen(a, (r0 + r) % a.tokens));
        top[r] = -std::numeric_limits<float>::infinity(), sum[r] = 0.0f;
    }
    std::fill(o, o + (long)rows * a.value_dim, 0.0f);
    Pool& pool = Pool::get();
    const int parts = std::min(pool.threads(), rows);
    for (int s0 = 0; s0 < keys; s0 += KEY_BLOCK) {
        const int count = std::min(KEY_BLOCK, keys - s0);
        for (int r = 0; r < rows; r++) valid[r] = std::min(count, keys_seen(a, (r0 + r) % a.tokens) - s0);
        cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, rows, count, a.key_dim, a.scale, q, a.key_dim,
                    k + (long)s0 * k_stride, k_stride, 0.0f, scores, KEY_BLOCK);
        pool.run(parts, parts > 1, [&](int part) {
            carry_softmax(scores, valid, top, sum, o, a.value_dim, rows * part / parts, rows * (part + 1) / parts);
        });
        cblas_sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, rows, a.value_dim, count, 1.0f, scores, KEY_BLOCK,
                    v + (long)s0 * v_stride, v_stride, 1.0f, o, a.value_dim);
    }
    for (int r = 0; r < rows; r++) {
        float inverse = 1.0f / sum[r];
        for (int j = 0; j < a.value_dim; j++) o[(long)r * a.value_dim + j] *= inverse;
    }
}

void compute(const Attention& a, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    float* out = outs[0].data<float>();
    if (a.tokens > FEW_TOKENS) {  // on this thread: the BLAS and the softmax's parts take the cores
        const int group_rows = a.heads / a.kv_heads * a.tokens;
        for (int b = 0; b < a.batch; b++)
            for (int kvh = 0; kvh < a.kv_heads; kvh++)
                for (int r0 = 0; r0 < group_rows; r0 += PROMPT_ROWS)
                    prompt_rows(a, in[0], in[1], in[2], out, b, kvh, r0, std::min(PROMPT_ROWS, group_rows - r0));
        return;
    }
    int blocks = (a.tokens + ROWS - 1) / ROWS, units = a.batch * a.heads * blocks;
    long work = (long)a.batch * a.heads * a.tokens * a.keys * (a.key_dim + a.value_dim);
    Pool::get().run(units, work >= PARALLEL_MIN_VALUES, [&](int unit) {
        int bh = unit / blocks;
        block(a, in[0], in[1], in[2], out, bh / a.heads, bh % a.heads, unit % blocks * ROWS);
    });
}

// the keys and values read by their strides
using ScaledDotProductAttention = mlx_hybrid::CpuPrimitive<Attention, compute, 0b110>;

// q [B, H, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv], float32 -> [B, H, T, Dv]
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal) {
    if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
        throw std::invalid_argument("attention: q [B, H, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv]");
    Attention a{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3), v.shape(3), scale, causal};
    if (a.tokens < 1 || a.keys < 1 || a.kv_heads < 1 || a.heads % a.kv_heads || k.shape(0) != a.batch ||
        k.shape(3) != a.key_dim || v.shape(0) != a.batch || v.shape(1) != a.kv_heads || v.shape(2) != a.keys ||
        (causal && a.tokens > a.keys))
        throw std::invalid_argument("attention: shapes that do not fit (heads a multiple of the KV heads)");
    if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32)
        throw std::invalid_argument("attention: q, k and v in float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto primitive = std::make_shared<ScaledDotProductAttention>(stream, a, "ScaledDotProductAttention");
    return mx::array({a.batch, a.heads, a.tokens, a.value_dim}, mx::float32, primitive, {q, k, v});
}

// Rotary embedding, rotate-half layout, from factors computed on the host: y = x c + x[partner] s
// with c, s [T, D] (reference.py's form: partner i + D'/2 for the first half of the rotary
// features D', i - D'/2 for the second, itself past them, where c = 1 and s = 0). MLX's form takes
// four ops (a gather and its views, the fused products); each row here its D values in order.
struct Rope {
    int tokens, dim, rotary_dims;
    bool operator==(const Rope&) const = default;
};

void rotate(const Rope& r, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *c = in[1].data<float>(), *s = in[2].data<float>();
    float* y = outs[0].data<float>();
    const int half = r.rotary_dims / 2;
    for (long row = 0, rows = (long)(outs[0].size() / r.dim); row < rows; row++) {
        const float *xr = x + row * r.dim, *cr = c + row % r.tokens * r.dim, *sr = s + row % r.tokens * r.dim;
        float* yr = y + row * r.dim;
        for (int i = 0; i < r.dim; i++) {
            int partner = i < half ? i + half : i < r.rotary_dims ? i - half : i;
            yr[i] = xr[i] * cr[i] + xr[partner] * sr[i];
        }
    }
}

using RotaryEmbedding = mlx_hybrid::CpuPrimitive<Rope, rotate>;

// x [..., T, D], c and s [T, D], float32 -> [..., T, D]
mx::array rope(const mx::array& x, const mx::array& c, const mx::array& s, int rotary_dims) {
    if (x.ndim() < 2 || x.dtype() != mx::float32 || c.dtype() != mx::float32 || s.dtype() != mx::float32)
        throw std::invalid_argument("rope: x [..., T, D], c and s [T, D], float32");
    Rope r{x.shape(-2), x.shape(-1), rotary_dims};
    if (c.shape() != mx::Shape{r.tokens, r.dim} || s.shape() != c.shape() || rotary_dims < 0 || rotary_dims % 2 ||
        rotary_dims > r.dim)
        throw std::invalid_argument("rope: factors [T, D] for x [..., T, D], an even rotary width up to D");
    auto stream = mx::default_stream(mx::Device::cpu);
    return mx::array(x.shape(), mx::float32, std::make_shared<RotaryEmbedding>(stream, r, "RotaryEmbedding"),
                     {x, c, s});
}

}  // namespace

void mlx_hybrid::bind_attention(nb::module_& m) {
    m.def("rope", &rope, nb::arg("x"), nb::arg("c"), nb::arg("s"), nb::arg("rotary_dims"),
          "x c + x[partner] s over the last axis, rotate-half partners within the first rotary_dims");
    m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("causal"),
          "softmax(q k^T scale) v over grouped heads; causal: the mask aligned to the last key");
}
