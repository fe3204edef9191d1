// Scaled dot-product attention of a few query tokens (decode steps, verify passes) over a KV
// cache, and the rotary embedding before it, each one MLX primitive for MLX's CPU backend. The
// attention has mx.fast.scaled_dot_product_attention's contract (grouped heads, a causal mask
// aligned to the last key). On the CPU MLX runs it as about 15 ops (the scale, views for the
// grouped heads, two matmuls, the softmax), each costing microseconds to schedule. Here each
// query row is a fixed sequence of float32 operations whatever rows come with it (a verify pass
// reproduces its decode steps), and the cache's keys and values are read where they lie (a slice
// of the cache's grown buffer, by its strides). A quantized cache's (--kv-bits) are decoded a block
// of rows at a time (`Entries`) and then take the same path.
//
// Up to FEW_TOKENS query tokens, per query row: q scaled (as MLX scales it), each key's score the
// dot product by FMA into 8 lanes reduced by a fixed tree; the softmax over the keys the mask
// leaves, e^(score - max) with `exp_ps`, normalised by 1 / sum; the output the values summed in key
// order by FMA. A KV head's query rows (its group of heads, each token's) go through its keys and
// values a chunk at a time, so that the cache is read once for all of them (`group_rows`).
//
// More query tokens (a prompt's chunk): the BLAS's products, with the softmax between them carried
// across blocks of keys (`prompt_rows`): no score matrix beyond one block's, and no exponentials
// but ours (MLX's op spends two thirds of a long prompt's attention in its elementwise exp).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

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
    int bits, group;  // a quantized cache's keys and values (bits 4 or 8, `group` features a scale); 0: float32
    bool row_keys;    // the last input gives each batch row's keys (rows of a batch cache filled to different lengths)
    bool operator==(const Attention&) const = default;
};

// The keys batch row b holds: all, or the first of its own count (clamped to the keys there are).
int keys_held(const Attention& a, const std::vector<mx::array>& in, int b) {
    return a.row_keys ? std::clamp(in.back().data<int32_t>()[b], a.causal ? a.tokens : 1, a.keys) : a.keys;
}

// How many of the `keys` it holds query token t sees: all, or with the causal mask aligned to the last
// key, as MLX's.
int keys_seen(const Attention& a, int keys, int t) { return a.causal ? keys - a.tokens + t + 1 : keys; }

// One KV head's keys or values, as rows of float32: read where they lie (a slice of the cache's grown
// buffer, by its strides), or decoded from MLX's affine groups (codes of 4 or 8 bits packed in uint32
// words, low bits first; a float32 scale and bias per group) a block of rows at a time into scratch,
// each value code * scale + bias by one FMA.
struct Entries {
    const float* floats;
    const uint8_t* codes;
    const float *scales, *biases;
    long stride, code_stride, scale_stride;  // between rows: floats, bytes of codes, floats of scales
    int dim, bits, group;

    // input `first` of `in` (float32 entries) or inputs first .. first + 2 (codes, scales, biases), for
    // KV head kvh of batch b
    Entries(const Attention& a, const std::vector<mx::array>& in, int first, int b, int kvh, int dim)
        : floats(nullptr), codes(nullptr), scales(nullptr), biases(nullptr), dim(dim), bits(a.bits), group(a.group) {
        auto at = [&](const mx::array& x) { return b * x.strides()[0] + kvh * x.strides()[1]; };
        const mx::array& x = in[first];
        if (!bits) {
            floats = x.data<float>() + at(x), stride = x.strides()[2];
            return;
        }
        const mx::array &s = in[first + 1], &z = in[first + 2];
        codes = reinterpret_cast<const uint8_t*>(x.data<uint32_t>() + at(x)), code_stride = x.strides()[2] * 4;
        scales = s.data<float>() + at(s), biases = z.data<float>() + at(z), scale_stride = s.strides()[2];
        if (z.strides()[2] != scale_stride) throw std::invalid_argument("attention: scales and biases laid out apart");
    }

    bool decoded() const { return bits != 0; }

    // rows [s0, s0 + n) as float32 rows, *row_stride floats apart (quantized: decoded into scratch)
    const float* rows(int s0, int n, float* scratch, long* row_stride) const {
        if (!bits) {
            *row_stride = stride;
            return floats + s0 * stride;
        }
        decode(s0, n, scratch);
        *row_stride = dim;
        return scratch;
    }

