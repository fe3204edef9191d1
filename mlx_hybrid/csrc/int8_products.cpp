// GGUF products with llama.cpp's arithmetic on x86 (AVX2): each row of x quantized alone to the
// type's companion blocks as llama.cpp quantizes it, integer dot products, the block scales applied
// in llama.cpp's order. A row's result depends on that row alone.
// - Q8_0 x Q8_0 (ggml_vec_dot_q8_0_q8_0): per block of 32, d = max |x| / 127 rounded to float16,
//   codes round-half-even(x * 127 / max |x|); the block's integer products in 8 lanes of 4, each
//   lane's sum times d_w * d_x added into its float lane (a fused multiply-add), the 8 lanes summed by
//   a fixed tree.
// - Q5_0, Q4_0, IQ4_NL and MXFP4 x Q8_0, Q5_1 and Q4_1 x Q8_1 (ggml_vec_dot_q5_0_q8_0 and the others):
//   as Q8_0, with Q8_1's s (d times the codes' sum, float16) times m_w into one more float sum; Q4_0,
//   IQ4_NL and MXFP4 matrices of rows in eights as llama.cpp's x86 build repacks them
//   (ggml_gemv_q4_0_8x8_q8_0: a block's sum one integer, times d_w d_x into the row's one accumulator);
//   MXFP4's scale 2^(e - 128) with twice the E2M1 values.
// - Q4_K x Q8_K (ggml_gemv_q4_K_8x8_q8_K, the repacked form llama.cpp's x86 build multiplies Q4_K
//   matrices of rows in eights in; others ggml_vec_dot_q4_K_q8_K): per block of 256, d_x = 1 /
//   (-127 / x_max) with x_max the value of largest magnitude, codes min(127, nearest(x * -127 /
//   x_max)); the block's sums of sc_j * (codes . x codes) over its groups of 32 and of m_j * (the
//   group's x codes), exact integers, into float accumulators (fused multiply-adds by d_w d_x and
//   dmin_w d_x), the second subtracted at the end. Q6_K, Q5_K, Q3_K and Q2_K x Q8_K
//   (ggml_vec_dot_q6_K_q8_K and the others, as llama.cpp's AVX2 build computes them) likewise, in lanes;
//   IQ4_XS x Q8_K (ggml_vec_dot_iq4_xs_q8_K) too, with IQ4_NL's values.
// - IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M x Q8_K (ggml_vec_dot_iq2_xxs_q8_K and the
//   others): each 32 values decoded from the file's block to signed grid values (gguf_grid.h), times the
//   codes in lanes of 4, times the scale 2 s + 1 as integers; a block's lanes times d_w d_x into the
//   float lanes, their tree divided by the type's divisor (8, 4 or 1: a power of two); the IQ1 types'
//   deltas in a sum of their own. TQ1_0 and TQ2_0 x Q8_K (ggml_vec_dot_tq1_0_q8_K, ..._tq2_0_q8_K) likewise
//   in lanes, their -1 by the codes' sums of 16.
//
// The weight is held as the package holds the type (loaders/quantized.py, `layout_of`): packed codes
// (Q8_0's q + 128 in bytes, Q4_K's nibbles a value at a time, 5 and 6 bits as MLX packs them), float16
// factors (Q8_0, Q5_0: d a group; Q5_1: d and m a group; Q4_K: d and -dmin a block) and int8 codes
// (Q4_K: sc_j and m_j a group); the grid types and TQ1_0 as the file's blocks (uint8) with their grid.
// Any number of rows: rows of x are taken up to 16 at a time (TILE_ROWS' comment), each weight row
// decoded once for them, each output's arithmetic the same as for its row alone. The Python side
// (ops/products.py) decides which products take this path.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "gguf_grid.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using mlx_hybrid::Pool;
namespace grid = mlx_hybrid::gguf_grid;

namespace {

constexpr int BLOCK = 32;           // Q8_0's values a block; Q4_K's a group
constexpr int SUPER_BLOCK = 256;    // Q8_K's and Q4_K's values a block
constexpr long ROWS_PER_PART = 64;  // weight rows a thread takes at a time (the least, for a row of x alone)
// rows of x the products take at a time: the groups-of-16 K-quants' AVX-512 body 16 (its 32 registers)
// where K <= 2048 (16 rows of codes within L1), else 8 as their AVX2 one; Q4_K matrices of rows in
// eights 4 with AVX2 (dot_rows8_q4_k: 8 weight rows' values fill half the registers), 8 with AVX-512
// (dot_rows16_q4_k_wide: 16 weight rows' values in 8 of its 32; 8 rows of x ran a 512-token prompt's
// products 15% faster than 4 on an Intel Xeon); the others 8
constexpr int TILE_ROWS = 16;

enum Type {
    Q8_0 = 0, Q4_K = 1, Q6_K = 2, Q5_0 = 3, Q5_1 = 4, Q4_0 = 5, Q4_1 = 6, IQ4_NL = 7, Q5_K = 8, Q3_K = 9, Q2_K = 10,
    IQ4_XS = 11, IQ2_XXS = 12, IQ2_XS = 13, IQ2_S = 14, IQ3_XXS = 15, IQ3_S = 16, IQ1_S = 17, IQ1_M = 18, TQ1_0 = 19,
    TQ2_0 = 20, MXFP4 = 21, F16 = 22, BF16 = 23
};
constexpr int TYPES = 22;  // int8_matmul's; F16 and BF16 matrices (llama.cpp's 16-bit activations): half_matmul's
constexpr bool is_half_type(Type type) { return type == F16 || type == BF16; }
// the types held as the file's blocks (the grid types and TQ1_0), in gguf_grid's order of them
constexpr bool is_grid_type(Type type) { return type >= IQ2_XXS && type <= TQ1_0; }
constexpr int grid_values(Type type) { return grid::IQ2_XXS + (type - IQ2_XXS); }

// the target of this unit's vector functions: AVX2 and FMA (cpu_kernels.h's AVX2_FN) and F16C's
// float16 conversions
#define INT8_FN __attribute__((target("avx2,fma,f16c")))
// and of their AVX-512 bodies (where the CPU has AVX-512 F, VL, BW and DQ: `mlx_hybrid::avx512_in_use`),
// each the AVX2 one's arithmetic to the bit
#define INT8_WIDE_FN AVX512_FN
// an AVX2 body inlined into both (compiled for AVX-512 where its caller is)
#define INT8_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline
// a part of an AVX-512 body that has no AVX2 twin
#define INT8_WIDE_INLINE __attribute__((target(AVX512_TARGET), always_inline)) inline

struct Q8Shape {
    int rows, inputs, outputs;  // M, K, N
    int chosen = 0;             // an expert product's matrices a token (k), else 0
    bool shared = false;        // an expert product's x: one row a token for all its k choices
    Type type = Q8_0;
    bool interleaved = false;   // rows held in eights, their codes interleaved (`interleave_eights`)
    bool operator==(const Q8Shape&) const = default;
};

// Rows of x quantized for a type: codes [rows, K] (Q4_K's in the order its nibbles are read: each
// 64 values' even ones, then their odd ones; TQ2_0's in tq2_step's order), each block's d, and what
// the weight rows share of x: Q4_K's and Q5_K's group sums of codes as int16 (0, sum) pairs, 16 a block
// (m_j's products in one madd); Q2_K's, Q6_K's, TQ1_0's, TQ2_0's and IQ1_S's sums of 16 codes
// (llama.cpp's bsums); IQ1_M's sums of 4 as (sum, 0) pairs, a lane's (its deltas' products in one madd);
// Q3_K's 4 (x_2i + x_2i+1) a code pair (the -4 of q - 4, as maddubs(4, x) gives it), Q5_0's 16 and Q4_0's
// 8 likewise (Q4_0, IQ4_NL and MXFP4 rows in eights: each block's sum of codes); Q5_1's and Q4_1's Q8_1
// blocks: each block's s, d times its sum of codes as float16.
struct QuantizedRows {
    // each row from a cache line's start: from malloc's 16-byte boundary, the 16-bit products of 4 to 16
    // rows ran 1.3-1.4x slower (docs/benchmarks.md)
    mlx_hybrid::LineVector<int8_t> codes;
    mlx_hybrid::LineVector<float> d;
    mlx_hybrid::LineVector<int16_t> shared;
    mlx_hybrid::LineVector<float> s;
    mlx_hybrid::LineVector<float> rounded;  // F16's and BF16's: x rounded to 16 bits, as the float32 values they are
};

// value i of a step of 32 goes to place bf16_step_place(i) (dot_rows_half's step_values): each 16's even
// values, then its odd ones; with AVX-512 (dot_rows_half_wide) the step's even values, then its odd ones
constexpr int bf16_step_place(int i, bool wide) {
    return wide ? i % 2 * 16 + i / 2 : i / 16 * 16 + i % 2 * 8 + i % 16 / 2;
}

// ggml's fp32_to_fp16 (F16C, to nearest even) and fp32_to_bf16 (to nearest even, a NaN made quiet) of a
// row, each value back as the float32 it is; BF16's steps of 32 in bf16_step_place's order, the rest in
// order
template <bool BF16>
INT8_FN void round_row_to_16_bits(const float* x, int K, float* out, bool wide) {
    int i = 0;
    for (; !BF16 && i + 8 <= K; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
    const int steps = K / 32 * 32;
    for (; i < K; i++) {
        if constexpr (BF16) {
            uint32_t u;
            std::memcpy(&u, x + i, 4);
            const bool nan = (u & 0x7fffffff) > 0x7f800000;
            u = nan ? (u | 0x00400000) & 0xffff0000 : ((u + 0x7fff + ((u >> 16) & 1)) >> 16) << 16;
            std::memcpy(out + (i < steps ? i / 32 * 32 + bf16_step_place(i % 32, wide) : i), &u, 4);
        } else {
            out[i] = _cvtsh_ss(_cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT));
        }
    }
}

// the sum of a vector's 8 int32 lanes (exact)
INT8_FN inline int32_t sum_int_lanes(__m256i v) {
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    four = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
    return _mm_cvtsi128_si32(four) + _mm_extract_epi32(four, 1);
}

// llama.cpp's quantize_row_q8_0 (x86): the block's largest magnitude m, d = m / 127 stored as
// float16 (round to nearest even), the codes round-to-nearest-even(x * (127 / m)) (0 when m is 0).
// With `s`, quantize_row_q8_1's too: s = d (unrounded) times the codes' sum, as float16.
INT8_FN void quantize_row(const float* x, int K, int8_t* codes, float* d, float* s = nullptr) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / BLOCK; b++) {
        __m256 v[4], magnitude = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
            magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 max4 = _mm_max_ps(_mm256_extractf128_ps(magnitude, 1), _mm256_castps256_ps128(magnitude));
        max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        max4 = _mm_max_ss(max4, _mm_movehdup_ps(max4));
        const float largest = _mm_cvtss_f32(max4);
        d[b] = _cvtsh_ss(_cvtss_sh(largest / 127.0f, 0));
        const __m256 scale = _mm256_set1_ps(largest != 0.0f ? 127.0f / largest : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT |
                                                                                  _MM_FROUND_NO_EXC));
        // int32 -> int8 in order: packs interleave 128-bit halves, the permute puts them back
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(codes + b * BLOCK), packed);
        if (s) {
            const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            s[b] = _cvtsh_ss(_cvtss_sh(largest / 127.0f * (float)sum_int_lanes(sum), 0));
        }
    }
}

// llama.cpp's quantize_row_q8_K (x86 takes its reference code); codes stored in value order, or for
// Q4_K's reading of nibbles (each 64 values' even ones, then their odd ones), or in tq2_step's order
// (TQ2_0); `shared` as the type's kernel reads it (QuantizedRows).
INT8_FN void quantize_row_q8_k(const float* x, int K, int8_t* codes, float* d, int16_t* shared, Type type) {
    alignas(32) int8_t ordered[SUPER_BLOCK];
    const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int b = 0; b < K / SUPER_BLOCK; b++) {
        const float* v = x + b * SUPER_BLOCK;
        // the largest magnitude, then the first value of it (the reference's strict > keeps the first and
        // passes over NaN: max_ps returns its second operand where either is NaN)
        __m256 most = _mm256_setzero_ps();
        for (int i = 0; i < SUPER_BLOCK; i += 8)
            most = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), magnitude_mask), most);
        __m128 four = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
        four = _mm_max_ps(four, _mm_movehl_ps(four, four));
        const float largest = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
        float signed_largest = 0;
        for (int i = 0; largest != 0 && i < SUPER_BLOCK; i++)
            if (std::fabs(v[i]) == largest) {
                signed_largest = v[i];
                break;
            }
        const float inverse = largest != 0 ? -127.0f / signed_largest : 0.0f;
        d[b] = largest != 0 ? 1 / inverse : 0.0f;
        // min(127, to nearest with ties to even (llama.cpp's nearest_int) of inverse * v); all 0 where largest
        // is; a NaN product (a NaN value, or an infinite one times 0) 0, as llama.cpp's nearest_int makes it
        const __m256 scale = _mm256_set1_ps(inverse);
        const __m256i nan_code = _mm256_set1_epi32(INT32_MIN);  // (what cvtps gives NaN)
        for (int i = 0; i < SUPER_BLOCK; i += 32) {
            __m256i q[4];
            for (int j = 0; j < 4; j++) {
                q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(scale, _mm256_loadu_ps(v + i + 8 * j)),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                q[j] = _mm256_min_epi32(_mm256_andnot_si256(_mm256_cmpeq_epi32(q[j], nan_code), q[j]),
                                        _mm256_set1_epi32(127));
            }
            __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_store_si256((__m256i*)(ordered + i), packed);
        }
        if (type == Q2_K || type == Q6_K || type == TQ1_0 || type == TQ2_0 || type == IQ1_S) {  // sums of 16 codes
            for (int g = 0; g < SUPER_BLOCK / 16; g++) {
                int16_t sum = 0;
                for (int i = 0; i < 16; i++) sum += ordered[g * 16 + i];
                shared[b * 16 + g] = sum;
            }
        } else if (type == IQ1_M) {  // sums of 4 codes, as (sum, 0) int16 pairs
            for (int lane = 0; lane < SUPER_BLOCK / 4; lane++) {
                shared[b * SUPER_BLOCK / 2 + 2 * lane] = (int16_t)(ordered[4 * lane] + ordered[4 * lane + 1] +
                                                                   ordered[4 * lane + 2] + ordered[4 * lane + 3]);
                shared[b * SUPER_BLOCK / 2 + 2 * lane + 1] = 0;
            }
        } else if (type == Q4_K || type == Q5_K) {
            for (int g = 0; g < SUPER_BLOCK / BLOCK; g++) {
                int16_t sum = 0;
                for (int i = 0; i < BLOCK; i++) sum += ordered[g * BLOCK + i];
                shared[b * 16 + 2 * g] = 0;
                shared[b * 16 + 2 * g + 1] = sum;
            }
        }
        if (type == TQ2_0) {  // tq2_step's order: step s of 128 values holds value 32 r + 4 l + s at 4 l + r
            for (int chunk = 0; chunk < SUPER_BLOCK / 128; chunk++)
                for (int step = 0; step < 4; step++)
                    for (int i = 0; i < 32; i++)
                        codes[b * SUPER_BLOCK + chunk * 128 + step * 32 + i] =
                            ordered[chunk * 128 + 32 * (i % 4) + 4 * (i / 4) + step];
            continue;
        }
        const bool nibble_order = type == Q4_K;
        for (int chunk = 0; chunk < SUPER_BLOCK / 64; chunk++)
            for (int i = 0; i < 32; i++) {
                const int even = nibble_order ? 2 * i : i, odd = nibble_order ? 2 * i + 1 : 32 + i;
                codes[b * SUPER_BLOCK + chunk * 64 + i] = ordered[chunk * 64 + even];
                codes[b * SUPER_BLOCK + chunk * 64 + 32 + i] = ordered[chunk * 64 + odd];
            }
    }
}

// A run's scales, the low half's from one int16 of a block's scales and the high half's from
// another, where `scales` holds the block's first or last half's in both halves: the bytes of int16
// `low` (low half) and `high` (high half), repeated.
INT8_FN inline __m256i pick_scales(__m256i scales, int low, int high) {
    const __m128i lo = _mm_set1_epi16((short)(2 * low | (2 * low + 1) << 8));
    const __m128i hi = _mm_set1_epi16((short)(2 * high | (2 * high + 1) << 8));
    return _mm256_shuffle_epi8(scales, _mm256_set_m128i(hi, lo));
}

// The lane sums of four vectors at once: lane i of the result is v[i]'s (integer sums, exact).
INT8_FN inline __m128i sum_int_lanes4(const __m256i (&v)[4]) {
    const __m256i quads = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
}

// ggml_gemv_q4_K_8x8_q8_K's arithmetic for one weight row (nibbles, factors d and -dmin a block, codes
// sc_j and m_j a group) and one quantized row of x (its group sums as QuantizedRows holds them). The
// blocks' integer sums are reduced four blocks at a time (on an AMD EPYC, Zen 4, a 3584 x 1024 product
// on one thread 160 -> 146 us against a block at a time); the float steps stay a block at a time, in
// order.
INT8_FN float dot_row_q4_k(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes, const int8_t* x,
                           const float* x_d, const int16_t* x_sums, int blocks) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    float acc = 0.0f, acc_mins = 0.0f;
    for (int first = 0; first < blocks; first += 4) {
        __m256i sums[4], mins[4];  // a block's lanes (blocks past the last: zeros)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const int b = first + i;
            sums[i] = mins[i] = _mm256_setzero_si256();
            if (b >= blocks) continue;
            // the block's (sc_j, m_j) as int16 pairs: dword j is group j's; groups 0-3 and 4-7 in both halves
            const __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w_codes + 16 * b)));
            const __m256i first_groups = _mm256_permute2x128_si256(codes, codes, 0x00);
            const __m256i last_groups = _mm256_permute2x128_si256(codes, codes, 0x11);
#pragma GCC unroll 4  // (the scales' shuffles then constants)
            for (int chunk = 0; chunk < SUPER_BLOCK / 64; chunk++) {  // two groups: 32 bytes of nibbles
                const __m256i bits = _mm256_loadu_si256((const __m256i*)(w + b * SUPER_BLOCK / 2 + chunk * 32));
                const int8_t* xs = x + b * SUPER_BLOCK + chunk * 64;
                // bytes 0-15: group 2 chunk's values, 16-31: the next group's; low nibbles the even ones
                const __m256i x_even = _mm256_loadu_si256((const __m256i*)xs);
                const __m256i x_odd = _mm256_loadu_si256((const __m256i*)(xs + 32));
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(bits, low), x_even),
                                                       _mm256_maddubs_epi16(high, x_odd));
                const int group = 2 * (chunk % 2);  // the chunk's first group within its half of the block
                const __m256i scales =
                    pick_scales(chunk < 2 ? first_groups : last_groups, 2 * group, 2 * group + 2);
                sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(pairs, scales));
            }
            // m_j times group j's sum of x codes
            mins[i] = _mm256_madd_epi16(codes, _mm256_loadu_si256((const __m256i*)(x_sums + 16 * b)));
        }
        alignas(16) int32_t block_sums[4], block_mins[4];
        _mm_store_si128((__m128i*)block_sums, sum_int_lanes4(sums));
        _mm_store_si128((__m128i*)block_mins, sum_int_lanes4(mins));
        for (int i = 0; i < 4 && first + i < blocks; i++) {
            const int b = first + i;
            const float d = _cvtsh_ss(factors[2 * b]), minus_dmin = _cvtsh_ss(factors[2 * b + 1]);
            acc = std::fma((float)block_sums[i], d * x_d[b], acc);
            acc_mins = std::fma((float)block_mins[i], -minus_dmin * x_d[b], acc_mins);
        }
    }
    return acc - acc_mins;
}

