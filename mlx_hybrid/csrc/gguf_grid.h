// GGUF's grid types and TQ1_0 read as the file stores them: what a block holds and how a step of 32
// values decodes to signed bytes. Shared by the float-activation products (quantized_matmul.cpp) and
// the 8-bit ones (int8_products.cpp), which multiply the same decoded bytes.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>

namespace mlx_hybrid::gguf_grid {

// (AVX2 functions inlined into callers of that target or a wider one)
#define GRID_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline
// (scalar BMI2 functions inlined into the AVX-512 bodies, whose CPUs all have it)
#define GRID_BMI2_INLINE __attribute__((target("bmi2"), always_inline)) inline

// What a packed value stands for: an unsigned integer (times its group's scale, plus its bias),
// a 4-bit index into the layout's table of 16 unsigned bytes (likewise: IQ4_NL's values plus
// 128, with a bias of -128 times the scale), or (16 bits) a bfloat16 or float16 weight. The
// grid types (GRID_FIRST on) are not packed values but GGUF's blocks as the file stores them:
// see "GGUF's grid types" below.
enum Values { INTEGERS = 0, TABLE = 1, BFLOAT16 = 2, FLOAT16 = 3, IQ2_XXS = 4, IQ2_XS = 5, IQ2_S = 6, IQ3_XXS = 7,
              IQ3_S = 8, IQ1_S = 9, IQ1_M = 10, TQ1_0 = 11 };
constexpr int GRID_FIRST = IQ2_XXS;
constexpr bool is_grid(int values) { return values >= GRID_FIRST; }

// ---------------------------------------------------------------------------------------
// GGUF's grid types, read as stored: blocks of 256 values, each a float16 d and then, for each
// 32 values (a step of the 8-bit kernel), indices into a grid of 8 or 4 magnitudes a row, eight
// sign bits a row of 8, and a 4-bit scale code s (one, or two for halves of 16). A value is
// d (2 s + 1) / GRID_DIVISOR * magnitude * sign. The IQ1 types' grid rows are signed already
// (-1, 0, 1), their codes 3 bits, and a delta of +-1/8 is added to each value (one a step for
// IQ1_S, one a row of 8 for IQ1_M): d (2 s + 1) / 8 times 8 g +- 1, integers again, so their grid
// comes times 8. The grids (`grid`, uint8 [entries, 8 or 4]) come from the caller, gguf-py's
// tables; the kernel decodes a step into 32 signed bytes, which it multiplies as it does 8-bit
// values (small integers: exact).
// TQ1_0, ternary, is decoded the same way with no grid: five values -1, 0, 1 a byte in base 3
// (scaled so that the i-th is the top bits of the byte times 3^i), then a float16 d last.
// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0
constexpr int GRID_BLOCK_BYTES[] = {66, 74, 82, 98, 110, 50, 56, 54};
constexpr int GRID_ENTRIES[] = {256, 512, 1024, 256, 512, 2048, 2048, 0};
constexpr int GRID_DIVISOR[] = {8, 8, 8, 4, 1, 8, 8, 1};
constexpr int grid_block_bytes(int values) { return GRID_BLOCK_BYTES[values - GRID_FIRST]; }
constexpr int grid_magnitudes(int values) { return values == IQ3_XXS || values == IQ3_S ? 4 : 8; }  // a grid row's
// the values a scale code covers: IQ2_XS's and IQ2_S's codes are nibbles, one a half step, and
// IQ1_M's one a half step
constexpr int grid_group_size(int values) { return values == IQ2_XS || values == IQ2_S || values == IQ1_M ? 16 : 32; }

// IQ2_XXS, IQ2_XS and IQ3_XXS store 7 sign bits a row of 8, the eighth making the count of
// minus signs even (llama.cpp's ksigns_iq2xs): the byte of all eight for each 7 bits.
constexpr std::array<uint8_t, 128> SIGNS_OF_7_BITS = [] {
    std::array<uint8_t, 128> table{};
    for (int i = 0; i < 128; i++) table[i] = (uint8_t)(i | (__builtin_popcount(i) & 1) << 7);
    return table;
}();

// For each byte of 8 sign bits, the 8 bytes that negate a row of 8 values: 0xFF where its bit is
// set (x ^ mask - mask is -x there, x elsewhere); and the same for each 7 sign bits.
constexpr std::array<uint64_t, 256> SIGN_MASKS = [] {
    std::array<uint64_t, 256> table{};
    for (int i = 0; i < 256; i++)
        for (int bit = 0; bit < 8; bit++)
            if (i >> bit & 1) table[i] |= 0xFFULL << (8 * bit);
    return table;
}();
constexpr std::array<uint64_t, 128> SIGN_MASKS_OF_7_BITS = [] {
    std::array<uint64_t, 128> table{};
    for (int i = 0; i < 128; i++) table[i] = SIGN_MASKS[SIGNS_OF_7_BITS[i]];
    return table;
}();

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// A block's d, as float16 bits: its first two bytes, but IQ1_M's, whose four nibbles are the
// top ones of its four 16-bit scale words, and TQ1_0's, its last two.
inline uint16_t grid_d(int values, const uint8_t* block) {
    if (values == TQ1_0) return load_u16(block + 52);
    if (values != IQ1_M) return load_u16(block);
    uint16_t d = 0;
    for (int i = 0; i < 4; i++) d |= (load_u16(block + 48 + 2 * i) >> 12) << (4 * i);
    return d;
}

// Where IQ1_S's and IQ1_M's blocks hold their 8 step words (16 bits each: each grid row's 3 high index
// bits, at 3 j (IQ1_S) or 4 j (IQ1_M), beside IQ1_S's scale code and delta sign, bits 12-15, or IQ1_M's
// row delta signs, bit 4 j + 3).
template <int VALUES>
constexpr int IQ1_WORDS = VALUES == IQ1_S ? 34 : 32;

// The scale code of group g (of grid_group_size values) in a block.
inline int grid_code(int values, const uint8_t* block, int g) {
    switch (values) {
        case IQ2_XXS: return load_u32(block + 2 + 8 * g + 4) >> 28;
        case IQ2_XS: return block[66 + g / 2] >> (4 * (g % 2)) & 15;
        case IQ2_S: return block[74 + g / 2] >> (4 * (g % 2)) & 15;
        case IQ3_XXS: return load_u32(block + 66 + 4 * g) >> 28;
        case IQ1_S: return load_u16(block + IQ1_WORDS<IQ1_S> + 2 * g) >> 12 & 7;
        case IQ1_M: return load_u16(block + 48 + 2 * (g / 4)) >> (3 * (g % 4)) & 7;
        case TQ1_0: return 0;  // d alone
        default: return block[106 + g / 2] >> (4 * (g % 2)) & 15;  // IQ3_S
    }
}

// The 32 values of a step as signed bytes, in order: their magnitudes (four grid rows of 8, or
// eight of 4) and the masks that negate them (SIGN_MASKS: one a row of 8 values).
GRID_INLINE __m256i negated(__m256i magnitudes, __m256i minus) {
    return _mm256_sub_epi8(_mm256_xor_si256(magnitudes, minus), minus);  // two's complement where negative
}

// The masks that negate 32 values (0xFF where a value's sign bit is set) from their 32 sign bits, the
// lowest first (IQ3_S's 4 sign bytes): each byte spread over its 8 values, then each value's bit.
GRID_INLINE __m256i sign_masks_of_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                      2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// Each byte times 3 and times 9, mod 256 (8 x + x: the bits a 16-bit shift moves across bytes masked)
GRID_INLINE __m256i bytes_times_3(__m256i q) { return _mm256_add_epi8(q, _mm256_add_epi8(q, q)); }
GRID_INLINE __m256i bytes_times_9(__m256i q) {
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(q, 3), _mm256_set1_epi8((char)0xF8)), q);
}