    AVX2_FN void decode(int s0, int n, float* out) const {
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), nibble = _mm256_set1_epi32(15);
        for (int s = s0; s < s0 + n; s++, out += dim) {
            const uint8_t* c = codes + s * code_stride;
            const float *scale = scales + s * scale_stride, *bias = biases + s * scale_stride;
            for (int j = 0; j < dim; j += 8) {  // groups are multiples of 8 features
                __m256i ints;
                if (bits == 8) {
                    ints = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j)));
                } else {
                    uint32_t word;
                    std::memcpy(&word, c + j / 2, 4);
                    ints = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), nibble);
                }
                int g = j / group;
                _mm256_storeu_ps(out + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(scale[g]),
                                                          _mm256_set1_ps(bias[g])));
            }
        }
    }
};

// KV head kvh's keys and values in batch b: inputs 1 and 2, or a quantized cache's 1 to 3 and 4 to 6
std::pair<Entries, Entries> head_entries(const Attention& a, const std::vector<mx::array>& in, int b, int kvh) {
    return {Entries(a, in, 1, b, kvh, a.key_dim), Entries(a, in, a.bits ? 4 : 2, b, kvh, a.value_dim)};
}

// Multiply-adds below this run on the calling thread.
constexpr long PARALLEL_MIN_VALUES = 1L << 16;

// Query rows are taken ROWS at a time, so that each key and value row read from memory serves
// them all (a KV head's group of query heads, a prompt's rows over a long cache); every row's
// arithmetic is the one it does alone: the same FMAs into the same lanes in the same order.
constexpr int ROWS = 4;
// Keys and values the per-row path takes at a time (decoded into scratch where quantized): a chunk
// stays in cache while every block of rows reads it.
constexpr int CHUNK_ROWS = 64;

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