// v[j] lane i becomes v[i] lane j (8 x 8 int32)
INT8_FN inline void transpose8_epi32(__m256i (&v)[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        v[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

// the int32 at p, in every lane
INT8_FN inline __m256i broadcast4(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Block b's (sc_j, m_j) of 8 weight rows (`row_codes` apart) as int16 pairs: groups[j] lane n is row
// n's for group j
INT8_FN inline void block_scales8(const int8_t* w_codes, long row_codes, int b, __m256i (&groups)[8]) {
    for (int n = 0; n < 8; n++)
        groups[n] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w_codes + n * row_codes + 16 * b)));
    transpose8_epi32(groups);
}

// The 16 nibble bytes of group g of block b of 8 weight rows (each `row_bytes` apart), 4 a lane: quads[q]
// lane n holds row n's bytes 4q..4q+3 of the group. Rows held interleaved (`interleave_eights`) hold them
// so; rows as stored are gathered.
template <bool INTERLEAVED>
INT8_INLINE void group_quads8(const uint8_t* w, long row_bytes, int b, int g, __m256i (&quads)[4]) {
    const long at = (long)b * SUPER_BLOCK / 2 + g * 16;
    if constexpr (INTERLEAVED) {
        for (int q = 0; q < 4; q++) quads[q] = _mm256_loadu_si256((const __m256i*)(w + 8 * (at + 4 * q)));
        return;
    }
    __m256i t[4];  // rows 0-3 in the low half, 4-7 in the high
    for (int n = 0; n < 4; n++)
        t[n] = _mm256_loadu2_m128i((const __m128i*)(w + (n + 4) * row_bytes + at),
                                   (const __m128i*)(w + n * row_bytes + at));
    const __m256i a0 = _mm256_unpacklo_epi32(t[0], t[1]), a1 = _mm256_unpackhi_epi32(t[0], t[1]);
    const __m256i a2 = _mm256_unpacklo_epi32(t[2], t[3]), a3 = _mm256_unpackhi_epi32(t[2], t[3]);
    quads[0] = _mm256_unpacklo_epi64(a0, a2), quads[1] = _mm256_unpackhi_epi64(a0, a2);
    quads[2] = _mm256_unpacklo_epi64(a1, a3), quads[3] = _mm256_unpackhi_epi64(a1, a3);
}

// dot_row_q4_k's arithmetic for R rows of x and 8 weight rows at once (the matrix's rows n..n+7, each
// `row_bytes`, `row_factors` and `row_codes` apart; out[r] gets x row r's 8 products), for prompts,
// batches and verify passes: a block's sum per output is one exact integer, so it is taken with the 8
// weight rows in the lanes (each lane 4 nibble bytes of its row, times x's 4 codes in every lane), and
// its float steps are dot_row_q4_k's, lane by lane. (A row of x alone, a decode step, keeps
// dot_row_q4_k where the rows are as stored: gathering their words, this one decoded a Q4_K_M file 4-7%
// slower; held interleaved, it reads one stream.)
template <int R, bool INTERLEAVED>
INT8_FN void dot_rows8_q4_k(const uint8_t* w, long row_bytes, const uint16_t* factors, long row_factors,
                            const int8_t* w_codes, long row_codes, const int8_t* const* x, const float* const* x_d,
                            const int16_t* const* x_sums, int blocks, float* const* out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    // (sc_j, m_j) -> (sc_j, sc_j) in every dword
    const __m256i scale_pair = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5,
                                                4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    __m256 acc[R], acc_mins[R];
    for (int r = 0; r < R; r++) acc[r] = acc_mins[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i groups[8];
        block_scales8(w_codes, row_codes, b, groups);
        uint16_t d_bits[8], minus_dmin_bits[8];
        for (int n = 0; n < 8; n++)
            d_bits[n] = factors[n * row_factors + 2 * b], minus_dmin_bits[n] = factors[n * row_factors + 2 * b + 1];
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d_bits));
        const __m256 dmin = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)minus_dmin_bits)),
                                          _mm256_set1_ps(-0.0f));
        __m256i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int g = 0; g < SUPER_BLOCK / BLOCK; g++) {
            __m256i quads[4];
            group_quads8<INTERLEAVED>(w, row_bytes, b, g, quads);
            __m256i even[4], odd[4];  // values 2i and 2i + 1 of bytes 4q..4q+3 (quad q)
            for (int q = 0; q < 4; q++)
                even[q] = _mm256_and_si256(quads[q], low),
                odd[q] = _mm256_and_si256(_mm256_srli_epi16(quads[q], 4), low);
            const __m256i scales = _mm256_shuffle_epi8(groups[g], scale_pair);
            // x's codes of group g: its even values, then (32 on) its odd ones (QuantizedRows' order)
            const long x_at = (long)b * SUPER_BLOCK + g / 2 * 64 + g % 2 * 16;
            for (int r = 0; r < R; r++) {
                const int8_t* xs = x[r] + x_at;
                // 8 products of at most 15 x 127 a lane: the int16 sums stay within 30480
                __m256i pairs = _mm256_maddubs_epi16(even[0], broadcast4(xs));
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(odd[0], broadcast4(xs + 32)));
                for (int q = 1; q < 4; q++) {
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(even[q], broadcast4(xs + 4 * q)));
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(odd[q], broadcast4(xs + 32 + 4 * q)));
                }
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, scales));
            }
        }
        for (int r = 0; r < R; r++) {
            // m_j times group j's sum of x codes (held as (0, sum) pairs), summed over the block
            __m256i mins = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                mins = _mm256_add_epi32(mins, _mm256_madd_epi16(groups[j], broadcast4(x_sums[r] + 16 * b + 2 * j)));
            const __m256 x_scale = _mm256_set1_ps(x_d[r][b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, x_scale), acc[r]);
            acc_mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, x_scale), acc_mins[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], _mm256_sub_ps(acc[r], acc_mins[r]));
}

// the int32 at p, in every lane
INT8_WIDE_FN inline __m512i broadcast4_wide(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// dot_rows8_q4_k with AVX-512 (BW) for 16 weight rows at once (rows n..n+15: lane i of a register row
// n + i), as llama.cpp's AVX-512 build multiplies two eights of rows together in its prompts. Each
// lane's integer sums and float steps are dot_rows8_q4_k's, so the outputs are its to the bit.
template <int R, bool INTERLEAVED>
INT8_WIDE_FN void dot_rows16_q4_k_wide(const uint8_t* w, long row_bytes, const uint16_t* factors, long row_factors,
                                       const int8_t* w_codes, long row_codes, const int8_t* const* x,
                                       const float* const* x_d, const int16_t* const* x_sums, int blocks,
                                       float* const* out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    // (sc_j, m_j) -> (sc_j, sc_j) in every dword
    const __m512i scale_pair =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
    __m512 acc[R], acc_mins[R];
    for (int r = 0; r < R; r++) acc[r] = acc_mins[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i groups[8];  // groups[j] lane n: weight row n's (sc_j, m_j) as int16
        {
            __m256i eight[2][8];
            for (int half = 0; half < 2; half++)
                block_scales8(w_codes + 8 * half * row_codes, row_codes, b, eight[half]);
            for (int j = 0; j < 8; j++)
                groups[j] = _mm512_inserti64x4(_mm512_castsi256_si512(eight[0][j]), eight[1][j], 1);
        }
        uint16_t d_bits[16], minus_dmin_bits[16];
        for (int n = 0; n < 16; n++)
            d_bits[n] = factors[n * row_factors + 2 * b], minus_dmin_bits[n] = factors[n * row_factors + 2 * b + 1];
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d_bits));
        const __m512 dmin = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)minus_dmin_bits))),
            _mm512_set1_epi32((int)0x80000000)));
        __m512i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
        for (int g = 0; g < SUPER_BLOCK / BLOCK; g++) {
            // each eight's quads (group_quads8): rows 0-7 in the low half, 8-15 in the high
            __m256i lower[4], upper[4];
            group_quads8<INTERLEAVED>(w, row_bytes, b, g, lower);
            group_quads8<INTERLEAVED>(w + 8 * row_bytes, row_bytes, b, g, upper);
            __m512i quads[4];
            for (int q = 0; q < 4; q++) quads[q] = _mm512_inserti64x4(_mm512_castsi256_si512(lower[q]), upper[q], 1);
            __m512i even[4], odd[4];  // values 2i and 2i + 1 of bytes 4q..4q+3 (quad q)
            for (int q = 0; q < 4; q++)
                even[q] = _mm512_and_si512(quads[q], low),
                odd[q] = _mm512_and_si512(_mm512_srli_epi16(quads[q], 4), low);
            const __m512i scales = _mm512_shuffle_epi8(groups[g], scale_pair);
            const long x_at = (long)b * SUPER_BLOCK + g / 2 * 64 + g % 2 * 16;
            for (int r = 0; r < R; r++) {
                const int8_t* xs = x[r] + x_at;
                __m512i pairs = _mm512_maddubs_epi16(even[0], broadcast4_wide(xs));
                pairs = _mm512_add_epi16(pairs, _mm512_maddubs_epi16(odd[0], broadcast4_wide(xs + 32)));
                for (int q = 1; q < 4; q++) {
                    pairs = _mm512_add_epi16(pairs, _mm512_maddubs_epi16(even[q], broadcast4_wide(xs + 4 * q)));
                    pairs = _mm512_add_epi16(pairs, _mm512_maddubs_epi16(odd[q], broadcast4_wide(xs + 32 + 4 * q)));
                }
                sums[r] = _mm512_add_epi32(sums[r], _mm512_madd_epi16(pairs, scales));
            }
        }
        for (int r = 0; r < R; r++) {
            __m512i mins = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                mins = _mm512_add_epi32(mins,
                                        _mm512_madd_epi16(groups[j], broadcast4_wide(x_sums[r] + 16 * b + 2 * j)));
            }
            const __m512 x_scale = _mm512_set1_ps(x_d[r][b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, x_scale), acc[r]);
            acc_mins[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, x_scale), acc_mins[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], _mm512_sub_ps(acc[r], acc_mins[r]));
    mlx_hybrid::leave_avx512();
}

// ggml_vec_dot_q4_K_q8_K's AVX2 arithmetic, for the Q4_K matrices llama.cpp does not repack (rows
// not a multiple of 8), same inputs as dot_row_q4_k: per block, lane k of 8 sums the block's values
// 4k..4k+3 of every group times its sc_j as integers, then times d_w d_x into its float lane; lane k
// of 4 sums m_2k and m_2k+1 times their groups' sums, times -dmin_w d_x into its float lane; the
// result is the first lanes' tree plus the second's.
INT8_FN float dot_row_q4_k_lanes(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes, const int8_t* x,
                                 const float* x_d, const int16_t* x_sums, int blocks) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    // a chunk's int16 sums of 4 values, group 2c's then group 2c + 1's (8 each), as (2c's p, 2c+1's p)
    // pairs in order p: quarters 0 2 1 3, then each half's words interleaved
    const __m256i interleave = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3,
                                                10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_mins = _mm_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w_codes + 16 * b)));
        const __m256i first = _mm256_permute2x128_si256(codes, codes, 0x00);
        const __m256i last = _mm256_permute2x128_si256(codes, codes, 0x11);
        __m256i sums = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int chunk = 0; chunk < SUPER_BLOCK / 64; chunk++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i*)(w + b * SUPER_BLOCK / 2 + chunk * 32));
            const int8_t* xs = x + b * SUPER_BLOCK + chunk * 64;
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
            const __m256i fours = _mm256_add_epi16(
                _mm256_maddubs_epi16(_mm256_and_si256(bits, low), _mm256_loadu_si256((const __m256i*)xs)),
                _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i*)(xs + 32))));
            const __m256i paired =
                _mm256_shuffle_epi8(_mm256_permute4x64_epi64(fours, _MM_SHUFFLE(3, 1, 2, 0)), interleave);
            const int group = 2 * (chunk % 2);  // sc of the chunk's groups: words 2 group and 2 group + 2
            const __m128i pattern = _mm_set1_epi32(4 * group | (4 * group + 1) << 8 | (4 * group + 4) << 16 |
                                                   (4 * group + 5) << 24);
            const __m256i scales = _mm256_shuffle_epi8(chunk < 2 ? first : last, _mm256_set_m128i(pattern, pattern));
            sums = _mm256_add_epi32(sums, _mm256_madd_epi16(paired, scales));
        }
        // (m_j s_j) for the 8 groups, then pairs of groups
        const __m256i mins = _mm256_madd_epi16(codes, _mm256_loadu_si256((const __m256i*)(x_sums + 16 * b)));
        const __m256i pairs = _mm256_hadd_epi32(mins, mins);
        const __m128i four = _mm_unpacklo_epi64(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
        const float d = x_d[b] * _cvtsh_ss(factors[2 * b]), minus_dmin = x_d[b] * _cvtsh_ss(factors[2 * b + 1]);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums), acc);
        acc_mins = _mm_fmadd_ps(_mm_set1_ps(minus_dmin), _mm_cvtepi32_ps(four), acc_mins);
    }
    acc_mins = _mm_add_ps(acc_mins, _mm_movehl_ps(acc_mins, acc_mins));
    acc_mins = _mm_add_ss(acc_mins, _mm_movehdup_ps(acc_mins));
    return mlx_hybrid::sum_lanes(acc) + _mm_cvtss_f32(acc_mins);
}

// Q6_K's 6-bit values, 32 from the 24 bytes at p (a value every 6 bits from the lowest), as bytes in
// order. Reads those 24 bytes only (16 at p, 16 at p + 8).
INT8_FN inline __m256i unpack_6bit_run(const uint8_t* p) {
    const __m256i bytes =
        _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(p + 8)), _mm_loadu_si128((const __m128i*)p));
    // dword g of each half: its group of 3 bytes b0 b1 b2 (4 values) as b0 b1 b1 b2; its low word then
    // holds values 0 and 1 at bits 0 and 6, its high word values 2 and 3 at bits 4 and 10
    const __m256i lanes = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11, 4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11,
                                12, 13, 14, 14, 15));
    // every word's two values at bits 0 and 6, then to bytes
    const __m256i words = _mm256_blend_epi16(lanes, _mm256_srli_epi16(lanes, 4), 0xAA);
    return _mm256_or_si256(_mm256_and_si256(words, _mm256_set1_epi16(0x003F)),
                           _mm256_and_si256(_mm256_slli_epi16(words, 2), _mm256_set1_epi16(0x3F00)));
}

// MLX's 5-bit values, 32 from the 20 bytes at p (8 values every 5 bytes, from the lowest bits), as
// bytes in order. Reads those 20 bytes only (16 at p, 16 at p + 4).
INT8_FN inline __m256i unpack_5bit_run(const uint8_t* p) {
    const __m256i bytes =
        _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(p + 4)), _mm_loadu_si128((const __m128i*)p));
    // word i of each half (values 0-7, then 8-15 of its 16): the two bytes holding value i, which
    // starts at bit 5i; the high half's bytes 10-19 sit at 6-15 of its load
    const __m256i first = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 6, 7, 6, 7, 7, 8, 7, 8, 8, 9, 9, 10, 9,
                                10, 10, 11));
    const __m256i second = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(5, 6, 5, 6, 6, 7, 6, 7, 7, 8, 8, 9, 8, 9, 9, 10, 11, 12, 11, 12, 12, 13, 12, 13, 13, 14,
                                14, 15, 14, 15, 15, -1));  // (value 31 needs byte 19 alone)
    // value i to bits 11-15 (times 2^(11 - its shift 5i mod 8)), then down to bits 0-4
    const __m256i up = _mm256_setr_epi16(1 << 11, 1 << 6, 1 << 9, 1 << 4, 1 << 7, 1 << 10, 1 << 5, 1 << 8, 1 << 11,
                                         1 << 6, 1 << 9, 1 << 4, 1 << 7, 1 << 10, 1 << 5, 1 << 8);
    const __m256i low = _mm256_srli_epi16(_mm256_mullo_epi16(first, up), 11);
    const __m256i high = _mm256_srli_epi16(_mm256_mullo_epi16(second, up), 11);
    return _mm256_packus_epi16(low, high);
}

// MLX's 4-bit values (a byte's low nibble first), 32 from the 16 bytes at p, as bytes in order.
INT8_FN inline __m256i unpack_4bit_run(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)p), low = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(bytes, low), odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    return _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
}

// A Q5_K block's codes (sc_j, m_j pairs as int16) and m_j times the groups' sums of each row of x,
// one integer, times -dmin_w d_x into its float (mins[r]); the block's factor d
template <int R>
INT8_INLINE __m256i q5_k_block(const uint16_t* factors, const int8_t* w_codes, const int16_t* const* x_sums,
                               const float* const* x_d, int b, float (&mins)[R], float& d) {
    const __m256i codes = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w_codes + 16 * b)));
    const float minus_dmin = _cvtsh_ss(factors[2 * b + 1]);
    d = _cvtsh_ss(factors[2 * b]);
    for (int r = 0; r < R; r++) {
        const int32_t group_mins =
            sum_int_lanes(_mm256_madd_epi16(codes, _mm256_loadu_si256((const __m256i*)(x_sums[r] + 16 * b))));
        mins[r] = std::fma(x_d[r][b] * minus_dmin, (float)group_mins, mins[r]);
    }
    return codes;
}

// ggml_vec_dot_q5_K_q8_K's AVX2 arithmetic for one weight row (5-bit values, factors d and -dmin a
// block, codes sc_j and m_j a group) and one row of x quantized to Q8_K (in value order, its group sums
// as QuantizedRows holds them): per block, lane k of 8 sums the block's values 4k..4k+3 of every group
// times its sc_j as integers, then times d_w d_x into its float lane; m_j times the groups' sums, one
// integer, times -dmin_w d_x into one float (fused multiply-adds); the lanes' tree plus that sum. R rows
// of x at once (x[r], x_d[r], x_sums[r]; *out[r] gets row r's product), each run unpacked once for them.
template <int R = 1>
INT8_FN void dot_rows_q5_k(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes, const int8_t* const* x,
                           const float* const* x_d, const int16_t* const* x_sums, int blocks, float* const* out) {
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        float d;
        const __m256i codes = q5_k_block<R>(factors, w_codes, x_sums, x_d, b, mins, d);
        const __m256i first = _mm256_permute2x128_si256(codes, codes, 0x00);
        const __m256i last = _mm256_permute2x128_si256(codes, codes, 0x11);
        __m256i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < SUPER_BLOCK / BLOCK; g++) {
            const int at = b * SUPER_BLOCK + g * BLOCK;
            const __m256i q = unpack_5bit_run(w + at * 5 / 8);
            const int word = 2 * (g % 4);  // sc_g's word in its half of the block's codes
            const __m256i scales = pick_scales(g < 4 ? first : last, word, word);
            for (int r = 0; r < R; r++) {
                const __m256i pairs = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(x[r] + at)));
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(scales, pairs));
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x_d[r][b] * d), _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]) + mins[r];
}