// A TQ1_0 value as the byte 0, 1 or 2 from its byte t = b 3^i mod 256 (b the byte that holds it): (3 t) >> 8,
// as ((t - 1, at least 0) + (t >> 1) + 1) >> 7, an unsigned average of bytes then its top two bits (exact
// for every t: 3 t and 2 t + 2 (t >> 1) differ by at most one, and 3 t is no multiple of 256 but 0).
GRID_INLINE __m256i ternary_digit(__m256i t) {
    const __m256i halves = _mm256_and_si256(_mm256_srli_epi16(t, 1), _mm256_set1_epi8(0x7F));
    const __m256i average = _mm256_avg_epu8(_mm256_subs_epu8(t, _mm256_set1_epi8(1)), halves);
    return _mm256_and_si256(_mm256_srli_epi16(average, 6), _mm256_set1_epi8(3));
}

// Step 7's bytes from the 16 bytes times 81 (`times_81`, in both halves) and the last 4 (qh, values 240 +
// 4 i + j): the 16 bytes' values, then qh's times 1, 3, 9 and 27.
GRID_INLINE __m256i ternary_last_step(__m256i times_81, const uint8_t* block) {
    const __m256i q = _mm256_set1_epi32((int)load_u32(block + 48));
    const __m256i q9 = bytes_times_9(q);
    const __m256i t = _mm256_blend_epi32(times_81, q, 0x10);
    return _mm256_blend_epi32(_mm256_blend_epi32(t, bytes_times_3(q), 0x20),
                              _mm256_blend_epi32(q9, bytes_times_3(q9), 0x80), 0xC0);
}