// out_r [Dv] += sum over keys s in [s0, s0 + n) with s < seen[r] of p_r[s] v[s - s0], in key order, for
// the block's R rows. Each 16 features of the R outputs stay in registers across the keys.
template <int R>
AVX2_FN void weighted_values(const float* const* p, const int* seen, const float* v, long v_stride, int s0, int n,
                             int dv, float* const* out) {
    for (int j = 0; j < dv; j += 16) {
        const int low = std::min(8, dv - j), high = std::max(0, std::min(8, dv - j - 8));
        __m256 acc_low[R], acc_high[R];
        for (int r = 0; r < R; r++) {
            acc_low[r] = load_lanes(out[r] + j, low);
            acc_high[r] = high ? load_lanes(out[r] + j + 8, high) : _mm256_setzero_ps();
        }
        for (int s = s0; s < s0 + n; s++) {
            const float* row = v + (s - s0) * v_stride + j;
            const __m256 values_low = load_lanes(row, low);
            const __m256 values_high = high ? load_lanes(row + 8, high) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {  // a row that does not see key s adds 0 (R fixed: registers)
                const __m256 weight = _mm256_set1_ps(s < seen[r] ? p[r][s] : 0.0f);
                acc_low[r] = _mm256_fmadd_ps(weight, values_low, acc_low[r]);
                acc_high[r] = _mm256_fmadd_ps(weight, values_high, acc_high[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            store_lanes(out[r] + j, acc_low[r], low);
            if (high) store_lanes(out[r] + j + 8, acc_high[r], high);
        }
    }
}

void weighted_values(const float* const* p, const int* seen, int rows, const float* v, long v_stride, int s0, int n,
                     int dv, float* const* out) {
    switch (rows) {
        case 1: return weighted_values<1>(p, seen, v, v_stride, s0, n, dv, out);
        case 2: return weighted_values<2>(p, seen, v, v_stride, s0, n, dv, out);
        case 3: return weighted_values<3>(p, seen, v, v_stride, s0, n, dv, out);
        default: return weighted_values<ROWS>(p, seen, v, v_stride, s0, n, dv, out);
    }
}

// Query rows [i0, i0 + count) of KV head kvh's group in batch b, the group's rows in (token, head)
// order: row i is token i / group of head kvh * group + i % group, so that rows side by side share
// the keys they read and see no fewer keys as i rises. Keys and values are taken a chunk of rows at
// a time (decoded once, where quantized) and each chunk serves every block of ROWS rows while it is
// in cache: a decode step's group of heads, or a verify pass's tokens, read the cache once.
void group_rows(const Attention& a, const std::vector<mx::array>& in, float* out, int b, int kvh, int i0, int count) {
    thread_local mlx_hybrid::LineVector<float> buffer;
    const int group = a.heads / a.kv_heads;
    const auto [keys, values] = head_entries(a, in, b, kvh);
    const int held = keys_held(a, in, b);
    const long row_floats = (held + 7) / 8 * 8;  // each row's scores start on a 32-byte boundary
    const long q_floats = a.key_dim + 8;
    float* scratch = aligned_floats(
        buffer, count * (row_floats + q_floats) + (keys.decoded() ? CHUNK_ROWS * std::max(a.key_dim, a.value_dim) : 0));
    float* decoded = scratch + count * (row_floats + q_floats);
    std::vector<const float*> q(count);
    std::vector<float*> scores(count), outs(count), at(count);
    std::vector<int> seen(count);
    for (int r = 0; r < count; r++) {
        const int t = (i0 + r) / group, h = kvh * group + (i0 + r) % group;
        const long row = ((long)b * a.heads + h) * a.tokens + t;
        const float* q_row = in[0].data<float>() + row * a.key_dim;
        float* scaled = scratch + count * row_floats + r * q_floats;
        for (int i = 0; i < a.key_dim; i++) scaled[i] = a.scale * q_row[i];
        q[r] = scaled;
        scores[r] = scratch + r * row_floats;
        outs[r] = out + row * a.value_dim;
        seen[r] = keys_seen(a, held, t);
    }
    // each block's rows (r0 .. r0 + rows): keys [s0, s0 + n) of a chunk, cut to what its last row sees
    auto in_view = [&](int r0, int rows, int s0, int n) { return std::min(n, seen[r0 + rows - 1] - s0); };
    const int most = seen[count - 1];
    for (int s0 = 0; s0 < most; s0 += CHUNK_ROWS) {  // a row's scores past its seen keys go unread
        long stride;
        const float* k = keys.rows(s0, std::min(CHUNK_ROWS, most - s0), decoded, &stride);
        for (int r0 = 0; r0 < count; r0 += ROWS) {
            const int rows = std::min(ROWS, count - r0), n = in_view(r0, rows, s0, CHUNK_ROWS);
            if (n <= 0) continue;
            for (int r = r0; r < r0 + rows; r++) at[r] = scores[r] + s0;
            dots(&q[r0], rows, k, stride, n, a.key_dim, &at[r0]);
        }
    }
    for (int r = 0; r < count; r++) {
        softmax(scores[r], seen[r]);
        std::fill(outs[r], outs[r] + a.value_dim, 0.0f);
    }
    for (int s0 = 0; s0 < most; s0 += CHUNK_ROWS) {
        long stride;
        const int n = std::min(CHUNK_ROWS, most - s0);
        const float* v = values.rows(s0, n, decoded, &stride);
        if (!values.decoded())  // the chunk into cache in order: weighted_values reads it 16 features a pass
            for (int s = 0; s < n; s++)
                for (int j = 0; j < a.value_dim; j += 16) _mm_prefetch((const char*)(v + s * stride + j), _MM_HINT_T0);
        for (int r0 = 0; r0 < count; r0 += ROWS) {
            const int rows = std::min(ROWS, count - r0), n = in_view(r0, rows, s0, CHUNK_ROWS);
            if (n > 0) weighted_values(&scores[r0], &seen[r0], rows, v, stride, s0, n, a.value_dim, &outs[r0]);
        }
    }
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
// sgemm), the carried softmax, out += p v (a second); then each row divided by its sum. A quantized
// cache's block of keys and of values is decoded first, its rows shared among the threads.
void prompt_rows(const Attention& a, const std::vector<mx::array>& in, float* out, int b, int kvh, int r0, int rows) {
    thread_local mlx_hybrid::LineVector<float> buffer;
    const int group = a.heads / a.kv_heads;
    const long first_row = ((long)b * a.heads + (long)kvh * group) * a.tokens + r0;
    const float* q = in[0].data<float>() + first_row * a.key_dim;
    const auto [keys, values] = head_entries(a, in, b, kvh);
    float* o = out + first_row * a.value_dim;
    const long decoded = keys.decoded() ? (long)KEY_BLOCK * (a.key_dim + a.value_dim) : 0;
    float* scores = aligned_floats(buffer, (size_t)PROMPT_ROWS * KEY_BLOCK + 3 * PROMPT_ROWS + decoded);
    float *top = scores + (long)PROMPT_ROWS * KEY_BLOCK, *sum = top + PROMPT_ROWS;
    int* valid = (int*)(sum + PROMPT_ROWS);
    float *key_rows = sum + 2 * PROMPT_ROWS, *value_rows = key_rows + (long)KEY_BLOCK * a.key_dim;
    const int held = keys_held(a, in, b);
    int keys_in_view = 0;  // the most any row sees
    for (int r = 0; r < rows; r++) {
        keys_in_view = std::max(keys_in_view, keys_seen(a, held, (r0 + r) % a.tokens));
        top[r] = -std::numeric_limits<float>::infinity(), sum[r] = 0.0f;
    }
    std::fill(o, o + (long)rows * a.value_dim, 0.0f);
    Pool& pool = Pool::get();
    const int parts = std::min(pool.threads(), rows);
    for (int s0 = 0; s0 < keys_in_view; s0 += KEY_BLOCK) {
        const int count = std::min(KEY_BLOCK, keys_in_view - s0);
        for (int r = 0; r < rows; r++) valid[r] = std::min(count, keys_seen(a, held, (r0 + r) % a.tokens) - s0);
        const float *k = key_rows, *v = value_rows;
        long k_stride = a.key_dim, v_stride = a.value_dim;
        if (keys.decoded()) {
            const int decoders = std::min(parts, count);
            pool.run(decoders, decoders > 1, [&](int part) {
                const int first = count * part / decoders, last = count * (part + 1) / decoders;
                keys.decode(s0 + first, last - first, key_rows + (long)first * a.key_dim);
                values.decode(s0 + first, last - first, value_rows + (long)first * a.value_dim);
            });
        } else {
            k = keys.rows(s0, count, nullptr, &k_stride), v = values.rows(s0, count, nullptr, &v_stride);
        }
        cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, rows, count, a.key_dim, a.scale, q, a.key_dim, k, (int)k_stride, 0.0f,
                    scores, KEY_BLOCK);
        pool.run(parts, parts > 1, [&](int part) {
            carry_softmax(scores, valid, top, sum, o, a.value_dim, rows * part / parts, rows * (part + 1) / parts);
        });
        cblas_sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, rows, a.value_dim, count, 1.0f, scores, KEY_BLOCK, v,
                    (int)v_stride, 1.0f, o, a.value_dim);
    }
    for (int r = 0; r < rows; r++) {
        float inverse = 1.0f / sum[r];
        for (int j = 0; j < a.value_dim; j++) o[(long)r * a.value_dim + j] *= inverse;
    }
}

void compute(const Attention& a, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    float* out = outs[0].data<float>();
    const int head_rows = a.heads / a.kv_heads * a.tokens;
    if (a.tokens > FEW_TOKENS) {  // on this thread: the BLAS and the softmax's parts take the cores
        for (int b = 0; b < a.batch; b++)
            for (int kvh = 0; kvh < a.kv_heads; kvh++)
                for (int r0 = 0; r0 < head_rows; r0 += PROMPT_ROWS)
                    prompt_rows(a, in, out, b, kvh, r0, std::min(PROMPT_ROWS, head_rows - r0));
        return;
    }
    // each KV head's rows in as few parts as keep the threads busy, whole blocks each: a part reads
    // the head's keys and values once
    Pool& pool = Pool::get();
    const int blocks = (head_rows + ROWS - 1) / ROWS, heads = a.batch * a.kv_heads;
    const int parts = std::min(blocks, std::max(1, pool.threads() / heads));
    const long work = (long)a.batch * a.heads * a.tokens * a.keys * (a.key_dim + a.value_dim);
    pool.run(heads * parts, work >= PARALLEL_MIN_VALUES, [&](int unit) {
        const int bh = unit / parts, part = unit % parts;
        const int first = blocks * part / parts * ROWS, last = std::min(head_rows, blocks * (part + 1) / parts * ROWS);
        group_rows(a, in, out, bh / a.kv_heads, bh % a.kv_heads, first, last - first);
    });
}

// the keys and values read by their strides: float32, or a quantized cache's codes, scales and biases
using ScaledDotProductAttention = mlx_hybrid::CpuPrimitive<Attention, compute, 0b110>;
using QuantizedCacheAttention = mlx_hybrid::CpuPrimitive<Attention, compute, 0b1111110>;

void check_attention(const Attention& a, const mx::array& q, const mx::Shape& k, const mx::Shape& v) {
    if (a.tokens < 1 || a.keys < 1 || a.kv_heads < 1 || a.heads % a.kv_heads || k[0] != a.batch ||
        v[0] != a.batch || v[1] != a.kv_heads || v[2] != a.keys || (a.causal && a.tokens > a.keys))
        throw std::invalid_argument("attention: shapes that do not fit (heads a multiple of the KV heads)");
    if (q.dtype() != mx::float32) throw std::invalid_argument("attention: q in float32");
}

// The inputs with each batch row's key count last, where given (int32 [B]).
std::vector<mx::array> with_row_keys(Attention& a, std::vector<mx::array> inputs,
                                     const std::optional<mx::array>& key_lengths) {
    a.row_keys = key_lengths.has_value();
    if (!a.row_keys) return inputs;
    if (key_lengths->dtype() != mx::int32 || key_lengths->shape() != mx::Shape{a.batch})
        throw std::invalid_argument("attention: key_lengths int32 [B], each batch row's keys");
    inputs.push_back(*key_lengths);
    return inputs;
}

// q [B, H, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv], float32 -> [B, H, T, Dv]; key_lengths: batch row b
// holds only its first key_lengths[b] keys (the causal mask aligned to its last)
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                    const std::optional<mx::array>& key_lengths) {
    if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
        throw std::invalid_argument("attention: q [B, H, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv]");
    Attention a{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3), v.shape(3), scale, causal, 0, 0,
                false};
    if (k.shape(3) != a.key_dim) throw std::invalid_argument("attention: keys of another width than the queries");
    check_attention(a, q, k.shape(), v.shape());
    if (k.dtype() != mx::float32 || v.dtype() != mx::float32)
        throw std::invalid_argument("attention: q, k and v in float32");
    auto stream = mx::default_stream(mx::Device::cpu);
    auto inputs = with_row_keys(a, {q, k, v}, key_lengths);
    auto primitive = std::make_shared<ScaledDotProductAttention>(stream, a, "ScaledDotProductAttention");
    return mx::array({a.batch, a.heads, a.tokens, a.value_dim}, mx::float32, primitive, std::move(inputs));
}