// MLX's 3-bit values, 32 from the 12 bytes at p (8 values every 3 bytes, from the lowest bits), as
// bytes in order. Reads those 12 bytes only (8 at p, 8 at p + 4).
INT8_FN inline __m256i unpack_3bit_run(const uint8_t* p) {
    const __m256i bytes =
        _mm256_set_m128i(_mm_loadl_epi64((const __m128i*)(p + 4)), _mm_loadl_epi64((const __m128i*)p));
    // word i of each half (values 0-7, then 8-15 of its 16): the two bytes holding value i, which starts
    // at bit 3i; the high half's bytes 6-11 sit at 2-7 of its load
    const __m256i first = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 3, 4, 3, 4, 3, 4, 4,
                                5, 4, 5));
    const __m256i second = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 6, 7, 6, 7, 6, 7, 7,
                                -1, 7, -1));  // (values 14, 15 and 30, 31 need their first byte alone)
    // value i to bits 13-15 (times 2^(13 - its shift 3i mod 8)), then down to bits 0-2
    const __m256i up = _mm256_setr_epi16(1 << 13, 1 << 10, 1 << 7, 1 << 12, 1 << 9, 1 << 6, 1 << 11, 1 << 8, 1 << 13,
                                         1 << 10, 1 << 7, 1 << 12, 1 << 9, 1 << 6, 1 << 11, 1 << 8);
    const __m256i low = _mm256_srli_epi16(_mm256_mullo_epi16(first, up), 13);
    const __m256i high = _mm256_srli_epi16(_mm256_mullo_epi16(second, up), 13);
    return _mm256_packus_epi16(low, high);
}

// MLX's 2-bit values, 32 from the 8 bytes at p (4 a byte, from the lowest bits), as bytes in order.
INT8_FN inline __m256i unpack_2bit_run(const uint8_t* p) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)p), three = _mm_set1_epi8(3);
    const __m128i v0 = _mm_and_si128(bytes, three), v1 = _mm_and_si128(_mm_srli_epi16(bytes, 2), three);
    const __m128i v2 = _mm_and_si128(_mm_srli_epi16(bytes, 4), three);
    const __m128i v3 = _mm_and_si128(_mm_srli_epi16(bytes, 6), three);
    const __m128i v01 = _mm_unpacklo_epi8(v0, v1), v23 = _mm_unpacklo_epi8(v2, v3);
    return _mm256_set_m128i(_mm_unpackhi_epi16(v01, v23), _mm_unpacklo_epi16(v01, v23));
}

// unpack_2bit_run of the 16 bytes at p: two runs, the first 32 values and the next 32, with 256-bit
// operations (each half one run's 8 bytes)
INT8_FN inline void unpack_2bit_runs(const uint8_t* p, __m256i& first, __m256i& second) {
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)), 0x10);
    const __m256i three = _mm256_set1_epi8(3);
    const __m256i v0 = _mm256_and_si256(bytes, three), v1 = _mm256_and_si256(_mm256_srli_epi16(bytes, 2), three);
    const __m256i v2 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), three);
    const __m256i v3 = _mm256_and_si256(_mm256_srli_epi16(bytes, 6), three);
    const __m256i v01 = _mm256_unpacklo_epi8(v0, v1), v23 = _mm256_unpacklo_epi8(v2, v3);
    const __m256i low = _mm256_unpacklo_epi16(v01, v23), high = _mm256_unpackhi_epi16(v01, v23);
    first = _mm256_permute2x128_si256(low, high, 0x20), second = _mm256_permute2x128_si256(low, high, 0x31);
}

// MLX's BITS-bit values, 32 from the 4 * BITS bytes at p, as bytes in order.
template <int BITS>
INT8_FN inline __m256i unpack_run(const uint8_t* p) {
    if constexpr (BITS == 2) return unpack_2bit_run(p);
    else if constexpr (BITS == 3) return unpack_3bit_run(p);
    else if constexpr (BITS == 4) return unpack_4bit_run(p);
    else if constexpr (BITS == 5) return unpack_5bit_run(p);
    else return unpack_6bit_run(p);
}

// two runs, the 64 values at p
template <int BITS>
INT8_FN inline void unpack_runs(const uint8_t* p, __m256i& first, __m256i& second) {
    if constexpr (BITS == 2) unpack_2bit_runs(p, first, second);
    else first = unpack_run<BITS>(p), second = unpack_run<BITS>(p + 4 * BITS);
}

// A groups-of-16 K-quant block's scales, as dot_rows_groups16 reads them
struct Groups16Block {
    __m256i scales;  // the block's 16 scales as int16 (Q2_K: sc_j)
    __m256i first, last;  // runs 0-3's and 4-7's scales in both halves (dword r: run r's pair)
};

// A block's scales; Q2_K's m_j times each row's sums of 16 into its lanes (acc[r]) first
template <int BITS, int R>
INT8_FN inline Groups16Block groups16_block(const uint16_t* factors, const int8_t* w_codes,
                                                  const int16_t* const* x_shared, const float* const* x_d, int b,
                                                  __m256 (&acc)[R]) {
    const __m128i codes = _mm_loadu_si128((const __m128i*)(w_codes + 16 * b));
    __m256i all = _mm256_cvtepi8_epi16(codes);
    if constexpr (BITS == 2) {
        const __m128i nibbles = _mm_set1_epi8(0x0F);
        const __m256i mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16(codes, 4), nibbles));
        for (int r = 0; r < R; r++) {
            const __m256i group_mins =
                _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i*)(x_shared[r] + 16 * b)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x_d[r][b] * _cvtsh_ss(factors[2 * b + 1])),
                                     _mm256_cvtepi32_ps(group_mins), acc[r]);
        }
        all = _mm256_cvtepi8_epi16(_mm_and_si128(codes, nibbles));
    }
    return {all, _mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)};
}

// run `run`'s two scales in lanes of 4 (pick_scales of the block's half it is in)
INT8_FN inline __m256i run_scales(const Groups16Block& block, int run) {
    return pick_scales(run < 4 ? block.first : block.last, 2 * (run % 4), 2 * (run % 4) + 1);
}

// A row's block sums (lanes) into its float lanes: Q6_K's less 32 sc_j times the sums of 16, times d_w d_x
template <int BITS>
INT8_FN inline void groups16_block_end(const Groups16Block& block, __m256i sums, const uint16_t* factors,
                                       const int16_t* x_shared, float x_d, int b, __m256& acc) {
    if constexpr (BITS == 6) {
        const __m256i offsets =
            _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x_shared + 16 * b)), block.scales);
        sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(offsets, 5));
    }
    const float d = x_d * _cvtsh_ss(factors[BITS == 2 ? 2 * b : b]);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums), acc);
}

// The groups-of-16 K-quants' AVX2 arithmetic, ggml_vec_dot_q6_K_q8_K's (BITS 6), ..._q3_K_q8_K's (3)
// and ..._q2_K_q8_K's (2), for one weight row (values q, d (Q2_K: and -dmin) a block, a signed sc_j
// (Q2_K: the nibbles sc_j, m_j of a byte) a group of 16) and one row of x quantized to Q8_K (in value
// order, with what QuantizedRows shares): per run of 32 values, q times x's codes in pairs (Q3_K: q -
// 4, its -4 a pair), times the run's two scales in lanes of 4, the lanes summed over the block as
// integers (Q6_K: less 32 times sc_j times group j's sum of codes, two groups a lane), then each
// lane's sum times d_w d_x into its float lane; Q2_K's m_j times x's sums of 16, in lanes of two
// groups, times -dmin_w d_x into the same lanes first; the lanes' tree. R rows of x at once (x[r],
// x_shared[r], x_d[r]; *out[r] gets row r's product), each weight run unpacked once for them.
template <int BITS, int R = 1>
INT8_FN void dot_rows_groups16(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes,
                               const int8_t* const* x, const int16_t* const* x_shared, const float* const* x_d,
                               int blocks, float* const* out) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const Groups16Block block = groups16_block<BITS, R>(factors, w_codes, x_shared, x_d, b, acc);
        __m256i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4  // (the scales' shuffles then constants)
        for (int run = 0; run < SUPER_BLOCK / 32; run += 2) {
            __m256i q[2];
            unpack_runs<BITS>(w + (b * SUPER_BLOCK + run * 32) * BITS / 8, q[0], q[1]);
            for (int h = 0; h < 2; h++) {
                const int at = b * SUPER_BLOCK + (run + h) * 32;
                const __m256i scales = run_scales(block, run + h);
                for (int r = 0; r < R; r++) {
                    __m256i pairs = _mm256_maddubs_epi16(q[h], _mm256_loadu_si256((const __m256i*)(x[r] + at)));
                    if constexpr (BITS == 3)
                        pairs = _mm256_sub_epi16(pairs, _mm256_loadu_si256((const __m256i*)(x_shared[r] + at / 2)));
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(scales, pairs));
                }
            }
        }
        for (int r = 0; r < R; r++)
            groups16_block_end<BITS>(block, sums[r], factors, x_shared[r], x_d[r][b], b, acc[r]);
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
}

// The two 256-bit halves of a 512-bit body's integer lanes added: the AVX2 body's lanes (exact sums)
INT8_WIDE_INLINE __m256i add_halves(__m512i sums) {
    return _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
}

// unpack_6bit_run of two runs at once with AVX-512 (BW), the 64 values of the 48 bytes at p in order (the
// first run in the low half): each 128-bit lane takes its 12 bytes (one masked load, no read past them)
// and unpacks them as unpack_6bit_run's halves do
INT8_WIDE_FN inline __m512i unpack_6bit_runs_wide(const uint8_t* p) {
    const __m512i bytes = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 0, 9, 10, 11, 0),
                                                   _mm512_maskz_loadu_epi32(0x0FFF, p));
    const __m512i lanes = _mm512_shuffle_epi8(
        bytes, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 7, 8, 9, 10, 10, 11)));
    const __m512i words = _mm512_mask_blend_epi16(0xAAAAAAAA, lanes, _mm512_srli_epi16(lanes, 4));
    return _mm512_or_si512(_mm512_and_si512(words, _mm512_set1_epi16(0x003F)),
                           _mm512_and_si512(_mm512_slli_epi16(words, 2), _mm512_set1_epi16(0x3F00)));
}

// dot_rows_groups16 with AVX-512 (BW): two runs a register (the even runs in the low half, the odd
// ones in the high), the halves added at the block's end. The lanes' integer sums are exact, so they
// are the AVX2 body's to the bit, and so is everything after them.
template <int BITS, int R = 1>
INT8_WIDE_FN void dot_rows_groups16_wide(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes,
                                         const int8_t* const* x, const int16_t* const* x_shared,
                                         const float* const* x_d, int blocks, float* const* out) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const Groups16Block block = groups16_block<BITS, R>(factors, w_codes, x_shared, x_d, b, acc);
        __m512i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int run = 0; run < SUPER_BLOCK / 32; run += 2) {
            const int at = b * SUPER_BLOCK + run * 32;
            __m512i q;
            if constexpr (BITS == 6) {
                q = unpack_6bit_runs_wide(w + at * BITS / 8);
            } else {
                __m256i first, second;
                unpack_runs<BITS>(w + at * BITS / 8, first, second);
                q = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
            }
            const __m512i scales = _mm512_inserti64x4(_mm512_castsi256_si512(run_scales(block, run)),
                                                      run_scales(block, run + 1), 1);
            for (int r = 0; r < R; r++) {
                __m512i pairs = _mm512_maddubs_epi16(q, _mm512_loadu_si512(x[r] + at));
                if constexpr (BITS == 3) pairs = _mm512_sub_epi16(pairs, _mm512_loadu_si512(x_shared[r] + at / 2));
                sums[r] = _mm512_add_epi32(sums[r], _mm512_madd_epi16(scales, pairs));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i halves = add_halves(sums[r]);
            groups16_block_end<BITS>(block, halves, factors, x_shared[r], x_d[r][b], b, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
    mlx_hybrid::leave_avx512();
}

// MLX's BITS-bit values (8 every BITS bytes), 64 from the 8 BITS bytes at p, as bytes in order, with
// AVX-512 VBMI: a byte permute gives quadword j of the register its bytes BITS j .. BITS j + BITS - 1
// (values 8j..8j+7; its other bytes the last of them again), a multishift moves value i's bits from
// bit BITS i to a byte of its own. Reads those bytes only.
template <int BITS>
struct UnpackVbmi {
    static constexpr std::array<uint8_t, 64> QUADWORD_BYTES = [] {
        std::array<uint8_t, 64> index{};
        for (int i = 0; i < 64; i++) index[i] = (uint8_t)(BITS * (i / 8) + std::min(i % 8, BITS - 1));
        return index;
    }();
    static constexpr long long VALUE_BITS = [] {
        long long shifts = 0;
        for (int i = 0; i < 8; i++) shifts |= (long long)(BITS * i) << (8 * i);
        return shifts;
    }();
    __m512i quadword_bytes, value_bits, mask;
    AVX512_VBMI_FN UnpackVbmi()
        : quadword_bytes(_mm512_loadu_si512(QUADWORD_BYTES.data())),
          value_bits(_mm512_set1_epi64(VALUE_BITS)),
          mask(_mm512_set1_epi8((1 << BITS) - 1)) {}
    AVX512_VBMI_FN __m512i operator()(const uint8_t* p) const {
        const __m512i bytes =
            _mm512_permutexvar_epi8(quadword_bytes, _mm512_maskz_loadu_epi8((1ULL << (8 * BITS)) - 1, p));
        return _mm512_and_si512(_mm512_multishift_epi64_epi8(value_bits, bytes), mask);
    }
};

// dot_rows_groups16_wide with AVX-512 VBMI: UnpackVbmi's 3 instructions unpack 64 values, and one word
// permute gives a pair of runs its four groups' scales: 4 instructions a pair of runs where
// dot_rows_groups16_wide takes 13 to 18. Q6_K on an AMD EPYC (Zen 4), whose 512-bit instructions take
// two cycles: a 248k-row LM head on one thread 12.8 -> 10.1 ms, llama.cpp's 9.8; Q2_K on an Intel Xeon
// (Emerald Rapids), a row of x alone, where the AVX2 body's unpacking and scale shuffles wait on the
// one shuffle port (docs/benchmarks.md). Exact integer sums again: the AVX2 body's result to the bit.
template <int BITS, int R>
AVX512_VBMI_FN void dot_rows_groups16_vbmi(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes,
                                           const int8_t* const* x, const int16_t* const* x_shared,
                                           const float* const* x_d, int blocks, float* const* out) {
    const UnpackVbmi<BITS> unpack;
    // word lanes 8g..8g+7 (values 16g..16g+15 of a pair of runs): group g of the pair's four
    const __m512i pair_groups = _mm512_set_epi64(0x0003000300030003LL, 0x0003000300030003LL, 0x0002000200020002LL,
                                                 0x0002000200020002LL, 0x0001000100010001LL, 0x0001000100010001LL, 0,
                                                 0);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const Groups16Block block = groups16_block<BITS, R>(factors, w_codes, x_shared, x_d, b, acc);
        const __m512i scales = _mm512_castsi256_si512(block.scales);
        __m512i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int pair = 0; pair < SUPER_BLOCK / 64; pair++) {
            const int at = b * SUPER_BLOCK + pair * 64;
            const __m512i q = unpack(w + at * BITS / 8);
            const __m512i pair_scales =
                _mm512_permutexvar_epi16(_mm512_add_epi16(pair_groups, _mm512_set1_epi16(4 * pair)), scales);
            for (int r = 0; r < R; r++) {
                __m512i pairs = _mm512_maddubs_epi16(q, _mm512_loadu_si512(x[r] + at));
                if constexpr (BITS == 3) pairs = _mm512_sub_epi16(pairs, _mm512_loadu_si512(x_shared[r] + at / 2));
                sums[r] = _mm512_add_epi32(sums[r], _mm512_madd_epi16(pair_scales, pairs));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i halves = add_halves(sums[r]);
            groups16_block_end<BITS>(block, halves, factors, x_shared[r], x_d[r][b], b, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
    mlx_hybrid::leave_avx512();
}

// dot_rows_q5_k with AVX-512 VBMI: two groups a register (UnpackVbmi's 64 values; the even groups in
// the low half, the odd ones in the high), their two scales by one word permute, the halves added at
// the block's end: 5 instructions a pair of groups where dot_rows_q5_k takes 20. Exact integer sums:
// the AVX2 body's result to the bit.
template <int R>
AVX512_VBMI_FN void dot_rows_q5_k_vbmi(const uint8_t* w, const uint16_t* factors, const int8_t* w_codes,
                                       const int8_t* const* x, const float* const* x_d, const int16_t* const* x_sums,
                                       int blocks, float* const* out) {
    const UnpackVbmi<5> unpack;
    // word lanes 0-15 (the low group of a pair): sc_0's word in the block's codes, lanes 16-31 sc_1's
    const __m512i pair_groups = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                                 0x0002000200020002LL, 0, 0, 0, 0);
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        float d;
        const __m512i codes = _mm512_castsi256_si512(q5_k_block<R>(factors, w_codes, x_sums, x_d, b, mins, d));
        __m512i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int pair = 0; pair < SUPER_BLOCK / 64; pair++) {
            const int at = b * SUPER_BLOCK + pair * 64;
            const __m512i q = unpack(w + at * 5 / 8);
            const __m512i scales =
                _mm512_permutexvar_epi16(_mm512_add_epi16(pair_groups, _mm512_set1_epi16(4 * pair)), codes);
            for (int r = 0; r < R; r++) {
                const __m512i pairs = _mm512_maddubs_epi16(q, _mm512_loadu_si512(x[r] + at));
                sums[r] = _mm512_add_epi32(sums[r], _mm512_madd_epi16(scales, pairs));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i halves = add_halves(sums[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x_d[r][b] * d), _mm256_cvtepi32_ps(halves), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]) + mins[r];
    mlx_hybrid::leave_avx512();
}

// The 32-value types' AVX2 arithmetic for one weight row and one row of x quantized to Q8_0 (with its
// pair sums times the offset, as QuantizedRows holds them) or Q8_1: ggml_vec_dot_q5_0_q8_0's (BITS 5,
// q - 16 times d) and ggml_vec_dot_q4_0_q8_0's (BITS 4, q - 8; the Q4_0 matrices llama.cpp does not
// repack), per block (q - offset) times x's codes in lanes of 4 as integers, each lane times d_w d_x
// into its float lane, the lanes' tree; with WITH_M, ggml_vec_dot_q5_1_q8_1's and
// ggml_vec_dot_q4_1_q8_1's (q d + m: factors d and m a block), q times the codes likewise, and m_w
// times x's s into one float (fused multiply-adds), added to the tree's sum. R rows of x at once (x[r],
// x_pairs[r], x_d[r], x_s[r]; *out[r] gets row r's product), each block unpacked once for them.
template <int BITS, bool WITH_M, int R = 1>
INT8_FN void dot_rows_b32(const uint8_t* w, const uint16_t* factors, const int8_t* const* x,
                          const int16_t* const* x_pairs, const float* const* x_d, const float* const* x_s, int blocks,
                          float* const* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const __m256i q = unpack_run<BITS>(w + b * 4 * BITS);
        const float d_w = _cvtsh_ss(factors[WITH_M ? 2 * b : b]), m_w = WITH_M ? _cvtsh_ss(factors[2 * b + 1]) : 0;
        for (int r = 0; r < R; r++) {
            if constexpr (WITH_M) mins[r] = std::fma(m_w, x_s[r][b], mins[r]);
            __m256i pairs = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(x[r] + b * 32)));
            if constexpr (!WITH_M)
                pairs = _mm256_sub_epi16(pairs, _mm256_loadu_si256((const __m256i*)(x_pairs[r] + b * 16)));
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_w * x_d[r][b]), sums, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float sum = mlx_hybrid::sum_lanes(acc[r]);
        *out[r] = WITH_M ? sum + mins[r] : sum;
    }
}

