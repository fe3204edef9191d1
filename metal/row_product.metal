// x @ W^T for a decode step's or a verify pass's few rows, each row summed in one order whatever
// rows come with it (body for mx.fast.metal_kernel). A GPU's own products tile 2-16 rows otherwise
// than one (other reduction orders): a verify pass would not reproduce its decode steps' bits.
//
// Template: T (x and out), Bits (0: w holds the matrix in a float dtype; 4 or 8: MLX's affine
//           codes, 32 / Bits a uint32 from the lowest bits up, each group of GroupSize inputs
//           scale * code + bias), GroupSize, Rows (rows a threadgroup), Columns (outputs a
//           simdgroup), Experts (row r multiplies matrix indices[r] of w), Share (rows of out a
//           row of x: an expert product's choices of one token).
// Inputs:  x [..., K] (M / Share rows); w [N, K] or, when Experts, [E, N, K]; or codes [(E,) N, K * Bits
//          / 32] uint32 with scales, biases [(E,) N, K / GroupSize] (one element each when Bits is 0);
//          indices [M] int32 or uint32 (one element unless Experts: then Rows is 1).
// Output:  out [M, N] (any shape of M * N elements).
// Grid (32, groups * ceil(N / (groups * Columns)), ceil(M / Rows)), threadgroup (32, groups, 1):
// simdgroup y takes outputs y * Columns ..., threadgroup z rows z * Rows .... Lane l takes the
// chunks of 8 inputs l, l + 32, ...: a row's output is its lane's fused multiply-adds in input
// order, then simd_sum, then one rounding to T; nothing of it depends on Rows, Columns or M.
constexpr int Chunk = 8;
const uint lane = thread_index_in_simdgroup;
const int K = x_shape[x_ndim - 1];
int x_rows = 1;
for (int d = 0; d < x_ndim - 1; ++d) {
    x_rows *= x_shape[d];
}
const int M = x_rows * Share;
const int N = w_shape[Experts ? 1 : 0];
const int first_row = thread_position_in_grid.z * Rows;
const int first_column = thread_position_in_grid.y * Columns;
const int groups = K / GroupSize;
const int row_words = Bits == 0 ? K : K * Bits / 32;  // elements of w a matrix row
const device uint* codes = reinterpret_cast<const device uint*>(w);

if (first_column < N) {  // the grid's last simdgroups may lie past the matrix
    const int matrix = Experts ? indices[first_row] : 0;
    float sums[Rows][Columns];
    for (int r = 0; r < Rows; ++r) {
        for (int c = 0; c < Columns; ++c) {
            sums[r][c] = 0.0f;
        }
    }
    for (int start = lane * Chunk; start < K; start += 32 * Chunk) {
        float weights[Columns][Chunk];
        for (int c = 0; c < Columns; ++c) {
            // a column past the matrix reads the last one's weights and writes nothing
            const int row_of_w = matrix * N + (first_column + c < N ? first_column + c : N - 1);
            if (Bits == 0) {
                for (int e = 0; e < Chunk; ++e) {
                    weights[c][e] = start + e < K ? static_cast<float>(w[row_of_w * row_words + start + e]) : 0.0f;
                }
            } else {
                const int group = row_of_w * groups + start / GroupSize;
                const float scale = static_cast<float>(scales[group]);
                const float bias = static_cast<float>(biases[group]);
                for (int e = 0; e < Chunk; ++e) {
                    const int bit = (start + e) * Bits;
                    const uint code = (codes[row_of_w * row_words + bit / 32] >> (bit % 32)) & ((1u << Bits) - 1u);
                    weights[c][e] = metal::fma(scale, static_cast<float>(code), bias);
                }
            }
        }
        for (int r = 0; r < Rows; ++r) {
            const int row = first_row + r;
            if (row < M) {
                const int x_base = (row / Share) * K + start;
                for (int e = 0; e < Chunk && start + e < K; ++e) {
                    const float input = static_cast<float>(x[x_base + e]);
                    for (int c = 0; c < Columns; ++c) {
                        sums[r][c] = metal::fma(input, weights[c][e], sums[r][c]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < Rows; ++r) {
        for (int c = 0; c < Columns; ++c) {
            const float total = simd_sum(sums[r][c]);
            const int row = first_row + r, column = first_column + c;
            if (lane == 0 && row < M && column < N) {
                out[row * N + column] = static_cast<T>(total);
            }
        }
    }
}