// q [B, H, T, Dk] float32 over keys and values held as MLX's affine groups (mx.quantize's codes
// uint32 [B, Hkv, S, D bits / 32], scales and biases float32 [B, Hkv, S, D / group]) -> [B, H, T, Dv]
mx::array quantized_attention(const mx::array& q, const std::vector<mx::array>& k, const std::vector<mx::array>& v,
                              float scale, bool causal, int bits, int group,
                              const std::optional<mx::array>& key_lengths) {
    if (k.size() != 3 || v.size() != 3 || q.ndim() != 4)
        throw std::invalid_argument("attention: q [B, H, T, Dk], keys and values each (codes, scales, biases)");
    if ((bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128))
        throw std::invalid_argument("attention: a quantized cache of 4 or 8 bits in groups of 32, 64 or 128");
    for (const auto* entry : {&k, &v}) {
        const auto &codes = (*entry)[0], &scales = (*entry)[1], &biases = (*entry)[2];
        if (codes.ndim() != 4 || codes.dtype() != mx::uint32 || scales.dtype() != mx::float32 ||
            biases.dtype() != mx::float32 || scales.shape() != biases.shape() || scales.ndim() != 4 ||
            mx::Shape(codes.shape().begin(), codes.shape().end() - 1) !=
                mx::Shape(scales.shape().begin(), scales.shape().end() - 1) ||
            (long)codes.shape(3) * 32 != (long)scales.shape(3) * group * bits)
            throw std::invalid_argument("attention: codes uint32 and float32 scales and biases of mx.quantize's shapes");
    }
    Attention a{q.shape(0), q.shape(1), k[0].shape(1), q.shape(2), k[0].shape(2), q.shape(3), v[1].shape(3) * group,
                scale, causal, bits, group, false};
    if (k[1].shape(3) * group != a.key_dim)
        throw std::invalid_argument("attention: keys of another width than the queries");
    check_attention(a, q, k[0].shape(), v[0].shape());
    auto stream = mx::default_stream(mx::Device::cpu);
    auto inputs = with_row_keys(a, {q, k[0], k[1], k[2], v[0], v[1], v[2]}, key_lengths);
    auto primitive = std::make_shared<QuantizedCacheAttention>(stream, a, "QuantizedCacheAttention");
    return mx::array({a.batch, a.heads, a.tokens, a.value_dim}, mx::float32, primitive, std::move(inputs));
}