// IQ4_NL's 16 values (ggml's kvalues_iq4nl), in both halves: a shuffle by the 4-bit index reads them
INT8_FN inline __m256i iq4_nl_values() {
    return _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113, -127, -104, -83,
                            -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}

// MXFP4's 16 values, twice the E2M1 values (ggml's kvalues_mxfp4), likewise
INT8_FN inline __m256i mxfp4_values() {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2,
                            -3, -4, -6, -8, -12);
}

// ggml's E8M0 to float times 1/2 (GGML_E8M0_TO_FP32_HALF): 2^(e - 128), exact (e < 2: subnormal)
inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
}

// The 4-bit types of 32-value blocks that take values from their indices: Q4_0 (q, its -8 taken a
// block), IQ4_NL's and MXFP4's tables (float16 d a block; MXFP4: an E8M0 exponent a block)
enum Nibbles { Q4_0_VALUES, IQ4_NL_VALUES, MXFP4_VALUES };

template <Nibbles KIND>
INT8_FN inline __m256i nibble_values() {
    return KIND == MXFP4_VALUES ? mxfp4_values() : iq4_nl_values();
}

// block b's weight scale: its float16 d, or MXFP4's 2^(e - 128)
template <Nibbles KIND>
INT8_FN inline float block_scale(const void* scales, long b) {
    if constexpr (KIND == MXFP4_VALUES) return e8m0_half(((const uint8_t*)scales)[b]);
    return _cvtsh_ss(((const uint16_t*)scales)[b]);
}

// values given as their magnitudes (taken once for many rows of x) and their signs (v: the signed
// values themselves, or +-1 a byte) times signed codes x, in int16 sums of pairs (llama.cpp's: the
// magnitudes times x with v's sign)
INT8_FN inline __m256i signed_pairs(__m256i magnitudes, __m256i v, __m256i x) {
    return _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(x, v));
}

// the same in int32 lanes of 4
INT8_FN inline __m256i signed_lanes(__m256i magnitudes, __m256i v, __m256i x) {
    return _mm256_madd_epi16(signed_pairs(magnitudes, v, x), _mm256_set1_epi16(1));
}

// A grid block's scales 2 s + 1 as int16, held so that a step's are word `sub` of each half
// (`step_scale`: one shuffle a step). Where a code covers 16 values (IQ2_XS, IQ2_S, IQ1_M) the even
// groups' (a step's first 16 values) are the first half and the odd groups' the second; else both
// halves hold the 8 steps'.
template <int VALUES>
INT8_INLINE __m256i block_scales(const uint8_t* block) {
    __m256i codes;
    if constexpr (VALUES == grid::IQ2_XS || VALUES == grid::IQ2_S) {  // group g's nibble: byte g / 2, bits 4 (g % 2)
        const __m128i bytes = _mm_loadl_epi64((const __m128i*)(block + (VALUES == grid::IQ2_XS ? 66 : 74)));
        const __m128i low = _mm_set1_epi8(15);
        codes = _mm256_setr_m128i(_mm_cvtepu8_epi16(_mm_and_si128(bytes, low)),
                                  _mm_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
    } else if constexpr (VALUES == grid::IQ1_M) {  // group g's: the 3 bits at 3 (g % 4) of the word g / 4 at
        uint64_t words;                             // byte 48, moved to bits 9-11 by a multiply
        memcpy(&words, block + 48, 8);
        const __m256i word_of_group = _mm256_shuffle_epi8(
            _mm256_set1_epi64x((long long)words),
            _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6,
                             7));
        const __m256i moved = _mm256_mullo_epi16(
            word_of_group, _mm256_setr_epi16(512, 8, 512, 8, 512, 8, 512, 8, 64, 1, 64, 1, 64, 1, 64, 1));
        codes = _mm256_and_si256(_mm256_srli_epi16(moved, 9), _mm256_set1_epi16(7));
    } else {
        __m128i steps;  // the 8 steps' codes as int16
        if constexpr (VALUES == grid::IQ2_XXS) {  // the top 4 bits of each step's second word (of 2 from byte 2)
            const __m256i first = _mm256_srli_epi64(_mm256_loadu_si256((const __m256i*)(block + 2)), 60);
            const __m256i last = _mm256_srli_epi64(_mm256_loadu_si256((const __m256i*)(block + 34)), 60);
            const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
            steps = _mm_packus_epi32(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(first, even)),
                                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(last, even)));
        } else if constexpr (VALUES == grid::IQ3_XXS) {  // the top 4 bits of the step's word at byte 66
            const __m256i words = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)(block + 66)), 28);
            steps = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        } else if constexpr (VALUES == grid::IQ3_S) {  // step sub's nibble: byte sub / 2 from 106, bits 4 (sub % 2)
            const __m128i bytes = _mm_cvtsi32_si128((int)grid::load_u32(block + 106));
            const __m128i low = _mm_set1_epi8(15);
            steps = _mm_cvtepu8_epi16(
                _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
        } else {  // IQ1_S: bits 12-14 of the step's word
            static_assert(VALUES == grid::IQ1_S);
            const __m128i words = _mm_loadu_si128((const __m128i*)(block + grid::IQ1_WORDS<VALUES>));
            steps = _mm_and_si128(_mm_srli_epi16(words, 12), _mm_set1_epi16(7));
        }
        codes = _mm256_broadcastsi128_si256(steps);
    }
    return _mm256_or_si256(_mm256_slli_epi16(codes, 1), _mm256_set1_epi16(1));
}
INT8_INLINE __m256i step_scale(__m256i scales, int sub) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * sub)));
}

// ggml_vec_dot_iq2_xxs_q8_K's AVX2 arithmetic and its siblings' (IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) for one
// row of the file's blocks and one row of x quantized to Q8_K (in value order): per block, lane k of 8
// sums values 4k..4k+3 of every 32 (signed grid values times the codes) times their scale 2 s + 1 (IQ2_XS's
// and IQ2_S's: one a 16 values) as integers, then times d_w d_x into its float lane (a fused
// multiply-add); the lanes' tree times 1 / the type's divisor (llama.cpp's 0.125f, 0.25f: exact). R rows
// of x at once (x[r], x_d[r]; *out[r] gets row r's product), each grid row looked up once for them.
template <int VALUES, int R>
INT8_INLINE void dot_rows_grid(const uint8_t* row, const uint8_t* grid_rows, const int8_t* const* x,
                               const float* const* x_d, int blocks, float* const* out) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t* block = row + (long)b * grid::grid_block_bytes(VALUES);
        __m256i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        const __m256i scales = block_scales<VALUES>(block);
#pragma GCC unroll 8
        for (int sub = 0; sub < 8; sub++) {
            const __m256i scale = step_scale(scales, sub);
            // llama.cpp's way: the grid's magnitudes, x's codes negated where the values are
            const grid::GridStep step = grid::grid_step<VALUES>(row, 8 * b + sub, grid_rows);
            const __m256i signs = _mm256_or_si256(step.minus, ones);
            const int at = b * SUPER_BLOCK + sub * BLOCK;
            for (int r = 0; r < R; r++) {
                const __m256i codes = _mm256_loadu_si256((const __m256i*)(x[r] + at));
                sums[r] = _mm256_add_epi32(sums[r],
                                           _mm256_madd_epi16(signed_pairs(step.magnitudes, signs, codes), scale));
            }
        }
        const float d_w = _cvtsh_ss(grid::grid_d(VALUES, block));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_w * x_d[r][b]), _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
    for (int r = 0; r < R; r++)
        *out[r] = mlx_hybrid::sum_lanes(acc[r]) * (1.0f / (float)grid::GRID_DIVISOR[VALUES - grid::GRID_FIRST]);
}

// ggml_vec_dot_iq1_s_q8_K's and ggml_vec_dot_iq1_m_q8_K's AVX2 arithmetic, with dot_rows_grid's lanes and
// arguments. The grid rows are 8 g for g -1, 0 or 1, so x's codes signed by them are the products, summed
// in pairs by one maddubs with ones (signed_pairs of magnitudes 1). The deltas of +-1/8 make a sum of
// their own, times 1/8 at the end: IQ1_M's (a sign a row of 8, so a lane's 4 values share it) as x's
// sums of 4 codes (x_sums) times the signed scale, in lanes likewise; IQ1_S's (a sign a step) as one
// integer a block, its steps' signed scales times x's sums of 16 codes, into a float sum by fused
// multiply-adds.
template <int VALUES, int R, bool GATHER>
INT8_INLINE void dot_rows_iq1(const uint8_t* row, const uint8_t* grid_rows, const int8_t* const* x,
                              const float* const* x_d, const int16_t* const* x_sums, int blocks, float* const* out) {
    constexpr bool M = VALUES == grid::IQ1_M;
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[R], acc_deltas[R];  // IQ1_M's deltas in lanes
    float acc_delta[R];            // IQ1_S's
    for (int r = 0; r < R; r++) acc[r] = acc_deltas[r] = _mm256_setzero_ps(), acc_delta[r] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t* block = row + (long)b * grid::grid_block_bytes(VALUES);
        __m256i sums[R], delta_sums[R];
        for (int r = 0; r < R; r++) sums[r] = delta_sums[r] = _mm256_setzero_si256();
        // IQ1_S's step scales also signed by the step's delta (bit 15 of its word), for the step's two sums
        // of 16 codes
        const __m256i scales = block_scales<VALUES>(block);
        __m256i signed_scales;
        if constexpr (!M) {
            const __m128i signed_steps = _mm_sign_epi16(
                _mm256_castsi256_si128(scales),
                _mm_or_si128(_mm_loadu_si128((const __m128i*)(block + grid::IQ1_WORDS<VALUES>)), _mm_set1_epi16(1)));
            signed_scales = _mm256_setr_m128i(_mm_unpacklo_epi16(signed_steps, signed_steps),
                                              _mm_unpackhi_epi16(signed_steps, signed_steps));
        }
#pragma GCC unroll 8
        for (int sub = 0; sub < 8; sub++) {
            const __m256i rows = grid::iq1_rows<VALUES, GATHER>(block, sub, grid_rows);
            const __m256i scale = step_scale(scales, sub);
            __m256i delta_scales;
            if constexpr (M) {
                // each lane's scale negated where its row's delta is (bit 4 j + 3 of the step's word, moved to
                // the sign bit; the word read with the next, whose bits the shifts drop); x's sums of 4 come as
                // (sum, 0) pairs, so only a dword's low word counts, and it is negated with it
                const __m256i high = _mm256_set1_epi32((int)grid::load_u32(block + grid::IQ1_WORDS<VALUES> + 2 * sub));
                delta_scales = _mm256_sign_epi32(
                    scale, _mm256_or_si256(_mm256_sllv_epi32(high, _mm256_setr_epi32(28, 28, 24, 24, 20, 20, 16, 16)),
                                           _mm256_set1_epi32(1)));
            }
            const int at = b * SUPER_BLOCK + sub * BLOCK;
            for (int r = 0; r < R; r++) {
                const __m256i codes = _mm256_loadu_si256((const __m256i*)(x[r] + at));
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(signed_pairs(ones, rows, codes), scale));
                if constexpr (M)
                    delta_sums[r] = _mm256_add_epi32(
                        delta_sums[r],
                        _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x_sums[r] + at / 2)), delta_scales));
            }
        }
        const float d_w = _cvtsh_ss(grid::grid_d(VALUES, block));
        for (int r = 0; r < R; r++) {
            const float d = d_w * x_d[r][b];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums[r]), acc[r]);
            if constexpr (M)
                acc_deltas[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(delta_sums[r]), acc_deltas[r]);
            else
                acc_delta[r] = std::fma(d, (float)sum_int_lanes(_mm256_madd_epi16(
                                               signed_scales, _mm256_loadu_si256((const __m256i*)(x_sums[r] + 16 * b)))),
                                        acc_delta[r]);
        }
    }
    for (int r = 0; r < R; r++)
        *out[r] = mlx_hybrid::sum_lanes(acc[r]) + 0.125f * (M ? mlx_hybrid::sum_lanes(acc_deltas[r]) : acc_delta[r]);
}

// dot_rows_grid's arithmetic with AVX-512's byte masks: x's codes negated by one masked subtraction
// where the step's sign bits (step_sign_bits, a word made by scalar instructions) are set, in place of
// masks built in vector registers and a sign instruction (the same bits: either way -x where a value
// is negative, x elsewhere). A body of its own: dot_rows_grid, an AVX2 function, cannot take AVX-512's
// instructions. On an Intel Xeon (Emerald Rapids), IQ2_XXS's product of 3584 x 1024 on one thread
// 349 -> 282 us through MLX (gguf_types.py --kernels --queued), 304 -> 240 in a loop outside it.
template <int VALUES, int R, bool GATHER>
INT8_WIDE_INLINE void dot_rows_grid_masked(const uint8_t* row, const uint8_t* grid_rows, const int8_t* const* x,
                                           const float* const* x_d, int blocks, float* const* out) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        const uint8_t* block = row + (long)b * grid::grid_block_bytes(VALUES);
        const __m256i scales = block_scales<VALUES>(block);
#pragma GCC unroll 8
        for (int sub = 0; sub < 8; sub++) {
            const __m256i scale = step_scale(scales, sub);
            const __m256i magnitudes = grid::step_magnitudes<VALUES, GATHER>(block, sub, grid_rows);
            const __mmask32 minus = _cvtu32_mask32(grid::step_sign_bits<VALUES>(block, sub));
            const int at = b * SUPER_BLOCK + sub * BLOCK;
            for (int r = 0; r < R; r++) {
                const __m256i codes = _mm256_loadu_si256((const __m256i*)(x[r] + at));
                const __m256i signed_codes = _mm256_mask_sub_epi8(codes, minus, _mm256_setzero_si256(), codes);
                sums[r] = _mm256_add_epi32(sums[r],
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, signed_codes), scale));
            }
        }
        const float d_w = _cvtsh_ss(grid::grid_d(VALUES, block));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_w * x_d[r][b]), _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
    for (int r = 0; r < R; r++)
        *out[r] = mlx_hybrid::sum_lanes(acc[r]) * (1.0f / (float)grid::GRID_DIVISOR[VALUES - grid::GRID_FIRST]);
}

// A grid type's product on the CPU it runs on. With AVX-512: the IQ1 types' AVX2 body compiled for
// AVX-512, whose twice as many vector registers spare their spills (on an Intel Xeon, Emerald Rapids,
// 15-18% faster), the others' masked body (dot_rows_grid_masked); and on an Intel CPU the grid rows
// read by gathers (there the IQ2 and IQ3_XXS products 24-42% faster, the IQ1 ones a few percent).
// Elsewhere a load each: on an AMD EPYC (Zen 4) the gathers took 45% of IQ2_S's samples, and the
// products of 3584 x 1024 on one thread without them were 6-20% faster (IQ2_XS 531 -> 426 us, IQ2_XXS
// 435 -> 372; IQ2_S 3% slower); with AVX2 alone they were slower there too.
template <int VALUES, int R>
INT8_FN void dot_rows_grid_avx2(const uint8_t* row, const uint8_t* grid_rows, const int8_t* const* x,
                                const float* const* x_d, const int16_t* const* x_sums, int blocks, float* const* out) {
    if constexpr (VALUES == grid::IQ1_S || VALUES == grid::IQ1_M)
        dot_rows_iq1<VALUES, R, false>(row, grid_rows, x, x_d, x_sums, blocks, out);
    else
        dot_rows_grid<VALUES, R>(row, grid_rows, x, x_d, blocks, out);
}
template <int VALUES, int R, bool GATHER>
INT8_WIDE_FN void dot_rows_grid_wide(const uint8_t* row, const uint8_t* grid_rows, const int8_t* const* x,
                                     const float* const* x_d, const int16_t* const* x_sums, int blocks,
                                     float* const* out) {
    if constexpr (VALUES == grid::IQ1_S || VALUES == grid::IQ1_M)
        dot_rows_iq1<VALUES, R, GATHER>(row, grid_rows, x, x_d, x_sums, blocks, out);
    else
        dot_rows_grid_masked<VALUES, R, GATHER>(row, grid_rows, x, x_d, blocks, out);
    mlx_hybrid::leave_avx512();
}

// TQ2_0's step `sub` of a block of 2-bit values (MLX's packing: byte m of 128 values holds 4m..4m+3),
// as its lanes sum them: lane l of step s (of 4 a 128) holds value 32 r + 4 l + s at byte r (each lane
// the values 4l..4l+3 of every 32, as llama.cpp's lanes; x's codes quantized in this order). Value s of
// bytes 8r + l: the shifted bytes' dwords 0 2 4 6 | 1 3 5 7, then each half's 4 x 4 bytes transposed.
INT8_FN inline __m256i tq2_step(const uint8_t* block, int sub) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(block + 32 * (sub / 4)));
    const __m256i values = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * (sub % 4)), _mm256_set1_epi8(3));
    const __m256i dwords = _mm256_permutevar8x32_epi32(values, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5,
                                               9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(dwords, transpose);
}

// ggml_vec_dot_tq1_0_q8_K's and ggml_vec_dot_tq2_0_q8_K's AVX2 arithmetic for one weight row (TQ1_0: the
// file's blocks, each decoded whole by gguf_grid.h's ternary_block_digits; TQ2_0: 2-bit values packed, d a
// block, read as tq2_step lays them out) and one row of x quantized to Q8_K (in value order, TQ2_0's in
// tq2_step's; its sums of 16 codes in value order): per block, lane k of 8 sums values 4k..4k+3 of every 32
// (q, 0 to 2, times the codes) less the codes 32k..32k+31 (llama.cpp's -1 taken by the sums of 16, as its
// 16-bit lanes take them), then times d_w d_x into its float lane (a fused multiply-add); the lanes' tree. R
// rows of x at once (x[r], x_d[r], x_sums[r]; *out[r] gets row r's).
template <bool TQ1, int R = 1>
INT8_FN void dot_rows_ternary(const uint8_t* w, const uint16_t* factors, const int8_t* const* x,
                              const float* const* x_d, const int16_t* const* x_sums, int blocks, float* const* out) {
    constexpr int BLOCK_BYTES = TQ1 ? grid::grid_block_bytes(grid::TQ1_0) : SUPER_BLOCK / 4;
    const __m256i one_word = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t* block = w + (long)b * BLOCK_BYTES;
        __m256i sums[R], digits[8];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        if constexpr (TQ1) grid::ternary_block_digits(block, digits);
        for (int sub = 0; sub < 8; sub++) {
            const __m256i q = TQ1 ? digits[sub] : tq2_step(block, sub);
            for (int r = 0; r < R; r++) {
                const __m256i codes = _mm256_loadu_si256((const __m256i*)(x[r] + b * SUPER_BLOCK + sub * BLOCK));
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, codes), one_word));
            }
        }
        const float d_w = _cvtsh_ss(TQ1 ? grid::grid_d(grid::TQ1_0, block) : factors[b]);
        for (int r = 0; r < R; r++) {
            const __m256i minus = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x_sums[r] + 16 * b)), one_word);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[r], minus)),
                                     _mm256_set1_ps(x_d[r][b] * d_w), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
}