// Step `sub` (32 values) of a TQ1_0 block as bytes 0, 1, 2 (ternary_digit): the first 32 bytes hold values
// 32 i + m (steps 0-4), the next 16 values 160 + 16 i + m (steps 5-7), the last 4 (qh) values 240 + 4 i +
// j (step 7's upper half). The powers by shifts and adds of bytes.
GRID_INLINE __m256i ternary_digits(const uint8_t* block, int sub) {
    __m256i t;
    if (sub < 5) {
        t = _mm256_loadu_si256((const __m256i*)block);
        if (sub % 2 == 1) t = bytes_times_3(t);  // 3, 27
        if (sub >= 2) t = bytes_times_9(t);      // 9, 27
        if (sub == 4) t = bytes_times_9(t);      // 81
        return ternary_digit(t);
    }
    t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(block + 32)));  // the 16 bytes in both halves
    if (sub == 5) return ternary_digit(_mm256_blend_epi32(t, bytes_times_3(t), 0xF0));  // times 1 | 3
    t = bytes_times_9(t);
    if (sub == 6) return ternary_digit(_mm256_blend_epi32(t, bytes_times_3(t), 0xF0));  // times 9 | 27
    return ternary_digit(ternary_last_step(bytes_times_9(t), block));
}

// A whole TQ1_0 block's steps as ternary_digits gives them, each power of 3 from the one before (a row's
// decode takes half the shifts and adds, and one load of each part)
GRID_INLINE void ternary_block_digits(const uint8_t* block, __m256i (&digits)[8]) {
    __m256i t = _mm256_loadu_si256((const __m256i*)block);
    for (int sub = 0; sub < 5; sub++, t = bytes_times_3(t)) digits[sub] = ternary_digit(t);
    const __m256i sixteen = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(block + 32)));
    const __m256i powers_1_3 = _mm256_blend_epi32(sixteen, bytes_times_3(sixteen), 0xF0);
    const __m256i powers_9_27 = bytes_times_9(powers_1_3);
    digits[5] = ternary_digit(powers_1_3);
    digits[6] = ternary_digit(powers_9_27);
    digits[7] = ternary_digit(ternary_last_step(bytes_times_9(powers_9_27), block));  // 81 | 243: the low half
}

// the same as signed bytes -1, 0, 1
GRID_INLINE __m256i ternary_lanes(const uint8_t* block, int sub) {
    return _mm256_sub_epi8(ternary_digits(block, sub), _mm256_set1_epi8(1));
}

// Row `index` of a grid of rows of 8 magnitudes, as 8 bytes.
inline long long grid_row8(const uint8_t* grid, int index) {
    long long v;
    memcpy(&v, grid + 8 * index, 8);
    return v;
}

// IQ1_S's step `sub`'s delta sign, +1 or -1 (its word's top bit)
inline int iq1_s_sign(const uint8_t* block, int sub) {
    return load_u16(block + IQ1_WORDS<IQ1_S> + 2 * sub) >> 15 ? -1 : 1;
}

// four rows of 8 bytes of `table` (a grid's, or SIGN_MASKS_OF_7_BITS'), at index (4 int32), by one gather
GRID_INLINE __m256i gathered_rows(const void* table, __m128i index) {
    return _mm256_i32gather_epi64((const long long*)table, index, 8);
}
GRID_INLINE __m256i rows_at(uint64_t r0, uint64_t r1, uint64_t r2, uint64_t r3) {
    return _mm256_setr_epi64x((long long)r0, (long long)r1, (long long)r2, (long long)r3);
}