// Rotary embedding, rotate-half layout, from factors computed on the host: y = x c + x[partner] s
// with c, s [T, D] (reference.py's form: partner i + D'/2 for the first half of the rotary
// features D', i - D'/2 for the second, itself past them, where c = 1 and s = 0), or [B, T, D]: each
// batch row's own (rows of a batch at their own positions). MLX's form takes four ops (a gather and its
// views, the fused products); each row here its D values in order.
struct Rope {
    int tokens, dim, rotary_dims;
    long rows_per_set;  // x's rows that take one set of factors: all, or a batch row's
    bool operator==(const Rope&) const = default;
};

void rotate(const Rope& r, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const float *x = in[0].data<float>(), *c = in[1].data<float>(), *s = in[2].data<float>();
    float* y = outs[0].data<float>();
    const int half = r.rotary_dims / 2;
    for (long row = 0, rows = (long)(outs[0].size() / r.dim); row < rows; row++) {
        const long factors = (row / r.rows_per_set * r.tokens + row % r.tokens) * r.dim;
        const float *xr = x + row * r.dim, *cr = c + factors, *sr = s + factors;
        float* yr = y + row * r.dim;
        for (int i = 0; i < r.dim; i++) {
            int partner = i < half ? i + half : i < r.rotary_dims ? i - half : i;
            yr[i] = xr[i] * cr[i] + xr[partner] * sr[i];
        }
    }
}