// ggml_vec_dot_iq4_nl_q8_0's and ggml_vec_dot_mxfp4_q8_0's AVX2 arithmetic (the matrices llama.cpp
// does not repack) for one weight row (4-bit indices into IQ4_NL's or MXFP4's values, a scale a block)
// and one row of x quantized to Q8_0: per block, values times codes in lanes of 4 as integers, each
// lane times d_x d_w into its float lane, even and odd blocks apart; the two added, their lanes' tree;
// an odd count's last block's sum times d_x d_w added after (as llama.cpp's build: IQ4_NL's a product
// then a sum, MXFP4's fused). R rows of x at once (x[r], x_d[r]; *out[r] gets row r's product).
template <Nibbles KIND, int R = 1>
INT8_FN void dot_rows_table(const uint8_t* w, const void* w_scales, const int8_t* const* x, const float* const* x_d,
                            int blocks, float* const* out) {
    const __m256i values = nibble_values<KIND>();
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int pairs = blocks / 2 * 2;
    for (int b = 0; b < pairs; b++) {
        const __m256i v = _mm256_shuffle_epi8(values, unpack_4bit_run(w + b * 16));
        const __m256i magnitudes = _mm256_sign_epi8(v, v);
        const float d_w = block_scale<KIND>(w_scales, b);
        for (int r = 0; r < R; r++) {
            const __m256i codes = _mm256_loadu_si256((const __m256i*)(x[r] + b * 32));
            const __m256 sums = _mm256_cvtepi32_ps(signed_lanes(magnitudes, v, codes));
            acc[r][b % 2] = _mm256_fmadd_ps(_mm256_set1_ps(x_d[r][b] * d_w), sums, acc[r][b % 2]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(_mm256_add_ps(acc[r][0], acc[r][1]));
    if (pairs == blocks) return;
    const __m256i v = _mm256_shuffle_epi8(values, unpack_4bit_run(w + pairs * 16));
    const __m256i magnitudes = _mm256_sign_epi8(v, v);
    for (int r = 0; r < R; r++) {
        const __m256i codes = _mm256_loadu_si256((const __m256i*)(x[r] + pairs * 32));
        const int32_t total = sum_int_lanes(signed_lanes(magnitudes, v, codes));
        const float d = x_d[r][pairs] * block_scale<KIND>(w_scales, pairs);
        *out[r] = KIND == MXFP4_VALUES ? std::fma(d, (float)total, *out[r]) : *out[r] + d * (float)total;
    }
}

// ggml_vec_dot_iq4_xs_q8_K's AVX2 arithmetic for one weight row (4-bit indices into IQ4_NL's values,
// d a block, a signed ls_j - 32 a group of 32) and one row of x quantized to Q8_K (in value order):
// per block, the values times the codes in lanes of 4, times the group's ls_j - 32, summed as integers,
// then each lane times d_w d_x into its float lane; the lanes' tree. R rows of x at once (x[r], x_d[r];
// *out[r] gets row r's product), each run's values looked up once for them.
template <int R = 1>
INT8_FN void dot_rows_iq4_xs(const uint8_t* w, const uint16_t* w_d, const int8_t* w_codes, const int8_t* const* x,
                             const float* const* x_d, int blocks, float* const* out) {
    const __m256i values = iq4_nl_values();
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
        for (int g = 0; g < SUPER_BLOCK / BLOCK; g++) {
            const int at = b * SUPER_BLOCK + g * BLOCK;
            const __m256i v = _mm256_shuffle_epi8(values, unpack_4bit_run(w + at / 2));
            const __m256i magnitudes = _mm256_sign_epi8(v, v);
            const __m256i scale = _mm256_set1_epi16(w_codes[b * 8 + g]);
            for (int r = 0; r < R; r++) {
                const __m256i pairs = signed_pairs(magnitudes, v, _mm256_loadu_si256((const __m256i*)(x[r] + at)));
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, scale));
            }
        }
        const float d_w = _cvtsh_ss(w_d[b]);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_w * x_d[r][b]), _mm256_cvtepi32_ps(sums[r]), acc[r]);
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
}

// dot_rows_iq4_xs with AVX-512 VBMI: two groups a register (UnpackVbmi's 64 indices, looked up by one
// byte shuffle; the even groups in the low half, the odd ones in the high), x's codes negated under the
// values' sign mask, the groups' two scales by one word permute, the halves added at the block's end.
// Exact integer sums: the AVX2 body's result to the bit.
template <int R>
AVX512_VBMI_FN void dot_rows_iq4_xs_vbmi(const uint8_t* w, const uint16_t* w_d, const int8_t* w_codes,
                                         const int8_t* const* x, const float* const* x_d, int blocks,
                                         float* const* out) {
    const UnpackVbmi<4> unpack;
    const __m512i values = _mm512_broadcast_i64x4(iq4_nl_values());
    // word lanes 0-15 (the low group of a pair): the first group's scale, lanes 16-31 the second's
    const __m512i pair_groups = _mm512_set_epi64(0x0001000100010001LL, 0x0001000100010001LL, 0x0001000100010001LL,
                                                 0x0001000100010001LL, 0, 0, 0, 0);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m512i scales =
            _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(w_codes + b * 8))));
        __m512i sums[R];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int pair = 0; pair < SUPER_BLOCK / 64; pair++) {
            const int at = b * SUPER_BLOCK + pair * 64;
            const __m512i v = _mm512_shuffle_epi8(values, unpack(w + at / 2));
            const __m512i magnitudes = _mm512_abs_epi8(v);
            const __mmask64 negative = _mm512_movepi8_mask(v);
            const __m512i pair_scales =
                _mm512_permutexvar_epi16(_mm512_add_epi16(pair_groups, _mm512_set1_epi16(2 * pair)), scales);
            for (int r = 0; r < R; r++) {
                const __m512i codes = _mm512_loadu_si512(x[r] + at);
                const __m512i signed_codes = _mm512_mask_sub_epi8(codes, negative, _mm512_setzero_si512(), codes);
                const __m512i pairs = _mm512_maddubs_epi16(magnitudes, signed_codes);
                sums[r] = _mm512_add_epi32(sums[r], _mm512_madd_epi16(pairs, pair_scales));
            }
        }
        const float d_w = _cvtsh_ss(w_d[b]);
        for (int r = 0; r < R; r++) {
            const __m256i halves = add_halves(sums[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_w * x_d[r][b]), _mm256_cvtepi32_ps(halves), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
    mlx_hybrid::leave_avx512();
}

// The float16 d of 8 rows (`row_factors` apart) for blocks b..b+7: out[j] holds block b + j's, row r
// in lane r (an 8 x 8 transpose of the rows' loads).
INT8_FN inline void row_scales8(const uint16_t* w_d, long row_factors, int b, __m256 (&out)[8]) {
    __m128i v[8], t[8], u[8];
    for (int r = 0; r < 8; r++) v[r] = _mm_loadu_si128((const __m128i*)(w_d + r * row_factors + b));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            u[4 * i + 2 * h] = _mm_unpacklo_epi32(t[4 * i + h], t[4 * i + 2 + h]);
            u[4 * i + 2 * h + 1] = _mm_unpackhi_epi32(t[4 * i + h], t[4 * i + 2 + h]);
        }
    for (int j = 0; j < 4; j++) {
        out[2 * j] = _mm256_cvtph_ps(_mm_unpacklo_epi64(u[j], u[4 + j]));
        out[2 * j + 1] = _mm256_cvtph_ps(_mm_unpackhi_epi64(u[j], u[4 + j]));
    }
}

// MXFP4's scales 2^(e - 128) of 8 rows (`row_factors` apart) for blocks b..b+7, as row_scales8 lays
// out d: the rows' 8 exponent bytes each transposed, then each block's 8 made floats at once as
// e8m0_half makes one (the same bits), where each had been made alone and stored for a load.
INT8_FN inline void exponent_scales8(const uint8_t* w_e, long row_factors, int b, __m256 (&out)[8]) {
    __m128i v[8], pairs[4], quads[4], blocks[4];
    for (int r = 0; r < 8; r++) v[r] = _mm_loadl_epi64((const __m128i*)(w_e + r * row_factors + b));
    for (int i = 0; i < 4; i++) pairs[i] = _mm_unpacklo_epi8(v[2 * i], v[2 * i + 1]);  // rows 2i, 2i+1
    for (int h = 0; h < 2; h++) {  // rows 4h to 4h+3: blocks 0-3 (quads[h]), 4-7 (quads[2 + h])
        quads[h] = _mm_unpacklo_epi16(pairs[2 * h], pairs[2 * h + 1]);
        quads[2 + h] = _mm_unpackhi_epi16(pairs[2 * h], pairs[2 * h + 1]);
    }
    for (int i = 0; i < 2; i++) {  // blocks 4i, 4i+1 (8 rows each), then 4i+2, 4i+3
        blocks[2 * i] = _mm_unpacklo_epi32(quads[2 * i], quads[2 * i + 1]);
        blocks[2 * i + 1] = _mm_unpackhi_epi32(quads[2 * i], quads[2 * i + 1]);
    }
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2);
    for (int j = 0; j < 8; j++) {
        const __m128i bytes = j % 2 ? _mm_unpackhi_epi64(blocks[j / 2], blocks[j / 2]) : blocks[j / 2];
        const __m256i e = _mm256_cvtepu8_epi32(bytes);
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
        const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        out[j] = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(two, e)));
    }
}

// A weight row's values of two blocks as dot_rows8_b32 multiplies them: a byte's low nibbles (the
// blocks' even values), then its high ones (odd); IQ4_NL's and MXFP4's looked up in their table, with
// their magnitudes (signed_pairs')
struct NibbleRow {
    __m256i even, odd, even_magnitudes, odd_magnitudes;
};

// the 32 bytes at p as a NibbleRow
template <Nibbles KIND>
INT8_FN inline NibbleRow nibble_row(const uint8_t* p) {
    const __m256i low = _mm256_set1_epi8(0x0F), bytes = _mm256_loadu_si256((const __m256i*)p);
    const __m256i even = _mm256_and_si256(bytes, low), odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    if constexpr (KIND == Q4_0_VALUES) return {even, odd, even, odd};
    const __m256i values = nibble_values<KIND>();
    const __m256i even_values = _mm256_shuffle_epi8(values, even), odd_values = _mm256_shuffle_epi8(values, odd);
    return {even_values, odd_values, _mm256_sign_epi8(even_values, even_values),
            _mm256_sign_epi8(odd_values, odd_values)};
}

// A row's values of two blocks times x's codes split as dot_rows8_b32 takes them: int32 lanes, the low
// half's summing to the first block's products, the high half's to the second's.
template <Nibbles KIND>
INT8_FN inline __m256i two_blocks(const NibbleRow& v, __m256i x_even, __m256i x_odd) {
    if constexpr (KIND == Q4_0_VALUES)  // q from 0 to 15: the pairs' sums fit 16 bits (the -8 is taken a block)
        return _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(v.even, x_even), _mm256_maddubs_epi16(v.odd, x_odd)),
            _mm256_set1_epi16(1));
    return _mm256_add_epi32(signed_lanes(v.even_magnitudes, v.even, x_even),
                            signed_lanes(v.odd_magnitudes, v.odd, x_odd));
}

// The 8 rows' factors (MXFP4: scales) of blocks b and b + 1 into row_d[j % 8] (row n in lane n): 8
// blocks' at a time where 8 are left, else each block's alone
template <Nibbles KIND>
INT8_INLINE void rows8_block_scales(const void* w_scales, long row_factors, int b, bool pair, int blocks,
                                    __m256 (&row_d)[8]) {
    const uint16_t* w_d = (const uint16_t*)w_scales;
    if (b % 8 == 0 && b + 8 <= blocks) {
        if constexpr (KIND == MXFP4_VALUES)
            exponent_scales8((const uint8_t*)w_scales, row_factors, b, row_d);
        else
            row_scales8(w_d, row_factors, b, row_d);
    }
    for (int j = b; j < b + 1 + pair; j++) {
        if (j < blocks / 8 * 8) continue;  // the last blocks short of 8: each scale alone
        if (KIND == MXFP4_VALUES) {
            float scales[8];
            for (int n = 0; n < 8; n++) scales[n] = block_scale<KIND>(w_scales, n * row_factors + j);
            row_d[j % 8] = _mm256_loadu_ps(scales);
        } else {
            row_d[j % 8] = _mm256_cvtph_ps(_mm_setr_epi16(
                w_d[j], w_d[row_factors + j], w_d[2 * row_factors + j], w_d[3 * row_factors + j],
                w_d[4 * row_factors + j], w_d[5 * row_factors + j], w_d[6 * row_factors + j],
                w_d[7 * row_factors + j]));
        }
    }
}

// Blocks b and b + 1 of each row of x, split: their even codes, then their odd ones (a last block alone:
// its even codes, then its odd ones, in the low halves)
template <int R>
INT8_INLINE void split_codes(const int8_t* const* x, int b, bool pair, __m256i (&x_even)[R], __m256i (&x_odd)[R]) {
    for (int r = 0; r < R; r++) {
        if (pair) {
            x_even[r] = _mm256_loadu_si256((const __m256i*)(x[r] + b * 32));
            x_odd[r] = _mm256_loadu_si256((const __m256i*)(x[r] + b * 32 + 32));
        } else {
            x_even[r] = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(x[r] + b * 32)));
            x_odd[r] = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(x[r] + b * 32 + 16)));
        }
    }
}

// Weight row n's 32 bytes of blocks b and b + 1; a last block alone copied into `last` with zeros after
// it (read without passing the row's end)
template <bool INTERLEAVED>
INT8_INLINE const uint8_t* rows8_bytes(const uint8_t* w, long row_bytes, int b, int n, bool pair,
                                       uint8_t (&last)[32]) {
    const uint8_t* p = INTERLEAVED ? w + (long)b / 2 * 256 + n * 32 : w + n * row_bytes + b * 16;
    if (pair) return p;
    std::memset(last, 0, 32);
    std::memcpy(last, p, 16);
    return last;
}

// Each row of x's lanes of the 8 weight rows (lanes[r][n]: int32 lanes, the low half's summing to block
// b's products, the high half's to block b + 1's) into its accumulator: each block's 8 row sums as
// integers (pairwise sums within halves, then the halves), less `offset` times x's block sum, times
// d_w d_x
template <int R>
INT8_INLINE void add_rows8_sums(const __m256i (&lanes)[R][8], const int16_t* const* x_sums, int offset,
                                const float* const* x_d, const __m256 (&row_d)[8], int b, bool pair,
                                __m256 (&acc)[R]) {
    for (int r = 0; r < R; r++) {
        const __m256i first = _mm256_hadd_epi32(_mm256_hadd_epi32(lanes[r][0], lanes[r][1]),
                                                _mm256_hadd_epi32(lanes[r][2], lanes[r][3]));
        const __m256i last = _mm256_hadd_epi32(_mm256_hadd_epi32(lanes[r][4], lanes[r][5]),
                                               _mm256_hadd_epi32(lanes[r][6], lanes[r][7]));
        for (int j = 0; j < 1 + pair; j++) {
            __m256i sums = _mm256_permute2x128_si256(first, last, j ? 0x31 : 0x20);
            if (offset) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(offset * x_sums[r][b + j]));
            const __m256 scales = _mm256_mul_ps(row_d[(b + j) % 8], _mm256_set1_ps(x_d[r][b + j]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scales, acc[r]);
        }
    }
}

// ggml_gemv_q4_0_8x8_q8_0's, ggml_gemv_iq4_nl_8x8_q8_0's and ggml_gemv_mxfp4_8x8_q8_0's arithmetic
// (the Q4_0, IQ4_NL and MXFP4 matrices of rows in eights llama.cpp's x86 build repacks): 8 weight rows
// at a time (each `row_bytes` and `row_factors` apart), per block each row's values (Q4_0: q - 8;
// IQ4_NL, MXFP4: their table's) times x's codes as one exact integer, times d_w d_x into that row's
// float accumulator. A block's sum is one integer, so its terms come in any order: x's codes are taken
// split, two blocks at a time (the blocks' even values, then their odd ones: a byte's low nibbles, then
// its high ones; a last odd block alone), with each block's sum of codes (Q4_0's -8). R rows of x at
// once (x[r], x_sums[r], x_d[r]), the weight rows' values taken once for them; out[r][0..7] gets row r's.
// INTERLEAVED: Q4_0's rows held interleaved (`interleave_eights`: each pair of blocks of the 8 in turn).
template <Nibbles KIND, int R = 1, bool INTERLEAVED = false>
INT8_FN void dot_rows8_b32(const uint8_t* w, long row_bytes, const void* w_scales, long row_factors,
                           const int8_t* const* x, const int16_t* const* x_sums, const float* const* x_d, int blocks,
                           float* const* out) {
    __m256 acc[R], row_d[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b += 2) {
        const bool pair = b + 1 < blocks;
        rows8_block_scales<KIND>(w_scales, row_factors, b, pair, blocks, row_d);
        __m256i x_even[R], x_odd[R], lanes[R][8];
        split_codes<R>(x, b, pair, x_even, x_odd);
        for (int n = 0; n < 8; n++) {
            uint8_t last[32];
            const NibbleRow values = nibble_row<KIND>(rows8_bytes<INTERLEAVED>(w, row_bytes, b, n, pair, last));
            for (int r = 0; r < R; r++) lanes[r][n] = two_blocks<KIND>(values, x_even[r], x_odd[r]);
        }
        add_rows8_sums<R>(lanes, x_sums, KIND == Q4_0_VALUES ? 8 : 0, x_d, row_d, b, pair, acc);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], acc[r]);
}

// dot_rows8_b32 with AVX-512 VNNI: each lane's four byte products summed by one `vpdpbusd`, unsigned
// values times x's signed codes, where dot_rows8_b32 takes three or four instructions and a sign for
// IQ4_NL's and MXFP4's signed values. Those values are taken plus 128 (unsigned), their block's sums
// then less 128 times x's block sum (Q4_0's less 8 times it, as before). A block's sum is the same
// integer, so the bits are dot_rows8_b32's.
template <Nibbles KIND, int R = 1, bool INTERLEAVED = false>
AVX512_VNNI_FN void dot_rows8_b32_vnni(const uint8_t* w, long row_bytes, const void* w_scales, long row_factors,
                                       const int8_t* const* x, const int16_t* const* x_sums, const float* const* x_d,
                                       int blocks, float* const* out) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i values = _mm256_xor_si256(nibble_values<KIND>(), _mm256_set1_epi8((char)0x80));  // (v + 128)
    __m256 acc[R], row_d[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b += 2) {
        const bool pair = b + 1 < blocks;
        rows8_block_scales<KIND>(w_scales, row_factors, b, pair, blocks, row_d);
        __m256i x_even[R], x_odd[R], lanes[R][8];
        split_codes<R>(x, b, pair, x_even, x_odd);
        for (int n = 0; n < 8; n++) {
            uint8_t last[32];
            const __m256i bytes =
                _mm256_loadu_si256((const __m256i*)rows8_bytes<INTERLEAVED>(w, row_bytes, b, n, pair, last));
            __m256i even = _mm256_and_si256(bytes, low), odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            if constexpr (KIND != Q4_0_VALUES)
                even = _mm256_shuffle_epi8(values, even), odd = _mm256_shuffle_epi8(values, odd);
            for (int r = 0; r < R; r++)
                lanes[r][n] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), even, x_even[r]), odd,
                                                  x_odd[r]);
        }
        add_rows8_sums<R>(lanes, x_sums, KIND == Q4_0_VALUES ? 8 : 128, x_d, row_d, b, pair, acc);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], acc[r]);
    mlx_hybrid::leave_avx512();
}