// IQ1_S's and IQ1_M's step `sub` (32 values) of a block: where its 4 grid indices' low bytes are, and
// its word (IQ1_WORDS).
template <int VALUES>
GRID_INLINE const uint8_t* iq1_indices(const uint8_t* block, int sub) {
    return VALUES == IQ1_S ? block + 2 + 4 * sub : block + 4 * sub;
}
template <int VALUES>
GRID_INLINE uint32_t iq1_high(const uint8_t* block, int sub) {
    return load_u16(block + IQ1_WORDS<VALUES> + 2 * sub);
}

// The step's four grid rows (8 g for g -1, 0 or 1). GATHER: as `grid_step`'s.
template <int VALUES, bool GATHER = false>
GRID_INLINE __m256i iq1_rows(const uint8_t* block, int sub, const uint8_t* grid) {
    const uint8_t* q = iq1_indices<VALUES>(block, sub);
    const uint32_t high = iq1_high<VALUES>(block, sub);
    constexpr int FIELD = VALUES == IQ1_S ? 3 : 4;
    if constexpr (GATHER) {
        const __m128i high_bits = _mm_and_si128(  // row j's 3 bits moved to bits 8-10
            _mm_srlv_epi32(_mm_set1_epi32((int)(high << 8)), _mm_setr_epi32(0, FIELD, 2 * FIELD, 3 * FIELD)),
            _mm_set1_epi32(0x700));
        return gathered_rows(grid, _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)load_u32(q))), high_bits));
    }
    auto row = [&](int j) { return (uint64_t)grid_row8(grid, q[j] | (high >> (FIELD * j) & 7) << 8); };
    return rows_at(row(0), row(1), row(2), row(3));
}

// The step's deltas, +-1 a value (one sign for the 32 values (IQ1_S), one a row of 8 (IQ1_M)): its values
// times 8 are the rows plus these.
template <int VALUES>
GRID_INLINE __m256i iq1_deltas(const uint8_t* block, int sub) {
    if constexpr (VALUES == IQ1_S) return _mm256_set1_epi8((char)iq1_s_sign(block, sub));
    // row j's: -1 where bit 4 j + 3 is set, else +1, in each of its bytes
    const __m256i bits =
        _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(iq1_high<VALUES>(block, sub)),
                                           _mm256_setr_epi64x(3, 7, 11, 15)),
                         _mm256_set1_epi64x(1));
    return _mm256_or_si256(_mm256_cmpeq_epi64(bits, _mm256_set1_epi64x(1)), _mm256_set1_epi8(1));
}

// The masks of four rows of 8 from the four 7-bit sign fields of a word (IQ2_XXS's and IQ3_XXS's: row
// j's b-th sign at bit 7 j + b), each row's eighth sign the parity of its seven (SIGNS_OF_7_BITS): the
// seven tested in their bytes of the word as sign_masks_of_bits tests them, the eighth set where the
// row's count of the seven is odd. (Quicker than a gather of SIGN_MASKS_OF_7_BITS' rows on an Intel
// Xeon, Emerald Rapids; IQ2_XS's fields, one a 16-bit word, look theirs up.)
GRID_INLINE __m256i masks_of_word(uint32_t word) {
    // each value's byte of the word and its bit there (H: the top one); the eighth's byte a zero (Z: index
    // 0x80) and its bit NONE, which a zero never matches
    const char Z = (char)0x80, NONE = (char)0xFF, H = (char)0x80;
    const __m256i byte_of_value = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, Z, 0, 1, 1, 1, 1, 1, 1, Z,  //
                                                   1, 1, 2, 2, 2, 2, 2, Z, 2, 2, 2, 3, 3, 3, 3, Z);
    const __m256i bit_of_value = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, NONE, H, 1, 2, 4, 8, 16, 32, NONE,  //
                                                  64, H, 1, 2, 4, 8, 16, NONE, 32, 64, H, 1, 2, 4, 8, NONE);
    const __m256i seven = _mm256_cmpeq_epi8(
        _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)word), byte_of_value), bit_of_value),
        bit_of_value);
    const __m256i count = _mm256_sad_epu8(_mm256_and_si256(seven, _mm256_set1_epi8(1)), _mm256_setzero_si256());
    const __m256i odd = _mm256_cmpgt_epi64(_mm256_setzero_si256(), _mm256_slli_epi64(count, 63));
    return _mm256_or_si256(seven, _mm256_and_si256(odd, _mm256_set1_epi64x((long long)0xFF00000000000000ULL)));
}