using RotaryEmbedding = mlx_hybrid::CpuPrimitive<Rope, rotate>;

// x [..., T, D], c and s [T, D] (or [B, T, D] for x [B, ..., T, D]), float32 -> [..., T, D]
mx::array rope(const mx::array& x, const mx::array& c, const mx::array& s, int rotary_dims) {
    if (x.ndim() < 2 || x.dtype() != mx::float32 || c.dtype() != mx::float32 || s.dtype() != mx::float32)
        throw std::invalid_argument("rope: x [..., T, D], c and s [T, D] or [B, T, D], float32");
    const int tokens = x.shape(-2), dim = x.shape(-1);
    const bool per_batch = c.ndim() == 3;
    const long rows = std::max(1L, (long)(x.size() / dim));
    Rope r{tokens, dim, rotary_dims, per_batch ? std::max(1L, rows / std::max(1, x.shape(0))) : rows};
    const mx::Shape factors = per_batch ? mx::Shape{x.shape(0), tokens, dim} : mx::Shape{tokens, dim};
    if ((per_batch && x.ndim() < 3) || c.shape() != factors || s.shape() != c.shape() || rotary_dims < 0 ||
        rotary_dims % 2 || rotary_dims > dim)
        throw std::invalid_argument("rope: factors [T, D] or [B, T, D] for x [B, ..., T, D], an even rotary width "
                                    "up to D");
    auto stream = mx::default_stream(mx::Device::cpu);
    return mx::array(x.shape(), mx::float32, std::make_shared<RotaryEmbedding>(stream, r, "RotaryEmbedding"),
                     {x, c, s});
}

}  // namespace

void mlx_hybrid::bind_attention(nb::module_& m) {
    m.def("rope", &rope, nb::arg("x"), nb::arg("c"), nb::arg("s"), nb::arg("rotary_dims"),
          "x c + x[partner] s over the last axis, rotate-half partners within the first rotary_dims");
    m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("causal"),
          nb::arg("key_lengths").none() = nb::none(),
          "softmax(q k^T scale) v over grouped heads; causal: the mask aligned to the last key (of each batch "
          "row's key_lengths where given)");
    m.def("quantized_attention", &quantized_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
          nb::arg("causal"), nb::arg("bits"), nb::arg("group_size"), nb::arg("key_lengths").none() = nb::none(),
          "attention as `attention`, the keys and values each mx.quantize's (codes, scales, biases)");
}
