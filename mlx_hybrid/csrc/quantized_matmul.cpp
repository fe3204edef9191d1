// Quantized products for MLX's CPU backend: x @ W^T with W in MLX's affine layout
// (w = scale * q + bias per group of `group_size` values along a row, q an unsigned
// `bits`-bit integer, 2 to 8 bits, packed as a little-endian bit stream), read as it is
// stored; or q a 4-bit index into a table of 16 values (IQ4_NL's); or GGUF's grid types' blocks
// as the file stores them, decoded a step at a time (see "GGUF's grid types"); or W
// bfloat16 or float16, read as 16 bits, its products and sums float32.
//
// MLX's own CPU quantized matmul is a reference loop, many times slower for a decode step
// (benchmarks/quantized_cpu.py). This extension registers an MLX primitive with two paths:
// - up to 16 rows (decode steps, speculative verify passes): one pass over W for each 8 rows,
//   each step of packed values unpacked once for those rows, over a small thread pool;
// - more rows (prefill): tiles of W dequantized into a float buffer, then one BLAS sgemm a
//   tile (the BLAS MLX itself calls: OpenBLAS where mlx_hybrid loaded it).
// Values are visited in "lane order": a step of 8 * U values puts values l*U .. l*U+U-1
// in lane l (U values per 32-bit lane), which AVX2 unpacks without crossing lanes. Both
// paths permute x the same way; a dot product does not care about the order of its terms,
// only its rounding does, and that order is fixed: each output is the same sequence of
// FMAs into 8 lanes, reduced by a fixed tree, whatever rows come with it.
//
// For x86-64 with AVX2, FMA and F16C (`supported()`); the same body is compiled a second
// time for AVX-512 machines and chosen at run time. Part of the CPU kernels' module (see
// cpu_kernels.h); each variant checks itself on its first call.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "cpu_kernels.h"
#include "gguf_grid.h"

// The BLAS sgemm MLX calls, resolved as MLX's own is: OpenBLAS (behind the forwarding
// library) where mlx_hybrid opened it into the global scope, else MLX's BLAS.
extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                            int);

namespace nb = nanobind;
namespace mx = mlx::core;
using mlx_hybrid::Pool;
using namespace mlx_hybrid::gguf_grid;

namespace {

constexpr int SMALL_ROWS = 8;  // the small-row kernel's most rows at a time
// Products of up to this many rows (decode steps, verify passes of up to 15 drafts) run the
// small-row kernel, SMALL_ROWS rows at a time: each row gets the bits it gets alone.
constexpr int ROW_INVARIANT_ROWS = 16;

// Products with fewer weights than this run on the calling thread: waking a helper costs
// more than it saves.
constexpr long PARALLEL_MIN_WEIGHTS = 1L << 18;

// ---------------------------------------------------------------------------------------
// The packed layout, per bit width.

constexpr int values_per_lane(int bits) { return bits == 4 ? 8 : bits == 16 ? 2 : 4; }

template <int BITS>
struct Packing {
    static constexpr int U = values_per_lane(BITS);  // values per 32-bit lane
    static constexpr int V = 8 * U;                  // values per step
    static constexpr int STEP_BYTES = V * BITS / 8;
    // what load_lanes reads
    static constexpr int READ_BYTES = BITS == 4 || BITS == 8 || BITS == 16 ? 32 : 2 * BITS + 16;
    static constexpr int MASK = (1 << BITS) - 1;
};

// float32 scales or biases from their stored dtype
enum ScaleType { F32 = 0, F16 = 1, BF16 = 2 };

// GGUF's two-level scales (mlx_hybrid.quantized_tensor.BlockScales): group g's scale is
// factor[g / groups_per_factor][0] * code[g][0]; its bias factor[..][1] * code[g][last]
// with two factors, else bias_ratio * scale. groups_per_factor 0: plain per-group scales.
// code_count 0: no codes (each is 1). code_bits 4: a group's two codes are unsigned nibbles
// of one byte, low nibble first. factor_scale: a power of two the factors are multiplied by.
// table: the values 4-bit indices stand for (Values TABLE). Factors are float16, or with
// exponent_factors E8M0 bytes e standing for 2^(e - 127) (MXFP4's scales; e = 0: 2^-127).
struct BlockLayout {
    int groups_per_factor = 0, factor_count = 0, code_count = 0, code_bits = 8;
    float bias_ratio = 0.0f, factor_scale = 1.0f;
    bool exponent_factors = false;
    std::array<uint8_t, 16> table{};
    bool operator==(const BlockLayout&) const = default;
};

// A weight matrix [N, K] (or one expert's), with its row strides.
struct Weights {
    const uint8_t* q;       // packed values (grid types: the blocks)
    const uint8_t* scales;  // per group in scale_type; block form: factors (float16 or E8M0)
    const uint8_t* biases;  // per group in scale_type; block form: int8 codes (or none)
    long q_row_bytes, scale_row_bytes, bias_row_bytes;  // strides between rows
    int n, k, group_size, scale_type;
    BlockLayout blocks;
    const uint8_t* grid = nullptr;  // grid types: the magnitudes of each index
};

// Where the rows of one product live: x rows (permuted into lane order, K padded to
// whole steps) and output rows.
struct Rows {
    int m;
    const float* const* x;
    const float* const* group_sums;  // per row: the sum of x over each group (padded_groups)
    float* const* out;
};

int step_values(int bits) { return 8 * values_per_lane(bits); }

// Scales, biases and group sums per row, as float32 buffers: whole steps, one group more
// (4-bit steps span two groups of 32), whole vectors of 8.
int padded_groups(int k, int bits, int group_size) {
    int v = step_values(bits), padded = (k + v - 1) / v * v;
    return (padded / group_size + 1 + 7) / 8 * 8;
}

}  // namespace