// Step `sub` (32 values) of a block of a type whose grid holds magnitudes (IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S): its grid rows, the values' magnitudes (their signs: step_sign_masks, step_sign_bits).
// GATHER: the rows read by gather instructions, where the CPU's gathers are quicker than a load and an
// insert a row (int8_products.cpp decides); IQ3_S's 8 rows always.
template <int VALUES, bool GATHER = false>
GRID_INLINE __m256i step_magnitudes(const uint8_t* block, int sub, const uint8_t* grid) {
    auto row8 = [grid](int index) { return (uint64_t)grid_row8(grid, index); };
    if constexpr (VALUES == IQ2_XXS) {  // 4 index bytes, then a word of 4 x 7 sign bits and the code
        const uint8_t* q = block + 2 + 8 * sub;
        if constexpr (GATHER) return gathered_rows(grid, _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)load_u32(q))));
        return rows_at(row8(q[0]), row8(q[1]), row8(q[2]), row8(q[3]));
    } else if constexpr (VALUES == IQ2_XS) {  // 4 16-bit words: a 9-bit index and 7 sign bits
        if constexpr (GATHER) {
            const __m128i words = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)(block + 2 + 8 * sub)));
            return gathered_rows(grid, _mm_and_si128(words, _mm_set1_epi32(511)));
        }
        uint16_t w[4];
        memcpy(w, block + 2 + 8 * sub, 8);
        return rows_at(row8(w[0] & 511), row8(w[1] & 511), row8(w[2] & 511), row8(w[3] & 511));
    } else if constexpr (VALUES == IQ2_S) {  // 4 index bytes, 2 high bits each in qh, 4 sign bytes
        const uint8_t *q = block + 2 + 4 * sub, high = block[66 + sub];
        if constexpr (GATHER) {
            const __m128i high_bits = _mm_and_si128(
                _mm_sllv_epi32(_mm_set1_epi32(high), _mm_setr_epi32(8, 6, 4, 2)), _mm_set1_epi32(0x300));
            const __m128i index = _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)load_u32(q))), high_bits);
            return gathered_rows(grid, index);
        }
        auto index = [&](int j) { return q[j] | (high >> (2 * j) & 3) << 8; };
        return rows_at(row8(index(0)), row8(index(1)), row8(index(2)), row8(index(3)));
    } else if constexpr (VALUES == IQ3_XXS) {  // 8 index bytes; a word of signs and code after the block's indices
        const uint8_t* q = block + 2 + 8 * sub;
        if constexpr (GATHER) {
            const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
            return _mm256_i32gather_epi32((const int*)grid, index, 4);
        }
        auto row4 = [grid](int index) { return (int)load_u32(grid + 4 * index); };
        return _mm256_setr_epi32(row4(q[0]), row4(q[1]), row4(q[2]), row4(q[3]), row4(q[4]), row4(q[5]), row4(q[6]),
                                 row4(q[7]));
    } else {  // IQ3_S: 8 index bytes, a ninth bit each in qh (bit j moved to bit 8), 4 sign bytes
        static_assert(VALUES == IQ3_S);
        // (the 8 rows gathered in one instruction whatever GATHER: 1.7-1.9x faster than 8 loads and inserts
        // on an Intel Xeon with AVX-512)
        const uint8_t *q = block + 2 + 8 * sub, high = block[66 + sub];
        const __m256i shifts = _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1);
        const __m256i ninth =
            _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(high), shifts), _mm256_set1_epi32(256));
        const __m256i index = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q)), ninth);
        return _mm256_i32gather_epi32((const int*)grid, index, 4);
    }
}