// ggml_vec_dot_q8_0_q8_0's AVX2 arithmetic for one weight row (codes q + 128, float16 d's) and R
// quantized rows of x (x[r], x_d[r]; *out[r] gets row r's product), each block's codes and their
// magnitudes (signed_lanes' |v|) taken once for them.
template <int R = 1>
INT8_FN void dot_rows_q8_0(const uint8_t* w, const uint16_t* w_d, const int8_t* const* x, const float* const* x_d,
                           int blocks, float* const* out) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int8_t* rows[R];  // (held here: read through x in the loop, one row decoded measurably slower)
    const float* row_d[R];
    for (int r = 0; r < R; r++) rows[r] = x[r], row_d[r] = x_d[r];
    for (int b = 0; b < blocks; b++) {
        const __m256i qw = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + b * BLOCK)), flip);  // q - 128
        const __m256i magnitudes = _mm256_sign_epi8(qw, qw);
        const float d_w = _cvtsh_ss(w_d[b]);
        for (int r = 0; r < R; r++) {
            const __m256i codes = _mm256_loadu_si256((const __m256i*)(rows[r] + b * BLOCK));
            const __m256i lanes =
                _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(codes, qw)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d_w * row_d[r][b]), _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) *out[r] = mlx_hybrid::sum_lanes(acc[r]);
}

template <bool BF16>
INT8_FN inline float half_value(uint16_t bits) {
    if constexpr (BF16) {
        const uint32_t u = (uint32_t)bits << 16;
        float v;
        std::memcpy(&v, &u, 4);
        return v;
    }
    return _cvtsh_ss(bits);
}

// A step's 32 16-bit values at p as float32, 8 a register: F16's in order (values 8j..8j+7 in
// register j); BF16's as two loads of 16 split by shifts and masks, the even values of each 16, then
// their odd ones (bf16_step_place), and x's rounded values stored in that order to meet them
template <bool BF16>
INT8_FN inline void step_values(const uint16_t* p, __m256 (&out)[4]) {
    if constexpr (BF16) {
        const __m256i high = _mm256_set1_epi32((int)0xffff0000);
        for (int h = 0; h < 2; h++) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i*)(p + 16 * h));
            out[2 * h] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
            out[2 * h + 1] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
        }
    } else {
        for (int j = 0; j < 4; j++) out[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8 * j)));
    }
}

// BF16's accumulators of step_values' order back to llama.cpp's: register 2h (the even values of
// values 16h..16h+15) lane l is accumulator 2h + l / 4's lane 2 (l mod 4), register 2h + 1 its lane 2
// (l mod 4) + 1
INT8_FN inline void bf16_accumulators_in_order(__m256 (&acc)[4]) {
    for (int h = 0; h < 2; h++) {
        const __m256 low = _mm256_unpacklo_ps(acc[2 * h], acc[2 * h + 1]);
        const __m256 high = _mm256_unpackhi_ps(acc[2 * h], acc[2 * h + 1]);
        acc[2 * h] = _mm256_permute2f128_ps(low, high, 0x20), acc[2 * h + 1] = _mm256_permute2f128_ps(low, high, 0x31);
    }
}

// An F16 product's 4 accumulators summed as llama.cpp sums them first: (0 + 2) + (1 + 3)
INT8_FN inline __m256 f16_accumulators_sum(const __m256 (&acc)[4]) {
    return _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
}

// A row's product from its 4 accumulators in llama.cpp's order: (0 + 2) + (1 + 3), the halves, the 4
// lanes F16 (0 + 1) + (2 + 3) (two hadds), BF16 (0 + 2) + (1 + 3); then the products past the steps
// (float32, exact: w's and x's values from `steps` to K) added in double, rounded to float32
template <bool BF16>
INT8_FN inline float half_lanes_total(const __m256 (&acc)[4], const uint16_t* w, const float* x, int steps, int K) {
    const __m256 sum = f16_accumulators_sum(acc);
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    if constexpr (BF16) {
        four = _mm_add_ps(four, _mm_movehl_ps(four, four));
        four = _mm_add_ss(four, _mm_movehdup_ps(four));
    } else {
        four = _mm_hadd_ps(four, four);
        four = _mm_hadd_ps(four, four);
    }
    double total = _mm_cvtss_f32(four);
    for (int i = steps; i < K; i++) total += (double)(half_value<BF16>(w[i]) * x[i]);
    return (float)total;
}

// half_lanes_total's F16 sums after f16_accumulators_sum for 8 products at once, where K has no values
// past the steps: each level of its tree (the halves, then lanes 0 + 1 and 2 + 3, then the two) is one
// add for all 8, their lanes brought together by shuffles, rather than a product's own horizontal adds
// (each sum the same two values: the same bits). The first `columns` of sums are products', the rest
// made zeros here; out gets those products' totals.
INT8_FN inline void f16_totals(__m256 (&sums)[8], int columns, float* out) {
    for (int i = columns; i < 8; i++) sums[i] = _mm256_setzero_ps();
    __m256 four[4], pairs[2];
    for (int i = 0; i < 4; i++)  // [product 2i's 4 | 2i+1's]
        four[i] = _mm256_add_ps(_mm256_permute2f128_ps(sums[2 * i], sums[2 * i + 1], 0x20),
                                _mm256_permute2f128_ps(sums[2 * i], sums[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)  // lanes 0-3 [4i's (0 + 1, 2 + 3), 4i+2's], lanes 4-7 4i+1's and 4i+3's
        pairs[i] = _mm256_add_ps(_mm256_shuffle_ps(four[2 * i], four[2 * i + 1], 0x88),
                                 _mm256_shuffle_ps(four[2 * i], four[2 * i + 1], 0xdd));
    // products 0, 2, 4, 6, then 1, 3, 5, 7
    const __m256 all = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], 0x88),
                                     _mm256_shuffle_ps(pairs[0], pairs[1], 0xdd));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, all);
    for (int i = 0; i < columns; i++) out[i] = lanes[i % 2 * 4 + i / 2];
}

// Accumulators of R rows of x against up to 8 weight rows, per (row, weight row) 4 registers of 8
// lanes in llama.cpp's order (half_lanes_total's)
template <int R>
using HalfAccumulators = __m256[R][8][4];