// The body, compiled once per instruction set (AVX2 + FMA, and AVX-512).
#define KERNEL_TARGET "avx2,fma,f16c"
#define KERNEL_NS avx2
#include "quantized_matmul_body.inc"
#undef KERNEL_TARGET
#undef KERNEL_NS
#define KERNEL_TARGET AVX512_TARGET
#define KERNEL_NS avx512
#define KERNEL_WIDE
#include "quantized_matmul_body.inc"
#undef KERNEL_TARGET
#undef KERNEL_NS
#undef KERNEL_WIDE

namespace {

struct Isa {
    void (*product)(const Weights&, const Rows&, int, int);
    void (*dequantize)(const Weights&, int, int, float*, int);
};

// The instruction sets of the builds, each including the ones before it.
enum Level { AVX2 = 0, AVX512 = 1 };
const char* const LEVEL_NAMES[] = {"avx2", "avx512"};

Level cpu_level() {
    static const Level level = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                                       __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                                       __builtin_cpu_supports("bmi2")
                                   ? AVX512
                                   : AVX2;
    return level;
}

// The build in use: the CPU's best, or one below it that use_instruction_set chose (tests
// compare the builds on one machine).
std::atomic<int> chosen_level{-1};

template <int BITS, int VALUES = INTEGERS>
Isa isa_for(Level level) {
    if (level == AVX512) return {avx512::rows_product<BITS, VALUES>, avx512::dequantize_rows<BITS, VALUES>};
    return {avx2::rows_product<BITS, VALUES>, avx2::dequantize_rows<BITS, VALUES>};
}

Level level_in_use() {
    const int chosen = chosen_level.load(std::memory_order_relaxed);
    return chosen < 0 ? cpu_level() : (Level)chosen;
}

// The kernels for `bits`-bit values standing for `values`.
Isa isa(int bits, Values values) {
    const Level level = level_in_use();
    if (values == TABLE && bits == 4) return isa_for<4, TABLE>(level);
    if (values == BFLOAT16 && bits == 16) return isa_for<16, BFLOAT16>(level);
    if (values == FLOAT16 && bits == 16) return isa_for<16, FLOAT16>(level);
    if (bits == 8) switch (values) {  // the grid types: each step decoded to 32 signed bytes
            case IQ2_XXS: return isa_for<8, IQ2_XXS>(level);
            case IQ2_XS: return isa_for<8, IQ2_XS>(level);
            case IQ2_S: return isa_for<8, IQ2_S>(level);
            case IQ3_XXS: return isa_for<8, IQ3_XXS>(level);
            case IQ3_S: return isa_for<8, IQ3_S>(level);
            case IQ1_S: return isa_for<8, IQ1_S>(level);
            case IQ1_M: return isa_for<8, IQ1_M>(level);
            case TQ1_0: return isa_for<8, TQ1_0>(level);
        }
    if (values != INTEGERS) throw std::invalid_argument("quantized_matmul: values that do not fit the bits");
    switch (bits) {
        case 2: return isa_for<2>(level);
        case 3: return isa_for<3>(level);
        case 4: return isa_for<4>(level);
        case 5: return isa_for<5>(level);
        case 6: return isa_for<6>(level);
        case 8: return isa_for<8>(level);
    }
    throw std::invalid_argument("quantized_matmul: bits must be 2, 3, 4, 5, 6 or 8");
}

// x [k] -> lane order over `padded` values: out[s*V + i*8 + l] = x[s*V + l*U + i], 0 past k
void permute_row(const float* x, int k, int padded, int bits, float* out) {
    int u = values_per_lane(bits), v = 8 * u;
    for (int s = 0; s < padded; s += v)
        for (int i = 0; i < u; i++)
            for (int l = 0; l < 8; l++) {
                int src = s + l * u + i;
                out[s + i * 8 + l] = src < k ? x[src] : 0.0f;
            }
}

// One product: out rows = x rows @ W^T.
void product(const Weights& w, const Rows& rows, int bits, Values values, int padded) {
    Pool& pool = Pool::get();
    Isa kernels = isa(bits, values);
    bool parallel = (long)w.n * w.k >= PARALLEL_MIN_WEIGHTS;
    if (rows.m <= ROW_INVARIANT_ROWS) {
        int parts = parallel ? pool.threads() * 4 : 1;
        for (int first = 0; first < rows.m; first += SMALL_ROWS) {
            Rows some{std::min(SMALL_ROWS, rows.m - first), rows.x + first, rows.group_sums + first, rows.out + first};
            pool.run(parts, parallel, [&](int part) {
                int start = (int)((long)w.n * part / parts), end = (int)((long)w.n * (part + 1) / parts);
                kernels.product(w, some, start, end);
            });
        }
        return;
    }
    // x rows gathered into one [m, padded] matrix for the BLAS
    std::vector<float> x((size_t)rows.m * padded);
    for (int r = 0; r < rows.m; r++) memcpy(&x[(size_t)r * padded], rows.x[r], sizeof(float) * padded);
    int tile = std::max(64, (1 << 20) / padded);  // about 4 MB of float32 weights
    tile = std::min(tile, w.n);
    std::vector<float> dense((size_t)tile * padded), result((size_t)rows.m * tile);
    for (int start = 0; start < w.n; start += tile) {
        int count = std::min(tile, w.n - start);
        int parts = parallel ? pool.threads() : 1;
        pool.run(parts, parallel, [&](int part) {
            int a = count * part / parts, b = count * (part + 1) / parts;
            kernels.dequantize(w, start + a, start + b, &dense[(size_t)a * padded], padded);
        });
        // row major: result[m, count] = x[m, padded] @ dense[count, padded]^T
        cblas_sgemm(101, 111, 112, rows.m, count, padded, 1.0f, x.data(), padded, dense.data(), padded, 0.0f,
                     result.data(), count);
        for (int r = 0; r < rows.m; r++)
            memcpy(rows.out[r] + start, &result[(size_t)r * count], sizeof(float) * count);
    }
}

// ---------------------------------------------------------------------------------------
// The MLX primitive.

// A product's parameters; pairs_per_x_row: with expert indices, product p takes x row
// p / pairs_per_x_row.
struct Product {
    int group_size, bits;
    Values values;
    BlockLayout blocks;
    bool gathered;
    int pairs_per_x_row;
    bool operator==(const Product&) const = default;
};

void compute(const Product& params, const std::vector<mx::array>& in, std::vector<mx::array>& outputs) {
    auto [group_size, bits, values, blocks, gathered, per_x] = params;
    mx::array& out = outputs[0];
    const mx::array &x = in[0], &q = in[1], &scales = in[2], &biases = in[3];
    int k = (int)x.shape(-1), n = (int)out.shape(-1);
    int m = (int)(out.size() / n);
    int v = step_values(bits), padded = (k + v - 1) / v * v;
    int scale_type = scales.dtype() == mx::float32 ? F32 : scales.dtype() == mx::float16 ? F16 : BF16;
    long q_row_bytes = is_grid(values) ? (long)k / 256 * grid_block_bytes(values) : (long)k * bits / 8;
    const uint8_t* grid = is_grid(values) ? in.back().data<uint8_t>() : nullptr;
    long scale_row_bytes = scales.shape(-1) * (long)scales.itemsize();
    long bias_row_bytes = biases.shape(-1) * (long)biases.itemsize();

    float* result = out.data<float>();
    // x rows in lane order
    int x_rows = (int)(x.size() / k);
    int groups_padded = padded_groups(k, bits, group_size);
    // aligned (rows of whole steps and of whole vectors stay so), zeros
    mlx_hybrid::LineVector<float> buffer;
    float* permuted = mlx_hybrid::aligned_floats(buffer, (size_t)x_rows * (padded + groups_padded));
    float* group_sums = permuted + (size_t)x_rows * padded;
    for (int r = 0; r < x_rows; r++) {
        const float* row = x.data<float>() + (long)r * k;
        permute_row(row, k, padded, bits, &permuted[(size_t)r * padded]);
        if (bits != 16 && !is_grid(values))  // (16-bit weights and the grid types have no biases)
            for (int i = 0; i < k; i++) group_sums[(size_t)r * groups_padded + i / group_size] += row[i];
    }
    std::vector<const float*> xs, sums;
    std::vector<float*> outs;
    auto add_row = [&](int x_row, int out_row) {
        xs.push_back(&permuted[(size_t)x_row * padded]);
        sums.push_back(&group_sums[(size_t)x_row * groups_padded]);
        outs.push_back(result + (long)out_row * n);
    };
    auto weights_of = [&](long expert) {
        long row = expert * n;
        return Weights{q.data<uint8_t>() + row * q_row_bytes,
                       scales.data<uint8_t>() + row * scale_row_bytes,
                       biases.data<uint8_t>() + row * bias_row_bytes,
                       q_row_bytes,
                       scale_row_bytes,
                       bias_row_bytes,
                       n,
                       k,
                       group_size,
                       scale_type,
                       blocks,
                       grid};
    };
    auto run = [&](long expert) {
        product(weights_of(expert), Rows{(int)xs.size(), xs.data(), sums.data(), outs.data()}, bits,
                values, padded);
        xs.clear(), sums.clear(), outs.clear();
    };

    if (!gathered) {
        for (int r = 0; r < m; r++) add_row(r, r);
        return run(0);
    }
    // each expert once, with every product that selected it (a token selects an expert
    // at most once, so a verify pass of up to 16 tokens stays on the row-invariant path)
    const mx::array& indices = in[4];
    long experts = q.shape(0);
    std::vector<std::vector<int>> chosen(experts);
    const uint32_t* index = indices.data<uint32_t>();
    for (int p = 0; p < m; p++) {
        if (index[p] >= experts) throw std::out_of_range("quantized_matmul: expert index out of range");
        chosen[index[p]].push_back(p);
    }
    for (long e = 0; e < experts; e++) {
        if (chosen[e].empty()) continue;
        for (int p : chosen[e]) add_row(p / per_x, p);
        run(e);
    }
}

using AffineQuantizedMatmul = mlx_hybrid::CpuPrimitive<Product, compute>;

std::shared_ptr<AffineQuantizedMatmul> primitive(mx::Stream stream, Product product) {
    return std::make_shared<AffineQuantizedMatmul>(stream, product, "AffineQuantizedMatmul");
}

// The layout of a block form's factors (float16, or uint8 E8M0 exponents) and codes (int8), checked
// against their shapes.
BlockLayout block_layout(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                         int bits, int groups_per_factor, int factor_count, int code_count, int code_bits,
                         float bias_ratio, float factor_scale, const std::vector<uint8_t>& table) {
    if (!table.empty() && (groups_per_factor == 0 || bits != 4 || table.size() != 16))
        throw std::invalid_argument("quantized_matmul: a table of 16 values comes with 4-bit values in a block form");
    if (groups_per_factor == 0) return {};
    long groups = w.shape(-1) * 32L / bits / group_size;
    if (groups_per_factor < 0 || groups % groups_per_factor || factor_count < 1 || factor_count > 2 ||
        code_count < 0 || code_count > 2 || (code_count == 0 && factor_count != 1) ||
        (code_bits != 8 && !(code_bits == 4 && code_count == 2)) ||
        (scales.dtype() != mx::float16 && !(scales.dtype() == mx::uint8 && factor_count == 1)) ||
        biases.dtype() != mx::int8 ||
        scales.shape(-1) != groups / groups_per_factor * factor_count ||
        biases.shape(-1) != groups * code_count * code_bits / 8)
        throw std::invalid_argument("quantized_matmul: factors and codes that do not fit the block layout");
    int exponent;
    if (factor_scale <= 0 || std::frexp(factor_scale, &exponent) != 0.5f)
        throw std::invalid_argument("quantized_matmul: factor_scale must be a power of two");
    BlockLayout layout{groups_per_factor, factor_count, code_count, code_bits, bias_ratio, factor_scale,
                       scales.dtype() == mx::uint8};
    std::copy(table.begin(), table.end(), layout.table.begin());
    return layout;
}


// The 16-bit weights' values; no scales or biases (empty inputs).
Values float_values(const mx::array& w) {
    if (w.dtype() == mx::bfloat16) return BFLOAT16;
    if (w.dtype() == mx::float16) return FLOAT16;
    throw std::invalid_argument("matmul_16bit: weights must be bfloat16 or float16");
}
constexpr int FLOAT_GROUP = 64;  // 16-bit weights have no groups; the kernel's arithmetic wants one

// x's width against W's (bits-bit values packed into uint32 words, 16-bit values, or a grid
// type's blocks of 256 values)
void check_width(const mx::array& x, const mx::array& w, int bits, Values values) {
    long columns = is_grid(values) ? w.shape(-1) / grid_block_bytes(values) * 256
                   : bits == 16    ? w.shape(-1)
                                   : w.shape(-1) * 32L / bits;
    if (x.shape(-1) != columns)
        throw std::invalid_argument("quantized_matmul: x has " + std::to_string(x.shape(-1)) +
                                    " columns, the weights " + std::to_string(columns));
}

// x [..., K] @ W^T. Float32 result [..., N].
// (extra: inputs after the product's own, a grid type's grid)
mx::array product_of(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int group_size, int bits, Values values, BlockLayout blocks, std::vector<mx::array> extra = {}) {
    check_width(x, w, bits, values);
    auto stream = mx::default_stream(mx::Device::cpu);
    auto shape = x.shape();
    shape.back() = (int)w.shape(-2);
    std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream), w, scales, biases};
    inputs.insert(inputs.end(), extra.begin(), extra.end());
    return mx::array(shape, mx::float32, primitive(stream, {group_size, bits, values, blocks, false, 1}), inputs);
}