// Where step `sub`'s signs are in its block: IQ2_XXS's and IQ3_XXS's word of 4 x 7 bits (and the code),
// IQ2_S's and IQ3_S's 4 bytes of 8, IQ2_XS's 4 index words (7 bits atop each)
template <int VALUES>
constexpr const uint8_t* step_signs(const uint8_t* block, int sub) {
    static_assert(VALUES >= IQ2_XXS && VALUES <= IQ3_S);
    if constexpr (VALUES == IQ2_XXS) return block + 2 + 8 * sub + 4;
    if constexpr (VALUES == IQ3_XXS) return block + 66 + 4 * sub;
    if constexpr (VALUES == IQ2_S) return block + 34 + 4 * sub;
    if constexpr (VALUES == IQ3_S) return block + 74 + 4 * sub;
    return block + 2 + 8 * sub;  // IQ2_XS
}

// The masks that negate step `sub`'s magnitudes: 0xFF where a value is negative
template <int VALUES>
GRID_INLINE __m256i step_sign_masks(const uint8_t* block, int sub) {
    const uint8_t* signs = step_signs<VALUES>(block, sub);
    if constexpr (VALUES == IQ2_XXS || VALUES == IQ3_XXS) {
        return masks_of_word(load_u32(signs));
    } else if constexpr (VALUES == IQ2_S || VALUES == IQ3_S) {
        return sign_masks_of_bits(load_u32(signs));
    } else {
        const uint64_t* masks7 = SIGN_MASKS_OF_7_BITS.data();
        uint16_t w[4];
        memcpy(w, signs, 8);
        return rows_at(masks7[w[0] >> 9], masks7[w[1] >> 9], masks7[w[2] >> 9], masks7[w[3] >> 9]);
    }
}

// Both for step `step` of the row `row`, the grid rows loaded one at a time
struct GridStep {
    __m256i magnitudes, minus;
};
template <int VALUES>
GRID_INLINE GridStep grid_step(const uint8_t* row, int step, const uint8_t* grid) {
    const uint8_t* block = row + (long)(step / 8) * grid_block_bytes(VALUES);
    const int sub = step % 8;  // the 32 values' place in the block
    return {step_magnitudes<VALUES>(block, sub, grid), step_sign_masks<VALUES>(block, sub)};
}

// The same signs as a word, bit i set where value i is negative, for AVX-512's byte-masked operations:
// IQ2_S's and IQ3_S's sign bytes as stored; IQ2_XXS's and IQ3_XXS's 4 x 7 bits, and IQ2_XS's 7 atop each
// index word, spread to a byte a row (BMI2's deposit and extract), each row's eighth the parity of its
// seven (SIGNS_OF_7_BITS). Scalar work beside the vector ports'.
template <int VALUES>
GRID_BMI2_INLINE uint32_t step_sign_bits(const uint8_t* block, int sub) {
    const uint8_t* signs = step_signs<VALUES>(block, sub);
    if constexpr (VALUES == IQ2_S || VALUES == IQ3_S) {
        return load_u32(signs);
    } else {
        uint32_t fields;  // row j's 7 signs at bit 7 j
        if constexpr (VALUES == IQ2_XS) {
            uint64_t words;
            memcpy(&words, signs, 8);
            fields = (uint32_t)_pext_u64(words, 0xFE00FE00FE00FE00ULL);
        } else {
            fields = load_u32(signs);
        }
        const uint32_t seven = _pdep_u32(fields, 0x7F7F7F7F);
        uint32_t parity = seven ^ seven >> 4;  // each byte's bits folded onto its lowest
        parity ^= parity >> 2;
        parity ^= parity >> 1;
        return seven | (parity & 0x01010101) << 7;
    }
}

// Step `step` (32 values) of a grid type's row `row`: the signed values as bytes, in order.
template <int VALUES>
GRID_INLINE __m256i grid_lanes(const uint8_t* row, int step, const uint8_t* grid) {
    if constexpr (VALUES == IQ1_S || VALUES == IQ1_M) {
        const uint8_t* block = row + (long)(step / 8) * grid_block_bytes(VALUES);
        return _mm256_add_epi8(iq1_rows<VALUES>(block, step % 8, grid), iq1_deltas<VALUES>(block, step % 8));
    } else if constexpr (VALUES == TQ1_0) {
        return ternary_lanes(row + (long)(step / 8) * grid_block_bytes(VALUES), step % 8);
    } else {
        const GridStep parts = grid_step<VALUES>(row, step, grid);
        return negated(parts.magnitudes, parts.minus);
    }
}

#undef GRID_INLINE
#undef GRID_BMI2_INLINE

}  // namespace mlx_hybrid::gguf_grid
