/* GGUF blocks into the layout the package holds them in (loaders/quantized.py: the block form of
 * quantized_tensor.BlockScales), at the speed of memory: a loader's only pass over a file's weights.
 *
 * For each block of a type: its values as unsigned integers, packed as MLX's little-endian bit
 * stream (each 8 values fill `bits` bytes); its factors as stored (float16 bits, MXFP4's E8M0
 * bytes; d and -dmin for the types with a minimum); its per-group codes (int8). A tensor's rows are
 * whole blocks, so the three outputs are the blocks' parts one after another. The numpy parsers in
 * loaders/quantized.py define each type's parts and are this code's reference (tests compare
 * them byte for byte).
 *
 * Plain C, no intrinsics: it builds with any compiler on any CPU (a Mac's included). Callers split
 * a tensor's blocks over threads; each call is independent.
 */
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#endif

/* ggml's type numbers (enum ggml_type), the file's own */
enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
            IQ4_NL = 20, IQ4_XS = 23, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39 };

/* count values (a multiple of 8) of `bits` bits each into MLX's bit stream at out */
static inline __attribute__((always_inline)) void pack_bits(const uint8_t *q, int count, int bits, uint8_t *out) {
    for (int i = 0; i < count; i += 8, out += bits) {
        uint64_t word = 0;
        for (int j = 0; j < 8; j++) word |= (uint64_t)q[i + j] << (j * bits);
        memcpy(out, &word, (size_t)bits);  /* little-endian: the low bytes */
    }
}

static void pack(const uint8_t *q, int count, int bits, uint8_t *out) {
    switch (bits) {  /* each width a loop of its own, unrolled with its constant shifts */
    case 2: pack_bits(q, count, 2, out); break;
    case 3: pack_bits(q, count, 3, out); break;
    case 4: pack_bits(q, count, 4, out); break;
    case 5: pack_bits(q, count, 5, out); break;
    case 6: pack_bits(q, count, 6, out); break;
    case 8: pack_bits(q, count, 8, out); break;
    }
}

/* 4-bit values held as runs of `run_bytes` bytes, a run's low nibbles its first values and its high
 * nibbles the rest, straight into MLX's stream (two values a byte, the even one low): what nibbles()
 * and pack() give, without a byte a value between them (Q4_K's blocks, two threads, alternated three
 * times: 4.3-4.6 GB/s through them, 5.9-12.7 without) */
static void nibble_runs(const uint8_t *bytes, int run_bytes, int runs, uint8_t *packed) {
    for (int r = 0; r < runs; r++, bytes += run_bytes, packed += run_bytes)
        for (int i = 0; i < run_bytes / 2; i++) {
            const uint8_t even = bytes[2 * i], odd = bytes[2 * i + 1];
            packed[i] = (uint8_t)((even & 15) | (odd << 4));
            packed[run_bytes / 2 + i] = (uint8_t)((even >> 4) | (odd & 0xF0));
        }
}

static void nibbles(const uint8_t *bytes, int count, uint8_t *q) {  /* low nibbles first */
    for (int i = 0; i < count; i++) {
        q[i] = bytes[i] & 15;
        q[count + i] = bytes[i] >> 4;
    }
}

/* Q2_K's, Q3_K's and TQ2_0's low bits: two halves of 128 values, 32 bytes each; bit pair r of
 * byte i is value i of run r */
static void two_bit_runs(const uint8_t *qs, uint8_t *q) {
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 32; i++) q[h * 128 + r * 32 + i] = (qs[h * 32 + i] >> (2 * r)) & 3;
}

static void negated_f16(const uint8_t *from, uint8_t *to) {  /* -x of a float16: its sign bit */
    to[0] = from[0];
    to[1] = from[1] ^ 0x80;
}

/* Q4_K and Q5_K: factors d and -dmin, codes (sc_j, m_j) of the 8 sub-blocks */
static void k_factors_and_codes(const uint8_t *b, uint8_t *factors, int8_t *codes) {
    const uint8_t *s = b + 4;
    memcpy(factors, b, 2);
    negated_f16(b + 2, factors + 2);
    for (int j = 0; j < 8; j++) {
        int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 48);
        int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 48);
        codes[2 * j] = (int8_t)sc;
        codes[2 * j + 1] = (int8_t)m;
    }
}

/* one block: its factors and codes, and its values into q (256 at most; returns 0) or, for the 4-bit
 * types and Q8_0, packed already (returns 1); -1 for a type it does not know */