// x [T, Kx, D] (Kx 1 or k), expert indices [T, k]; W [E, N, ...] -> float32 [T, k, N]
mx::array gathered_product_of(const mx::array& x, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, const mx::array& indices, int group_size, int bits,
                              Values values, BlockLayout blocks, std::vector<mx::array> extra = {}) {
    check_width(x, w, bits, values);
    auto stream = mx::default_stream(mx::Device::cpu);
    int t = (int)indices.shape(0), k = (int)indices.shape(1), n = (int)w.shape(-2);
    int per_x = x.shape(1) == k ? 1 : k;
    std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream), w, scales, biases,
                                  mx::astype(indices, mx::uint32, stream)};
    inputs.insert(inputs.end(), extra.begin(), extra.end());
    return mx::array({t, k, n}, mx::float32, primitive(stream, {group_size, bits, values, blocks, true, per_x}),
                     inputs);
}

// W [N, K*bits/32] uint32, scales/biases [N, K/group_size] (block form: factors and codes, see BlockLayout)
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, int groups_per_factor, int factor_count, int code_count,
                           int code_bits, float bias_ratio, float factor_scale, const std::vector<uint8_t>& table) {
    auto blocks = block_layout(w, scales, biases, group_size, bits, groups_per_factor, factor_count, code_count,
                               code_bits, bias_ratio, factor_scale, table);
    return product_of(x, w, scales, biases, group_size, bits, table.empty() ? INTEGERS : TABLE, blocks);
}