// ggml_vec_dot_f16's AVX2 arithmetic (BF16: ggml_vec_dot_bf16's, as llama.cpp's build compiles it, its
// products and sums fused) for C weight rows of 16-bit values (each K values after the one before) and
// R rows of x rounded to 16 bits (round_row_to_16_bits; x[r]; acc[r][c0 + c] gets row r's accumulators
// against weight row c): per 32 values, 4 accumulators of 8 lanes each take 8 products by fused
// multiply-adds (every product exact: 11 or 8 bits a factor; each lane the same values in the same
// order, in step_values' order). Two weight rows put more streams of loads in flight, for a decode
// step's row of x, which waits on them.
template <bool BF16, int R, int C>
INT8_FN void dot_rows_half(const uint16_t* w, const float* const* x, int K, __m256 (*acc_out)[8][4], int c0) {
    __m256 acc[R][C][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int j = 0; j < 4; j++) acc[r][c][j] = _mm256_setzero_ps();
    const int steps = K / 32 * 32;
    for (int i = 0; i < steps; i += 32) {
        __m256 values[C][4];
        for (int c = 0; c < C; c++) {
            // this step's line 4 KiB on (2 rows at the 0.8B shape's K), one a step as it is read: the
            // whole row's at once, as the 8-bit kernels take theirs, stalls on full fill buffers
            _mm_prefetch((const char*)(w + (long)c * K + i) + 4096, _MM_HINT_T0);
            step_values<BF16>(w + (long)c * K + i, values[c]);
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                for (int j = 0; j < 4; j++)
                    acc[r][c][j] = _mm256_fmadd_ps(values[c][j], _mm256_loadu_ps(x[r] + i + 8 * j), acc[r][c][j]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            if constexpr (BF16) bf16_accumulators_in_order(acc[r][c]);
            for (int j = 0; j < 4; j++) acc_out[r][c0 + c][j] = acc[r][c][j];
        }
}

// dot_rows_half with AVX-512 for C weight rows: two accumulators a 512-bit register (F16: values 0-15
// and 16-31 of a step in order; BF16: the step's even values and its odd ones, x's in that order), each
// load of x serving the C rows; each lane's operations the AVX2 body's, so the same bits.
template <bool BF16, int R, int C>
INT8_WIDE_FN inline void dot_rows_half_wide(const uint16_t* w, const float* const* x, int K, __m512 (&acc)[R][C][2]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
    const int steps = K / 32 * 32;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    for (int i = 0; i < steps; i += 32) {
        __m512 values[C][2];
        for (int c = 0; c < C; c++) {
            const uint16_t* p = w + (long)c * K + i;
            _mm_prefetch((const char*)p + 4096, _MM_HINT_T0);  // (as dot_rows_half's)
            if constexpr (BF16) {
                const __m512i pairs = _mm512_loadu_si512(p);
                values[c][0] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                values[c][1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
            } else {
                values[c][0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
                values[c][1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 16)));
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                const __m512 xs = _mm512_loadu_ps(x[r] + i + 16 * h);
                for (int c = 0; c < C; c++) acc[r][c][h] = _mm512_fmadd_ps(values[c][h], xs, acc[r][c][h]);
            }
    }
}

// dot_rows_half_wide's products of weight rows c to c + C - 1: F16's of whole steps (in_registers) summed
// to sums[r][c] as f16_accumulators_sum sums them; the others' accumulators to acc_out in the AVX2 body's order
template <bool BF16, int R, int C>
INT8_WIDE_FN inline void half_wide_columns(const uint16_t* w, const float* const* x, int K, int c, bool in_registers,
                                           __m256 (&sums)[R][8], __m256 (&acc_out)[R][8][4]) {
    __m512 acc[R][C][2];
    dot_rows_half_wide<BF16, R, C>(w + (long)c * K, x, K, acc);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            const __m512(&a)[2] = acc[r][j];
            if (in_registers) {  // [(0 + 2) | (1 + 3)], then its halves: f16_accumulators_sum's
                const __m512 pairs = _mm512_add_ps(a[0], a[1]);
                sums[r][c + j] = _mm256_add_ps(_mm512_castps512_ps256(pairs), _mm512_extractf32x8_ps(pairs, 1));
                continue;
            }
            __m256(&halves)[4] = acc_out[r][c + j];
            if constexpr (BF16) {  // as step_values' registers: even and odd values of 0-15, then of 16-31
                halves[0] = _mm512_castps512_ps256(a[0]), halves[1] = _mm512_castps512_ps256(a[1]);
                halves[2] = _mm512_extractf32x8_ps(a[0], 1), halves[3] = _mm512_extractf32x8_ps(a[1], 1);
                bf16_accumulators_in_order(halves);
            } else {
                halves[0] = _mm512_castps512_ps256(a[0]), halves[1] = _mm512_extractf32x8_ps(a[0], 1);
                halves[2] = _mm512_castps512_ps256(a[1]), halves[3] = _mm512_extractf32x8_ps(a[1], 1);
            }
        }
}

// The 16-bit types' product of R rows of x and `columns` (up to 8) weight rows with AVX-512 (x in the
// wide order of round_row_to_16_bits): the rows of x four at a time against two weight rows at once
// (16 accumulators and a step's 4 weight registers of the 32; each load of x serves two products). F16's
// products of whole steps are summed here as f16_accumulators_sum sums them, in registers, then 8 at a
// time (f16_totals); the others' accumulators go back to the AVX2 body's order for half_lanes_total. One
// call a tile leaves AVX-512's registers (mlx_hybrid::leave_avx512), where a call a weight row did. Where
// each row of x took each weight row alone, the bundled model's MTP head ran at 623 tokens/s against 685
// now, its DFlash drafter at 538 against 585 (docs/benchmarks.md, "What speculation can gain").
template <bool BF16, int R>
INT8_WIDE_FN void dot_rows_half_tile_wide(const uint16_t* w, const float* const* x, int columns, int K,
                                          float* const* out) {
    if constexpr (R > 4) {
        dot_rows_half_tile_wide<BF16, 4>(w, x, columns, K, out);
        dot_rows_half_tile_wide<BF16, R - 4>(w, x + 4, columns, K, out + 4);
    } else {
        constexpr int C = 2;
        const int steps = K / 32 * 32;
        const bool in_registers = !BF16 && steps == K;
        __m256 sums[R][8];
        HalfAccumulators<R> acc;
        int c = 0;
        for (; c + C <= columns; c += C) half_wide_columns<BF16, R, C>(w, x, K, c, in_registers, sums, acc);
        for (; c < columns; c++) half_wide_columns<BF16, R, 1>(w, x, K, c, in_registers, sums, acc);
        for (int r = 0; r < R; r++) {
            if (in_registers) {
                f16_totals(sums[r], columns, out[r]);
                continue;
            }
            for (int j = 0; j < columns; j++)
                out[r][j] = half_lanes_total<BF16>(acc[r][j], w + (long)j * K, x[r], steps, K);
        }
        mlx_hybrid::leave_avx512();
    }
}

// The 16-bit types' product of R rows of x and `columns` (up to 8) weight rows on the body that reads
// x in its order (round_row_to_16_bits' `wide`): with AVX-512, dot_rows_half_tile_wide (F16's row
// alone, which waits on memory, as without); else a row alone against two weight rows at once, more
// rows 3 at a time against one (their 12 accumulators and a step's 4 weight registers fill AVX2's 16).
// Then each product's total: F16's 8 at a time (f16_totals) where K is whole steps.
template <bool BF16, int R>
INT8_FN void dot_rows_half_tile(const uint16_t* w, const float* const* x, int columns, int K, float* const* out,
                                bool wide) {
    if (wide && (R > 1 || BF16)) return dot_rows_half_tile_wide<BF16, R>(w, x, columns, K, out);
    HalfAccumulators<R> acc;
    for (int c = 0; c < columns; c++) {
        const uint16_t* row = w + (long)c * K;
        if (R == 1 && c + 1 < columns) {
            dot_rows_half<BF16, 1, 2>(row, x, K, acc, c++);
            continue;
        }
        int r = 0;
        for (; r + 3 <= R; r += 3) dot_rows_half<BF16, 3, 1>(row, x + r, K, acc + r, c);
        if (R - r == 2) dot_rows_half<BF16, 2, 1>(row, x + r, K, acc + r, c);
        if (R - r == 1) dot_rows_half<BF16, 1, 1>(row, x + r, K, acc + r, c);
    }
    const int steps = K / 32 * 32;
    for (int r = 0; r < R; r++) {
        if (!BF16 && steps == K) {
            __m256 sums[8];
            for (int c = 0; c < columns; c++) sums[c] = f16_accumulators_sum(acc[r][c]);
            f16_totals(sums, columns, out[r]);
            continue;
        }
        for (int c = 0; c < columns; c++) out[r][c] = half_lanes_total<BF16>(acc[r][c], w + (long)c * K, x[r], steps, K);
    }
}

// A type's held matrix, a row of K inputs: bytes of packed values (the grid types': of the file's
// blocks), float16 factors, int8 codes; and its x rows' blocks (Q8_K's 256 values, else Q8_0's or
// Q8_1's 32).
struct Layout {
    long bytes, factors, codes;
    int x_block;
};

Layout layout_of(Type type, long K) {
    if (is_half_type(type)) return {2 * K, 0, 0, 1};
    if (is_grid_type(type)) return {K / SUPER_BLOCK * grid::grid_block_bytes(grid_values(type)), 0, 0, SUPER_BLOCK};
    switch (type) {
        case Q4_K: return {K / 2, 2 * K / SUPER_BLOCK, 2 * K / BLOCK, SUPER_BLOCK};
        case Q6_K: return {K * 6 / 8, K / SUPER_BLOCK, K / 16, SUPER_BLOCK};
        case Q5_0: return {K * 5 / 8, K / BLOCK, K / BLOCK, BLOCK};
        case Q5_1: return {K * 5 / 8, 2 * K / BLOCK, K / BLOCK, BLOCK};
        case Q4_0: case IQ4_NL: return {K / 2, K / BLOCK, K / BLOCK, BLOCK};
        case Q4_1: return {K / 2, 2 * K / BLOCK, K / BLOCK, BLOCK};
        case Q5_K: return {K * 5 / 8, 2 * K / SUPER_BLOCK, 2 * K / BLOCK, SUPER_BLOCK};
        case Q3_K: return {K * 3 / 8, K / SUPER_BLOCK, K / 16, SUPER_BLOCK};
        case Q2_K: return {K / 4, 2 * K / SUPER_BLOCK, K / 16, SUPER_BLOCK};
        case IQ4_XS: return {K / 2, K / SUPER_BLOCK, K / BLOCK, SUPER_BLOCK};
        case TQ2_0: return {K / 4, K / SUPER_BLOCK, 0, SUPER_BLOCK};
        case MXFP4: return {K / 2, K / BLOCK, 0, BLOCK};
        default: return {K, K / BLOCK, K / BLOCK, BLOCK};  // Q8_0
    }
}

// f(std::integral_constant<int, R>{}, first) for the rows [first, first + R) of a tile of `rows` (at
// most 2 MOST - 1), R powers of two from MOST down: a kernel's row count as a template argument, five
// of them for tiles of up to 16 rows
template <int MOST, typename F>
void by_powers_of_two(int rows, F&& f, int first = 0) {
    if (rows >= MOST) f(std::integral_constant<int, MOST>{}, first), rows -= MOST, first += MOST;
    if constexpr (MOST > 1) by_powers_of_two<MOST / 2>(rows, f, first);
}

// f(integral_constant<rows>, 0) for rows in [1, MOST]: a tile's rows at once
template <int MOST, class F>
void by_count(int rows, F&& f) {
    if (rows == MOST) return f(std::integral_constant<int, MOST>{}, 0);
    if constexpr (MOST > 1) by_count<MOST - 1>(rows, f);
}

// A step's first weight row n of a product (its bytes, its factors' and its codes') and where the
// tile's rows of x put their products of it
struct Weights {
    long n;
    const uint8_t* w;
    const uint8_t* scales;  // (float16 factors, MXFP4's uint8 exponents)
    const int8_t* codes;
    float* out[TILE_ROWS];
    const uint16_t* factors() const { return (const uint16_t*)scales; }
};

// The weight rows [0, units) of a product of a row of x alone, whose products wait on memory, as
// `count` stretches, one a thread. Rows read in order are one stream the hardware's prefetch follows,
// which starts over at every jump: a thread takes runs from its own stretch's front, each half of
// what is left of it (at least ROWS_PER_PART rows), and once its own is done, from the back of the
// stretch with the most left, so that no thread waits long on another at the end. (Runs of a
// quarter of the rows left a thread from one shared cursor took turns between the threads: 3584 x
// 1024 products from memory, 2 threads, AMD EPYC (Zen 5), `benchmarks/gguf_types.py --kernels
// --matrices 64 --queued`: Q8_0 103-110 -> 82-91 us, Q4_K 66-69 -> 53-55, Q6_K 81-88 -> 65-73.) Runs
// end within a group (a matrix of `rows` weight rows), at multiples of ROWS_PER_PART from its first row.
class Stretches {
   public:
    Stretches(long units, long rows, int count) : rows_(rows), count_(count), ends_(count) {
        for (int p = 0; p < count; p++) ends_[p].store(pack(boundary(units, p), boundary(units, p + 1)));
    }

    // a run [first, end) for `part`'s thread; false when every stretch is done
    bool claim(int part, long& first, long& end) {
        if (part < count_ && take(part, true, first, end)) return true;
        for (;;) {
            int most = -1;
            long most_left = 0;
            for (int p = 0; p < count_; p++) {
                const uint64_t ends = ends_[p].load(std::memory_order_relaxed);
                const long left = back(ends) - front(ends);
                if (left > most_left) most = p, most_left = left;
            }
            if (most < 0) return false;
            if (take(most, false, first, end)) return true;
        }
    }

   private:
    static uint64_t pack(long front, long back) { return (uint64_t)front << 32 | (uint64_t)back; }
    static long front(uint64_t ends) { return (long)(ends >> 32); }
    static long back(uint64_t ends) { return (long)(ends & 0xffffffffu); }

    long boundary(long units, int p) const {
        const long at = units * p / count_, group = at / rows_ * rows_;
        return std::min(units, group + (at - group) / ROWS_PER_PART * ROWS_PER_PART);
    }

    bool take(int p, bool from_front, long& first, long& end) {
        uint64_t seen = ends_[p].load(std::memory_order_relaxed);
        for (;;) {
            const long at = front(seen), until = back(seen);
            if (at >= until) return false;
            const long size = std::max(ROWS_PER_PART, (until - at) / 2 / ROWS_PER_PART * ROWS_PER_PART);
            uint64_t next;
            if (from_front) {
                first = at, end = std::min({at + size, until, (at / rows_ + 1) * rows_});
                next = pack(end, until);
            } else {
                const long group = (until - 1) / rows_ * rows_, start = std::max(0L, until - group - size);
                first = std::max(at, group + (start + ROWS_PER_PART - 1) / ROWS_PER_PART * ROWS_PER_PART);
                end = until, next = pack(at, first);
            }
            if (ends_[p].compare_exchange_weak(seen, next, std::memory_order_relaxed)) return true;
        }
    }

    const long rows_;
    const int count_;
    std::vector<std::atomic<uint64_t>> ends_;  // each stretch's (front, back), packed
};

// y [M, N]: row m of x (for an expert product, x's row of output row m = (token, choice)) times the
// matrix it multiplies (the one matrix, or matrix indices[m]).
void compute(const Q8Shape& s, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    const bool half = is_half_type(s.type);  // (inputs x, w and an expert product's indices)
    const float* x = in[0].data<float>();
    const uint8_t* w = in[1].data<uint8_t>();
    const uint8_t* factors = half ? nullptr : in[2].data<uint8_t>();  // (float16, MXFP4's uint8 exponents)
    const long factor_size = half ? 0 : in[2].itemsize();
    const int8_t* w_codes = half ? nullptr : in[3].data<int8_t>();
    const uint32_t* indices = s.chosen ? in[half ? 2 : 4].data<uint32_t>() : nullptr;
    const uint8_t* grid_rows = is_grid_type(s.type) ? in.back().data<uint8_t>() : nullptr;  // (the last input)
    float* y = outs[0].data<float>();
    const int M = s.rows, K = s.inputs, N = s.outputs, x_rows = s.shared ? M / s.chosen : M;
    const Layout held = layout_of(s.type, K);
    // llama.cpp's x86 build repacks Q4_K, Q4_0, IQ4_NL and MXFP4 matrices of rows in eights
    const bool repacked = N % 8 == 0, eights = repacked && (s.type == Q4_0 || s.type == IQ4_NL || s.type == MXFP4);
    const int blocks = K / held.x_block;
    const long row_shared = K / 2;  // QuantizedRows' `shared` a row (Q4_K uses K / 16)
    const size_t quantized = half ? 0 : x_rows;  // (rows of the 8-bit forms)
    const bool wide = mlx_hybrid::avx512_in_use();  // (BF16's x is rounded into the order of the body it meets)
    const bool vbmi = mlx_hybrid::avx512_vbmi_in_use(), vnni = mlx_hybrid::avx512_vnni_in_use();
    static const bool intel_gathers = __builtin_cpu_is("intel");  // (dot_rows_grid_avx2 says why)
    QuantizedRows q;
    q.codes.resize(quantized * K), q.d.resize(quantized * blocks), q.shared.resize(quantized * row_shared);
    q.s.resize(quantized * blocks), q.rounded.resize(half ? (size_t)x_rows * K : 0);
    // each row alone; in parallel where the rows are many (a prompt's)
    Pool::get().run(x_rows, (long)x_rows * K >= (1L << 15), [&](int r) {
        if (half) {
            (s.type == BF16 ? round_row_to_16_bits<true> : round_row_to_16_bits<false>)(
                x + (long)r * K, K, q.rounded.data() + (long)r * K, wide);
            return;
        }
        int8_t* codes = q.codes.data() + (long)r * K;
        float* d = q.d.data() + (long)r * blocks;
        int16_t* shared = q.shared.data() + r * row_shared;
        const bool q8_1 = s.type == Q5_1 || s.type == Q4_1;
        if (held.x_block == SUPER_BLOCK)
            quantize_row_q8_k(x + (long)r * K, K, codes, d, shared, s.type);
        else
            quantize_row(x + (long)r * K, K, codes, d, q8_1 ? q.s.data() + (long)r * blocks : nullptr);
        if (eights) {  // codes split as dot_rows8_b32 takes them, two blocks at a time, and each block's sum
            for (int b = 0; b < blocks; b += 2) {
                const int count = std::min(2, blocks - b), odd_start = count * BLOCK / 2;
                int8_t pair[2 * BLOCK];
                std::memcpy(pair, codes + b * BLOCK, count * BLOCK);
                for (int j = 0; j < count; j++) {
                    int16_t sum = 0;
                    for (int i = 0; i < BLOCK / 2; i++) {
                        const int8_t even = pair[j * BLOCK + 2 * i], odd = pair[j * BLOCK + 2 * i + 1];
                        codes[b * BLOCK + j * BLOCK / 2 + i] = even;
                        codes[b * BLOCK + odd_start + j * BLOCK / 2 + i] = odd;
                        sum += even + odd;
                    }
                    shared[b + j] = sum;
                }
            }
            return;
        }
        const int offset = s.type == Q5_0 ? 16 : s.type == Q4_0 ? 8 : s.type == Q3_K ? 4 : 0;  // values q - offset
        for (int i = 0; offset && i < K / 2; i++) shared[i] = (int16_t)(offset * (codes[2 * i] + codes[2 * i + 1]));
    });
    const long row_bytes = held.bytes;
    // rows of x taken at a time where they multiply the same matrix (an expert product's: the rows that
    // chose the same expert), each weight row read once for them; Q4_K matrices of rows in eights take 8
    // weight rows at a time too (16 with AVX-512): held interleaved, for any rows of x; as stored, for
    // a tile of several (one row alone, a decode step's or an expert's that one token chose:
    // dot_row_q4_k, the same arithmetic, where gathering 8 rows' words cost more than it saved)
    const bool q4_k_eights = s.type == Q4_K && repacked && (M > 1 || s.interleaved);
    const bool groups16 = s.type == Q6_K || s.type == Q3_K || s.type == Q2_K;
    const int tile = q4_k_eights ? (wide ? 8 : 4) : groups16 && wide && K <= 2048 ? 16 : 8;
    std::vector<int> order(M);  // output rows, an expert product's by the matrix they multiply
    std::iota(order.begin(), order.end(), 0);
    if (indices) std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return indices[a] < indices[b]; });
    std::vector<std::pair<int, int>> tiles;  // (first place in order, rows)
    std::vector<std::pair<int, int>> groups;  // tiles by the matrix they multiply (one but for experts): [first, end)
    for (int at = 0; at < M;) {
        int rows = 1;
        while (rows < tile && at + rows < M && (!indices || indices[order[at + rows]] == indices[order[at]])) rows++;
        if (at == 0 || (indices && indices[order[at]] != indices[order[at - 1]]))
            groups.emplace_back((int)tiles.size(), (int)tiles.size());
        tiles.emplace_back(at, rows), at += rows;
        groups.back().second = (int)tiles.size();
    }
    // both threads where the product is worth a helper's wake-up (tens of microseconds): a matrix of a
    // million weights or more (read once, whatever the rows), or two million multiply-adds (a verify
    // pass's few rows; not where the host builds the next layers beside them, whose kernels
    // mlx_hybrid/ops/schedule.py keeps to this thread: Pool::keep_to_one_thread)
    const bool parallel = (long)N * K >= (1L << 20) || (long)N * K * M >= (1L << 21);
    // The threads claim runs of a group's weight rows. Many rows of x, whose products compute: runs of
    // 64 from a shared cursor over the groups' rows in turn. A row of x alone (a decode step's, with its
    // experts'), whose products wait on memory: each thread its own stretch of the rows (`Stretches`).
    const int threads = Pool::get().threads();
    const long units = (long)groups.size() * N;
    std::atomic<long> cursor{0};
    Stretches stretches(units, N, x_rows == 1 && Pool::get().spreads(parallel) ? threads : 1);
    auto claim = [&](int part, long& first, long& end) {
        if (x_rows == 1) return stretches.claim(part, first, end);
        first = cursor.load(std::memory_order_relaxed);
        do {
            if (first >= units) return false;
            end = std::min(first + ROWS_PER_PART, (first / N + 1) * N);  // (within a group)
        } while (!cursor.compare_exchange_weak(first, end, std::memory_order_relaxed));
        return true;
    };
    auto rows_of = [&](const std::pair<int, int>& group, long first, long end) {
        for (int t = group.first; t < group.second; t++) {
            const auto [at, rows] = tiles[t];
            const long matrix = indices ? indices[order[at]] : 0;
            // the run's rows come from memory for the group's first tile only; later tiles find them in
            // the cache, where prefetching them again cost a 512-token prompt 4% of its time
            const bool from_memory = t == group.first;
            const int8_t* codes[TILE_ROWS];
            const float *d[TILE_ROWS], *x_s[TILE_ROWS], *rounded[TILE_ROWS];
            const int16_t* shared[TILE_ROWS];
            for (int i = 0; i < rows; i++) {
                const long m = order[at + i], r = s.shared ? m / s.chosen : m;
                if (half) {
                    rounded[i] = q.rounded.data() + r * K;
                    continue;
                }
                codes[i] = q.codes.data() + r * K, d[i] = q.d.data() + r * blocks;
                shared[i] = q.shared.data() + r * row_shared, x_s[i] = q.s.data() + r * blocks;
            }
            // product(weights) for the run's weight rows `step` at a time. The type is dispatched once a
            // tile, below, and each case's loop is its own: dispatched a weight row, a row of x alone (a
            // decode step's) spent a fifth of a 3584 x 1024 Q4_K product's time on it (AMD EPYC, Zen 4)
            auto each_step = [&](long step, auto&& product) {
                for (long n = first; n < end; n += step) {
                    const long row = matrix * N + n;
                    Weights rows_at;  // (its outputs not zeroed first: a REP STOSQ a row cost a Q4_K product 20%)
                    rows_at.n = n, rows_at.w = w + row * row_bytes, rows_at.codes = w_codes + row * held.codes;
                    rows_at.scales = factors + row * held.factors * factor_size;
                    // the codes 4 KiB ahead into the cache as this row is read (measured best of 1-8 KiB: the
                    // hardware's own prefetch leaves the loads waiting, 25-30% of a product's time); the
                    // 16-bit types' a line at a time, in dot_rows_half. Not rows held interleaved, which the
                    // hardware's prefetch follows (a 3584 x 1024 Q4_K product, 2 threads, from memory: 114-133
                    // us prefetched, 78 not)
                    const bool prefetched = from_memory && !half && !s.interleaved;
                    for (long line = 0; prefetched && line < std::min(step, end - n) * row_bytes; line += 64)
                        _mm_prefetch((const char*)(rows_at.w + 4096 + line), _MM_HINT_T0);
                    for (int i = 0; i < rows; i++) rows_at.out[i] = y + (long)order[at + i] * N + n;
                    product(rows_at);
                }
            };
            // a weight row at a time, the tile's rows of x in powers of two: product(R, i, weights) for R
            // rows from the tile's i-th
            auto each_row = [&](auto&& product) {
                each_step(1, [&](const Weights& at) {
                    by_powers_of_two<8>(rows, [&](auto R, int i) { product(R, i, at); });
                });
            };
            if (q4_k_eights && (rows > 1 || s.interleaved)) {
                // (a row of x alone, which waits on memory: 8 weight rows, one stream the hardware's prefetch
                // follows; 16 read two, one thread 11 GB/s against 23 from memory)
                const bool wide_rows = wide && rows > 1;
                each_step(wide_rows ? 16 : 8, [&](const Weights& at) {
                    if (wide_rows && end - at.n >= 16) {
                        by_powers_of_two<8>(rows, [&](auto R, int i) {
                            constexpr int ROWS = decltype(R)::value;
                            (s.interleaved ? dot_rows16_q4_k_wide<ROWS, true> : dot_rows16_q4_k_wide<ROWS, false>)(
                                at.w, row_bytes, at.factors(), held.factors, at.codes, held.codes, codes + i, d + i,
                                shared + i, blocks, at.out + i);
                        });
                        return;
                    }
                    by_powers_of_two<8>(rows, [&](auto R, int i) {
                        constexpr int ROWS = decltype(R)::value;
                        (s.interleaved ? dot_rows8_q4_k<ROWS, true> : dot_rows8_q4_k<ROWS, false>)(
                            at.w, row_bytes, at.factors(), held.factors, at.codes, held.codes, codes + i, d + i,
                            shared + i, blocks, at.out + i);
                    });
                });
                continue;
            }
            if (groups16) {
                each_step(1, [&](const Weights& at) {
                    by_powers_of_two<TILE_ROWS>(rows, [&](auto R, int i) {
                        constexpr int ROWS = decltype(R)::value;
                        // with VBMI its body for any rows (dot_rows_groups16_vbmi); else a row alone, a decode
                        // step's, which waits on memory, the AVX2 body, without the wide registers' cost (measured
                        // on an Intel Xeon), except Q6_K's, where the wide body's 6-bit unpacking takes half the
                        // instructions (an LM head of 248k rows: Zen 4 15% faster)
                        auto body = [&](auto bits) {
                            constexpr int BITS = decltype(bits)::value;
                            if (vbmi) return dot_rows_groups16_vbmi<BITS, ROWS>;
                            return wide && (ROWS > 1 || BITS == 6) ? dot_rows_groups16_wide<BITS, ROWS>
                                                                   : dot_rows_groups16<BITS, ROWS>;
                        };
                        auto product = s.type == Q6_K   ? body(std::integral_constant<int, 6>{})
                                       : s.type == Q3_K ? body(std::integral_constant<int, 3>{})
                                                        : body(std::integral_constant<int, 2>{});
                        product(at.w, at.factors(), at.codes, codes + i, shared + i, d + i, blocks, at.out + i);
                    });
                });
                continue;
            }
            if (half) {  // 8 weight rows at a time, the tile's rows of x at once: the wide body takes up to 8
                each_step(8, [&](const Weights& at) {
                    by_count<8>(rows, [&](auto R, int) {
                        constexpr int ROWS = decltype(R)::value;
                        (s.type == BF16 ? dot_rows_half_tile<true, ROWS> : dot_rows_half_tile<false, ROWS>)(
                            (const uint16_t*)at.w, rounded, (int)std::min<long>(8, end - at.n), K, at.out, wide);
                    });
                });
                continue;
            }
            // IQ4_NL's and MXFP4's: 8 weight rows at a time where llama.cpp repacks the matrix
            auto table_product = [&](auto kind) {
                constexpr Nibbles KIND = decltype(kind)::value;
                if (eights)
                    each_step(8, [&](const Weights& at) {
                        by_powers_of_two<8>(rows, [&](auto R, int i) {
                            constexpr int ROWS = decltype(R)::value;
                            auto product = s.interleaved ? dot_rows8_b32<KIND, ROWS, true>
                                                         : dot_rows8_b32<KIND, ROWS, false>;
                            if (vnni)
                                product = s.interleaved ? dot_rows8_b32_vnni<KIND, ROWS, true>
                                                        : dot_rows8_b32_vnni<KIND, ROWS, false>;
                            product(at.w, row_bytes, at.scales, held.factors, codes + i, shared + i, d + i, blocks,
                                    at.out + i);
                        });
                    });
                else
                    each_row([&](auto R, int i, const Weights& at) {
                        dot_rows_table<KIND, decltype(R)::value>(at.w, at.scales, codes + i, d + i, blocks, at.out + i);
                    });
            };
            auto grid_product = [&](auto values) {
                constexpr int V = decltype(values)::value;
                each_row([&](auto R, int i, const Weights& at) {
                    constexpr int ROWS = decltype(R)::value;
                    auto product = dot_rows_grid_avx2<V, ROWS>;
                    if (wide)
                        product = intel_gathers ? dot_rows_grid_wide<V, ROWS, true> : dot_rows_grid_wide<V, ROWS, false>;
                    product(at.w, grid_rows, codes + i, d + i, shared + i, blocks, at.out + i);
                });
            };
            switch (s.type) {
                case Q8_0:
                    each_row([&](auto R, int i, const Weights& at) {
                        dot_rows_q8_0<decltype(R)::value>(at.w, at.factors(), codes + i, d + i, blocks, at.out + i);
                    });
                    break;
                case Q4_K:  // (a row of x alone, or a matrix llama.cpp does not repack)
                    each_step(1, [&](const Weights& at) {
                        for (int j = 0; j < rows; j++)
                            *at.out[j] = (repacked ? dot_row_q4_k : dot_row_q4_k_lanes)(
                                at.w, at.factors(), at.codes, codes[j], d[j], shared[j], blocks);
                    });
                    break;
                case Q5_K:
                    each_row([&](auto R, int i, const Weights& at) {
                        constexpr int ROWS = decltype(R)::value;
                        (vbmi ? dot_rows_q5_k_vbmi<ROWS> : dot_rows_q5_k<ROWS>)(at.w, at.factors(), at.codes, codes + i,
                                                                                d + i, shared + i, blocks, at.out + i);
                    });
                    break;
                case IQ4_XS:
                    each_row([&](auto R, int i, const Weights& at) {
                        constexpr int ROWS = decltype(R)::value;
                        (vbmi ? dot_rows_iq4_xs_vbmi<ROWS> : dot_rows_iq4_xs<ROWS>)(at.w, at.factors(), at.codes,
                                                                                  codes + i, d + i, blocks, at.out + i);
                    });
                    break;
                case Q5_0:
                case Q5_1:
                case Q4_1:
                case Q4_0:
                    if (eights) {
                        table_product(std::integral_constant<Nibbles, Q4_0_VALUES>{});
                        break;
                    }
                    each_row([&](auto R, int i, const Weights& at) {
                        constexpr int ROWS = decltype(R)::value;
                        auto product = s.type == Q5_0   ? dot_rows_b32<5, false, ROWS>
                                       : s.type == Q5_1 ? dot_rows_b32<5, true, ROWS>
                                       : s.type == Q4_1 ? dot_rows_b32<4, true, ROWS>
                                                        : dot_rows_b32<4, false, ROWS>;
                        product(at.w, at.factors(), codes + i, shared + i, d + i, x_s + i, blocks, at.out + i);
                    });
                    break;
                case IQ4_NL: table_product(std::integral_constant<Nibbles, IQ4_NL_VALUES>{}); break;
                case MXFP4: table_product(std::integral_constant<Nibbles, MXFP4_VALUES>{}); break;
                case IQ2_XXS: grid_product(std::integral_constant<int, grid::IQ2_XXS>{}); break;
                case IQ2_XS: grid_product(std::integral_constant<int, grid::IQ2_XS>{}); break;
                case IQ2_S: grid_product(std::integral_constant<int, grid::IQ2_S>{}); break;
                case IQ3_XXS: grid_product(std::integral_constant<int, grid::IQ3_XXS>{}); break;
                case IQ3_S: grid_product(std::integral_constant<int, grid::IQ3_S>{}); break;
                case IQ1_S: grid_product(std::integral_constant<int, grid::IQ1_S>{}); break;
                case IQ1_M: grid_product(std::integral_constant<int, grid::IQ1_M>{}); break;
                case TQ1_0:
                case TQ2_0:
                    each_row([&](auto R, int i, const Weights& at) {
                        constexpr int ROWS = decltype(R)::value;
                        (s.type == TQ1_0 ? dot_rows_ternary<true, ROWS> : dot_rows_ternary<false, ROWS>)(
                            at.w, at.factors(), codes + i, d + i, shared + i, blocks, at.out + i);
                    });
                    break;
                default: break;  // (the groups of 16 and the 16-bit types: above)
            }
        }
    };
    Pool::get().run(threads, parallel, [&](int part) {
        for (long first, end; claim(part, first, end);) rows_of(groups[first / N], first % N, end - first / N * N);
    });
}