static int parse(int type, const uint8_t *b, uint8_t *q, uint8_t *packed, uint8_t *factors, int8_t *codes) {
    switch (type) {
    case Q8_0:  /* q + 128, MLX's 8-bit stream as it is */
        memcpy(factors, b, 2);
        for (int i = 0; i < 32; i++) packed[i] = (uint8_t)(b[2 + i] ^ 0x80);
        codes[0] = 1;
        return 1;
    case Q4_0:
    case IQ4_NL:  /* indices into IQ4_NL's values, laid out as Q4_0's */
        memcpy(factors, b, 2);
        nibble_runs(b + 2, 16, 1, packed);
        codes[0] = 1;
        return 1;
    case Q4_1:
        memcpy(factors, b, 4);
        nibble_runs(b + 4, 16, 1, packed);
        codes[0] = 1;
        return 1;
    case Q5_0:
    case Q5_1: {
        int has_m = type == Q5_1;
        memcpy(factors, b, has_m ? 4 : 2);
        const uint8_t *qh = b + (has_m ? 4 : 2);
        nibbles(qh + 4, 16, q);
        for (int i = 0; i < 32; i++) q[i] |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
        codes[0] = 1;
        break;
    }
    case Q4_K:
    case Q5_K: {
        k_factors_and_codes(b, factors, codes);
        const uint8_t *qh = b + 16, *qs = b + (type == Q5_K ? 48 : 16);
        if (type == Q4_K) {  /* 4 chunks of 32 bytes: sub-blocks 2c (low nibbles), 2c + 1 */
            nibble_runs(qs, 32, 4, packed);
            return 1;
        }
        for (int c = 0; c < 4; c++) nibbles(qs + 32 * c, 32, q + 64 * c);  /* Q5_K's low 4 bits, as Q4_K's */
        for (int j = 0; j < 8; j++)  /* bit j of qh[i]: the high bit of value i of sub-block j */
            for (int i = 0; i < 32; i++) q[32 * j + i] |= ((qh[i] >> j) & 1) << 4;
        break;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        /* each half of 128 values: four runs of 32, the low nibbles of ql's two runs, then their high
         * nibbles, with bit pairs 0-1, 2-3, 4-5, 6-7 of qh */
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 4; r++)
                for (int i = 0; i < 32; i++) {
                    uint8_t low = ql[64 * h + 32 * (r & 1) + i];
                    low = r < 2 ? low & 15 : low >> 4;
                    q[128 * h + 32 * r + i] = low | (((qh[32 * h + i] >> (2 * r)) & 3) << 4);
                }
        memcpy(codes, b + 192, 16);
        memcpy(factors, b + 208, 2);
        break;
    }
    case Q2_K:
        memcpy(codes, b, 16);  /* a group's code in the low nibble, its min in the high one */
        two_bit_runs(b + 16, q);
        memcpy(factors, b + 80, 2);
        negated_f16(b + 82, factors + 2);
        break;
    case Q3_K: {
        const uint8_t *hmask = b, *packed = b + 96;
        two_bit_runs(b + 32, q);
        for (int j = 0; j < 8; j++)  /* bit j of hmask[i]: the third bit of value i of run j */
            for (int i = 0; i < 32; i++) q[32 * j + i] |= ((hmask[i] >> j) & 1) << 2;
        for (int k = 0; k < 16; k++) {  /* 6-bit codes offset by 32: a low nibble, two high bits */
            int low = k < 8 ? packed[k] & 15 : packed[k - 8] >> 4;
            int high = (packed[8 + k % 4] >> (2 * (k / 4))) & 3;
            codes[k] = (int8_t)((low | (high << 4)) - 32);
        }
        memcpy(factors, b + 108, 2);
        break;
    }
    case IQ4_XS: {
        uint16_t scales_h = (uint16_t)(b[2] | (b[3] << 8));
        memcpy(factors, b, 2);
        for (int g = 0; g < 8; g++) {
            int low = (b[4 + g / 2] >> (4 * (g % 2))) & 15;
            codes[g] = (int8_t)((low | (((scales_h >> (2 * g)) & 3) << 4)) - 32);
        }
        nibble_runs(b + 8, 16, 8, packed);
        return 1;
    }
    case MXFP4:  /* an E8M0 exponent, then 16 bytes of 4-bit values as Q4_0's */
        factors[0] = b[0];
        nibble_runs(b + 1, 16, 1, packed);
        return 1;
    case TQ2_0:
        two_bit_runs(b, q);
        memcpy(factors, b + 64, 2);
        break;
    case TQ1_0: {
        /* base 3, five values a byte: value i of byte c is ((c 3^i mod 256) 3) >> 8; the first 32
         * bytes hold 160 values, the next 16 bytes 80, the 4 bytes of qh 16 */
        static const uint8_t powers[5] = {1, 3, 9, 27, 81};
        const int starts[3] = {0, 32, 48}, sizes[3] = {32, 16, 4}, counts[3] = {5, 5, 4};
        int at = 0;
        for (int f = 0; f < 3; f++)
            for (int i = 0; i < counts[f]; i++)
                for (int c = 0; c < sizes[f]; c++)
                    q[at++] = (uint8_t)(((uint16_t)(uint8_t)(b[starts[f] + c] * powers[i]) * 3) >> 8);
        memcpy(factors, b + 52, 2);
        break;
    }
    default:
        return -1;
    }
    return 0;
}

/* Maps the whole pages of [at, at + bytes) in one call where Linux can (5.14 and later; elsewhere,
 * or on failure, each page's first write faults it in): in a VM a fault a page costs about as much
 * as the unpacking. */
static void populate(void *at, int64_t bytes) {
#ifdef __linux__
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), start = ((uintptr_t)at + page - 1) / page * page;
    uintptr_t end = ((uintptr_t)at + (uintptr_t)bytes) / page * page;
    if (end > start) madvise((void *)start, end - start, MADV_POPULATE_WRITE);
#else
    (void)at;
    (void)bytes;
#endif
}

/* Blocks [count, block_bytes] of `type` into `weight` (values_per_block * bits / 8 bytes a block),
 * `factors` (factor_bytes a block) and `codes` (code_bytes a block). Returns 0, or -1 for a type
 * or width it does not know. */
int mlx_hybrid_unpack_blocks(int type, const uint8_t *blocks, int64_t count, int block_bytes, int values, int bits,
                             uint8_t *weight, uint8_t *factors, int factor_bytes, int8_t *codes, int code_bytes) {
    if (bits < 2 || bits > 8 || bits == 7) return -1;
    populate(weight, count * (values * bits / 8));
    populate(factors, count * factor_bytes);
    populate(codes, count * code_bytes);
    uint8_t q[256];
    for (int64_t n = 0; n < count; n++) {
        uint8_t *packed = weight + n * (values * bits / 8);
        const int parsed = parse(type, blocks + n * block_bytes, q, packed, factors + n * factor_bytes,
                                 codes + n * code_bytes);
        if (parsed < 0) return -1;
        if (parsed == 0) pack(q, values, bits, packed);
    }
    return 0;
}