mx::array gather_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const mx::array& biases, const mx::array& indices, int group_size, int bits,
                                  int groups_per_factor, int factor_count, int code_count, int code_bits,
                                  float bias_ratio, float factor_scale, const std::vector<uint8_t>& table) {
    auto blocks = block_layout(w, scales, biases, group_size, bits, groups_per_factor, factor_count, code_count,
                               code_bits, bias_ratio, factor_scale, table);
    return gathered_product_of(x, w, scales, biases, indices, group_size, bits, table.empty() ? INTEGERS : TABLE,
                               blocks);
}

mx::array no_scales() { return mx::zeros({0}, mx::float32); }

// x [..., K] @ W^T for W [N, K] bfloat16 or float16: float32 products and sums
mx::array matmul_16bit(const mx::array& x, const mx::array& w) {
    return product_of(x, w, no_scales(), no_scales(), FLOAT_GROUP, 16, float_values(w), {});
}

mx::array gather_matmul_16bit(const mx::array& x, const mx::array& w, const mx::array& indices) {
    return gathered_product_of(x, w, no_scales(), no_scales(), indices, FLOAT_GROUP, 16, float_values(w), {});
}

// A grid type by its GGUF name, with its grid checked against it.
Values grid_values(const std::string& type_name, const mx::array& blocks, const mx::array& grid) {
    const char* names[] = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0"};
    for (int i = 0; i < 8; i++) {
        if (type_name != names[i]) continue;
        Values values = (Values)(GRID_FIRST + i);
        if (blocks.dtype() != mx::uint8 || blocks.shape(-1) % grid_block_bytes(values))
            throw std::invalid_argument("grid_matmul: " + type_name + " blocks must be uint8 rows of whole " +
                                        std::to_string(grid_block_bytes(values)) + "-byte blocks");
        if (grid.dtype() != mx::uint8 || grid.size() != (size_t)GRID_ENTRIES[i] * grid_magnitudes(values))
            throw std::invalid_argument("grid_matmul: " + type_name + "'s grid must be uint8 [" +
                                        std::to_string(GRID_ENTRIES[i]) + ", " +
                                        std::to_string(grid_magnitudes(values)) + "]");
        return values;
    }
    throw std::invalid_argument("grid_matmul: not a grid type: " + type_name);
}