using Q8Product = mlx_hybrid::CpuPrimitive<Q8Shape, compute>;

// Throws unless w, factors and codes (the last axes) hold a matrix of `type` with K inputs (`layout_of`),
// and a grid type comes with its grid (uint8 [entries, magnitudes a row]) and no other.
void check_held(Type type, int K, const mx::array& w, const mx::array& factors, const mx::array& codes,
                const std::optional<mx::array>& grid) {
    const Layout held = layout_of(type, K);
    const bool grid_type = is_grid_type(type);
    if (K % held.x_block || w.dtype() != (grid_type ? mx::uint8 : mx::uint32) ||
        factors.dtype() != (type == MXFP4 ? mx::uint8 : mx::float16) ||
        codes.dtype() != mx::int8 || w.shape(-1) * (long)w.itemsize() != held.bytes ||
        factors.shape(-1) != held.factors || codes.shape(-1) != held.codes || factors.shape(-2) != w.shape(-2))
        throw std::invalid_argument("int8 products: the held matrix does not fit x's K (" + std::to_string(K) +
                                    ") as its type holds it");
    const int values = grid_type ? grid_values(type) : 0;
    if (grid.has_value() != grid_type ||
        (grid_type && (grid->dtype() != mx::uint8 || grid->ndim() != 2 ||
                       grid->shape(0) != grid::GRID_ENTRIES[values - grid::GRID_FIRST] ||
                       grid->shape(1) != grid::grid_magnitudes(values))))
        throw std::invalid_argument("int8 products: a grid type takes its grid (uint8 [entries, magnitudes]), "
                                    "the others none");
}

// the primitive's inputs: the product's, then a grid type's grid
std::vector<mx::array> with_grid(std::vector<mx::array> inputs, const std::optional<mx::array>& grid) {
    if (grid) inputs.push_back(*grid);
    return inputs;
}

// A matrix's packed codes held interleaved: each 8 rows' turns of `unit` 4-byte words in turn (Q4_K's
// word p of row 8s + n at (8s) K / 8 + 8p + n, as llama.cpp's x86 build repacks Q4_K; Q4_0's, IQ4_NL's and
// MXFP4's 32 bytes, two blocks, a row's turn), so that the products of rows in eights read one stream,
// which the hardware's prefetch follows, and Q4_K's load 8 rows' words with one load where gathering
// them took 3 instructions a word (a 3584 x 1024 product on one thread, AMD EPYC (Zen 4), from the L3
// cache: 90 -> 57 us, 23.5 -> 37 GB/s). Their factors and codes stay a row's in turn.
struct Eights {
    long eights;  // over all matrices
    int words;    // a row's (K / 8)
    int unit;     // words a row's turn: 1 (Q4_K), 8 (a pair of Q4_0's blocks)
    bool operator==(const Eights&) const = default;
};

// The words of a row's turn where N rows of `type`, each `words` 32-bit words packed, are held
// interleaved, else 0: the matrices of rows in eights of the types llama.cpp's x86 build repacks in
// eights, Q4_K's a word a turn, Q4_0's, IQ4_NL's and MXFP4's (16 bytes of codes a block) a pair of
// blocks a turn
int interleaved_unit(int type, int N, int words) {
    if (N % 8) return 0;
    const bool blocks_of_32 = type == Q4_0 || type == IQ4_NL || type == MXFP4;
    return type == Q4_K ? 1 : blocks_of_32 && words % 8 == 0 ? 8 : 0;
}

// Each eight of rows through a copy of it, so that the output may be the matrix's own buffer (a
// loader's matrix, replaced by its interleaved one: dispatch_on_cpu's in_place). A turn's size is a
// constant of each loop, so that its copy is a move, not a call (with a call a 4-byte word, the 8-layer
// 35B-A3B-width Q4_K_M file's interleaving took 2.8 s; now 0.6-0.8)
void interleave(const Eights& s, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    const uint32_t* w = inputs[0].data<uint32_t>();
    uint32_t* to = outputs[0].data<uint32_t>();
    const int parts = 4 * Pool::get().threads();
    auto turns = [&](auto unit) {
        constexpr int UNIT = decltype(unit)::value;
        Pool::get().run(parts, s.eights * s.words >= (1L << 16), [&](int part) {
            thread_local std::vector<uint32_t> copy;
            copy.resize(8L * s.words);
            for (long e = s.eights * part / parts; e < s.eights * (part + 1) / parts; e++) {
                std::memcpy(copy.data(), w + e * 8 * s.words, copy.size() * 4);
                for (int p = 0; p < s.words; p += UNIT)
                    for (int n = 0; n < 8; n++)
                        std::memcpy(to + e * 8 * s.words + 8 * p + n * UNIT, copy.data() + (long)n * s.words + p,
                                    4 * UNIT);
            }
        });
    };
    if (s.unit == 1)
        turns(std::integral_constant<int, 1>{});
    else
        turns(std::integral_constant<int, 8>{});
}

using Interleave = mlx_hybrid::CpuPrimitive<Eights, interleave, 0, true>;

mx::array interleave_eights(const mx::array& w, int type) {
    const int unit = w.ndim() < 2 ? 0 : interleaved_unit(type, w.shape(-2), w.shape(-1));
    if (w.dtype() != mx::uint32 || !unit)
        throw std::invalid_argument("interleave_eights: the packed codes [..., N, K / 8] (uint32) of a Q4_K, "
                                    "Q4_0, IQ4_NL or MXFP4 matrix of rows in eights (Q4_0's, IQ4_NL's and "
                                    "MXFP4's rows in pairs of blocks)");
    Eights s{(long)(w.size() / w.shape(-1) / 8), w.shape(-1), unit};
    return mx::array(w.shape(), mx::uint32,
                     std::make_shared<Interleave>(mx::default_stream(mx::Device::cpu), s, "InterleaveEights"), {w});
}

// Throws unless a matrix held interleaved (`interleave_eights`) can be
void check_interleaved(bool interleaved, int type, const mx::array& w) {
    if (interleaved && !interleaved_unit(type, w.shape(-2), w.shape(-1)))
        throw std::invalid_argument("int8 products: only Q4_K, Q4_0, IQ4_NL and MXFP4 matrices of rows in "
                                    "eights are held interleaved");
}

// The product of M rows of x [..., K] with a matrix held as `type` (w packed codes, factors, codes, a grid
// type's grid; `interleaved`: see interleave_eights), or throws naming `caller`
Q8Shape held_product(const char* caller, int M, int K, const mx::array& w, const mx::array& factors,
                     const mx::array& codes, int type, const std::optional<mx::array>& grid, bool interleaved) {
    if (w.ndim() != 2 || factors.ndim() != 2 || type < 0 || type >= TYPES)
        throw std::invalid_argument(std::string(caller) + ": a matrix [N, ...] of type 0 (Q8_0), 1 (Q4_K), 2 (Q6_K), "
                                    "3 (Q5_0), 4 (Q5_1), 5 (Q4_0), 6 (Q4_1), 7 (IQ4_NL), 8 (Q5_K), 9 (Q3_K), "
                                    "10 (Q2_K), 11 (IQ4_XS), 12 (IQ2_XXS), 13 (IQ2_XS), 14 (IQ2_S), 15 (IQ3_XXS), "
                                    "16 (IQ3_S), 17 (IQ1_S), 18 (IQ1_M), 19 (TQ1_0), 20 (TQ2_0) or 21 (MXFP4)");
    check_held((Type)type, K, w, factors, codes, grid);
    check_interleaved(interleaved, type, w);
    return Q8Shape{M, K, w.shape(0), 0, false, (Type)type, interleaved};
}

// The product of M rows of x [..., K] with w [N, K] float16 or bfloat16, or throws naming `caller`
Q8Shape half_product(const char* caller, int M, int K, const mx::array& w) {
    if (w.ndim() != 2 || w.shape(1) != K || (w.dtype() != mx::float16 && w.dtype() != mx::bfloat16))
        throw std::invalid_argument(std::string(caller) + ": a matrix [N, K] of float16 or bfloat16");
    return Q8Shape{M, K, w.shape(0), 0, false, w.dtype() == mx::bfloat16 ? BF16 : F16};
}

// x [..., K] float32 @ W^T for W [N, K] held as `type` (w packed codes, factors,
// codes: see the top) -> float32 [..., N]
mx::array int8_matmul(const mx::array& x, const mx::array& w, const mx::array& factors, const mx::array& codes,
                      int type, const std::optional<mx::array>& grid, bool interleaved) {
    if (x.dtype() != mx::float32 || x.ndim() < 1) throw std::invalid_argument("int8_matmul: x float32 [..., K]");
    const int K = x.shape(-1), M = (int)(x.size() / std::max(K, 1));
    const Q8Shape s = held_product("int8_matmul", M, K, w, factors, codes, type, grid, interleaved);
    auto shape = x.shape();
    shape.back() = s.outputs;
    return mx::array(shape, mx::float32, std::make_shared<Q8Product>(mx::default_stream(mx::Device::cpu), s,
                                                                     "Int8Product"),
                     with_grid({x, w, factors, codes}, grid));
}

// Products of one x with several matrices (a layer's projections of the same input), one node: each
// matrix's inputs (w, factors, codes, a grid type's grid) after x, in turn
struct Q8Shapes {
    std::vector<Q8Shape> each;
    bool operator==(const Q8Shapes&) const = default;
};

void compute_each(const Q8Shapes& s, const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    size_t at = 1;
    for (size_t i = 0; i < s.each.size(); i++) {
        const size_t count = is_half_type(s.each[i].type) ? 1 : is_grid_type(s.each[i].type) ? 4 : 3;
        std::vector<mx::array> inputs{in[0]};
        inputs.insert(inputs.end(), in.begin() + at, in.begin() + at + count);
        std::vector<mx::array> out{outs[i]};
        compute(s.each[i], inputs, out);
        at += count;
    }
}

using Q8Products = mlx_hybrid::CpuPrimitive<Q8Shapes, compute_each>;

// int8_matmul of x with each matrix of `matrices` ((w, factors, codes, type, grid, interleaved) each),
// as one MLX node: what one call a matrix gives, without a node's cost a matrix
std::vector<mx::array> int8_matmuls(const mx::array& x, const std::vector<nb::tuple>& matrices) {
    if (x.dtype() != mx::float32 || x.ndim() < 1 || matrices.empty())
        throw std::invalid_argument("int8_matmuls: x float32 [..., K] and one matrix or more");
    const int K = x.shape(-1), M = (int)(x.size() / std::max(K, 1));
    Q8Shapes s;
    std::vector<mx::array> inputs{x};
    std::vector<mx::Shape> shapes;
    for (const nb::tuple& matrix : matrices) {
        if (matrix.size() != 6)
            throw std::invalid_argument("int8_matmuls: each matrix (w, factors, codes, type, grid, interleaved)");
        const auto w = nb::cast<mx::array>(matrix[0]);
        if (matrix[1].is_none()) {  // a float16 or bfloat16 matrix (half_matmul's)
            s.each.push_back(half_product("int8_matmuls", M, K, w));
            inputs.push_back(w);
        } else {
            const auto factors = nb::cast<mx::array>(matrix[1]), codes = nb::cast<mx::array>(matrix[2]);
            const auto grid = nb::cast<std::optional<mx::array>>(matrix[4]);
            s.each.push_back(held_product("int8_matmuls", M, K, w, factors, codes, nb::cast<int>(matrix[3]), grid,
                                          nb::cast<bool>(matrix[5])));
            for (const auto& input : with_grid({w, factors, codes}, grid)) inputs.push_back(input);
        }
        auto shape = x.shape();
        shape.back() = w.shape(0);
        shapes.push_back(shape);
    }
    return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(matrices.size(), mx::float32),
                                  std::make_shared<Q8Products>(mx::default_stream(mx::Device::cpu), s, "Int8Products"),
                                  inputs);
}

// x [T, 1 or k, K] float32 against the matrices of w [E, N, ...] (held as `type`) chosen by indices
// [T, k] -> float32 [T, k, N]
mx::array int8_gather_matmul(const mx::array& x, const mx::array& w, const mx::array& factors, const mx::array& codes,
                             const mx::array& indices, int type, const std::optional<mx::array>& grid,
                             bool interleaved) {
    if (x.dtype() != mx::float32 || x.ndim() != 3 || w.ndim() != 3 || factors.ndim() != 3 || indices.ndim() != 2 ||
        indices.shape(0) != x.shape(0) || (x.shape(1) != 1 && x.shape(1) != indices.shape(1)) ||
        type < 0 || type >= TYPES)
        throw std::invalid_argument("int8_gather_matmul: x float32 [T, 1 or k, K], matrices [E, N, ...] of a type "
                                    "int8_matmul takes, indices [T, k]");
    const int K = x.shape(2), N = w.shape(1), k = indices.shape(1), M = indices.shape(0) * k;
    check_held((Type)type, K, w, factors, codes, grid);
    check_interleaved(interleaved, type, w);
    auto stream = mx::default_stream(mx::Device::cpu);
    Q8Shape s{M, K, N, k, x.shape(1) == 1, (Type)type, interleaved};
    return mx::array({indices.shape(0), k, N}, mx::float32,
                     std::make_shared<Q8Product>(stream, s, "Int8GatherProduct"),
                     with_grid({x, w, factors, codes, mx::astype(indices, mx::uint32)}, grid));
}

// x [..., K] float32 @ W^T for W [N, K] float16 or bfloat16, as llama.cpp computes it (x rounded to W's
// 16 bits, dot_rows_half) -> float32 [..., N]
mx::array half_matmul(const mx::array& x, const mx::array& w) {
    if (x.dtype() != mx::float32 || x.ndim() < 1) throw std::invalid_argument("half_matmul: x float32 [..., K]");
    const int K = x.shape(-1), M = (int)(x.size() / std::max(K, 1));
    const Q8Shape s = half_product("half_matmul", M, K, w);
    auto shape = x.shape();
    shape.back() = s.outputs;
    return mx::array(shape, mx::float32, std::make_shared<Q8Product>(mx::default_stream(mx::Device::cpu), s,
                                                                     "HalfProduct"), {x, w});
}

// half_matmul against the matrices of w [E, N, K] chosen by indices [T, k], for x [T, 1 or k, K]
mx::array half_gather_matmul(const mx::array& x, const mx::array& w, const mx::array& indices) {
    if (x.dtype() != mx::float32 || x.ndim() != 3 || w.ndim() != 3 || w.shape(2) != x.shape(2) ||
        indices.ndim() != 2 || indices.shape(0) != x.shape(0) || (x.shape(1) != 1 && x.shape(1) != indices.shape(1)) ||
        (w.dtype() != mx::float16 && w.dtype() != mx::bfloat16))
        throw std::invalid_argument("half_gather_matmul: x float32 [T, 1 or k, K], matrices [E, N, K] of float16 or "
                                    "bfloat16, indices [T, k]");
    const int K = x.shape(2), N = w.shape(1), k = indices.shape(1), M = indices.shape(0) * k;
    Q8Shape s{M, K, N, k, x.shape(1) == 1, w.dtype() == mx::bfloat16 ? BF16 : F16};
    return mx::array({indices.shape(0), k, N}, mx::float32,
                     std::make_shared<Q8Product>(mx::default_stream(mx::Device::cpu), s, "HalfGatherProduct"),
                     {x, w, mx::astype(indices, mx::uint32)});
}

}  // namespace

void mlx_hybrid::bind_int8_products(nb::module_& m) {
    m.def("int8_matmul", &int8_matmul, nb::arg("x"), nb::arg("w"), nb::arg("factors"), nb::arg("codes"),
          nb::arg("type"), nb::arg("grid") = nb::none(), nb::arg("interleaved") = false,
          "x @ W^T for a GGUF matrix (type 0: Q8_0, 1: Q4_K, 2: Q6_K, 3: Q5_0, 4: Q5_1, 5: Q4_0, 6: Q4_1, "
          "7: IQ4_NL, 8: Q5_K, 9: Q3_K, 10: Q2_K, 11: IQ4_XS, 12: IQ2_XXS, 13: IQ2_XS, 14: IQ2_S, 15: IQ3_XXS, "
          "16: IQ3_S, 17: IQ1_S, 18: IQ1_M, 19: TQ1_0, 20: TQ2_0, 21: MXFP4; the types held as the file's blocks "
          "with their grid; `interleaved`: a Q4_K, Q4_0, IQ4_NL or MXFP4 matrix of rows in eights held "
          "interleaved, as interleave_eights makes it) as llama.cpp computes it");
    m.def("int8_matmuls", &int8_matmuls, nb::arg("x"), nb::arg("matrices"),
          "int8_matmul of x with each of `matrices` ((w, factors, codes, type, grid, interleaved) each), as one "
          "node");
    m.def("interleave_eights", &interleave_eights, nb::arg("w"), nb::arg("type"),
          "the packed codes [..., N, K / 8] (uint32) of a matrix of `type` held interleaved: each 8 rows' words in "
          "turn, as the int8 products read them with `interleaved`");
    m.def("interleaved_unit", &interleaved_unit, nb::arg("type"), nb::arg("N"), nb::arg("words"),
          "the words of a row's turn where a matrix of `type`, N rows of `words` 32-bit words packed, is held "
          "interleaved, else 0");
    m.def("int8_gather_matmul", &int8_gather_matmul, nb::arg("x"), nb::arg("w"), nb::arg("factors"), nb::arg("codes"),
          nb::arg("indices"), nb::arg("type"), nb::arg("grid") = nb::none(), nb::arg("interleaved") = false,
          "int8_matmul against the matrices each token chose (experts)");
    m.def("half_matmul", &half_matmul, nb::arg("x"), nb::arg("w"),
          "x @ W^T for a float16 or bfloat16 matrix as llama.cpp computes it: x rounded to 16 bits, its dot");
    m.def("half_gather_matmul", &half_gather_matmul, nb::arg("x"), nb::arg("w"), nb::arg("indices"),
          "half_matmul against the matrices each token chose (experts)");
}