// x [..., K] @ W^T for W [N, K] of a grid type, as its blocks [N, K / 256 * block bytes]
mx::array grid_matmul(const mx::array& x, const mx::array& blocks, const mx::array& grid,
                      const std::string& type_name) {
    Values values = grid_values(type_name, blocks, grid);
    return product_of(x, blocks, no_scales(), no_scales(), grid_group_size(values), 8, values, {},
                      {grid});
}

mx::array gather_grid_matmul(const mx::array& x, const mx::array& blocks, const mx::array& grid,
                             const mx::array& indices, const std::string& type_name) {
    Values values = grid_values(type_name, blocks, grid);
    return gathered_product_of(x, blocks, no_scales(), no_scales(), indices, grid_group_size(values), 8, values, {},
                               {grid});
}

}  // namespace

bool mlx_hybrid::avx512_in_use() { return level_in_use() == AVX512; }
bool mlx_hybrid::avx512_vbmi_in_use() {
    static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
    return vbmi && avx512_in_use();
}
bool mlx_hybrid::avx512_vnni_in_use() {
    static const bool vnni = __builtin_cpu_supports("avx512vnni");
    return vnni && avx512_in_use();
}

void mlx_hybrid::bind_quantized_matmul(nb::module_& m) {
    m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
          nb::arg("group_size"), nb::arg("bits"), nb::arg("groups_per_factor") = 0, nb::arg("factor_count") = 0,
          nb::arg("code_count") = 0, nb::arg("code_bits") = 8, nb::arg("bias_ratio") = 0.0f,
          nb::arg("factor_scale") = 1.0f, nb::arg("table") = std::vector<uint8_t>{});
    m.def("gather_quantized_matmul", &gather_quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
          nb::arg("biases"), nb::arg("indices"), nb::arg("group_size"), nb::arg("bits"),
          nb::arg("groups_per_factor") = 0, nb::arg("factor_count") = 0, nb::arg("code_count") = 0,
          nb::arg("code_bits") = 8, nb::arg("bias_ratio") = 0.0f, nb::arg("factor_scale") = 1.0f,
          nb::arg("table") = std::vector<uint8_t>{});
    m.def("matmul_16bit", &matmul_16bit, nb::arg("x"), nb::arg("w"));
    m.def("grid_matmul", &grid_matmul, nb::arg("x"), nb::arg("blocks"), nb::arg("grid"), nb::arg("type_name"));
    m.def("gather_grid_matmul", &gather_grid_matmul, nb::arg("x"), nb::arg("blocks"), nb::arg("grid"),
          nb::arg("indices"), nb::arg("type_name"));
    m.def("gather_matmul_16bit", &gather_matmul_16bit, nb::arg("x"), nb::arg("w"), nb::arg("indices"));
    m.def(
        "instruction_sets",
        [] { return std::vector<std::string>(LEVEL_NAMES, LEVEL_NAMES + cpu_level() + 1); },
        "the builds this CPU runs, the best last (the one in use unless use_instruction_set chose)");
    m.def(
        "use_instruction_set",
        [](std::optional<std::string> name) {
            int level = -1;
            for (int i = 0; name && i <= cpu_level(); i++)
                if (*name == LEVEL_NAMES[i]) level = i;
            if (name && level < 0) throw std::invalid_argument("this CPU does not run the " + *name + " build");
            chosen_level.store(level);
        },
        nb::arg("name").none(), "the build to use from now on (None: the CPU's best)");
}
