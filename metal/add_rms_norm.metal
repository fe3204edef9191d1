// A residual sum and the RMSNorm after it, one threadgroup a row (body for mx.fast.metal_kernel):
// total = x + y (rounded to T, as MLX adds), normed = weight * T(total / sqrt(mean(total^2) + eps)),
// the form of mx.fast.rms_norm and ops.reference.rms_norm; the sum of squares in float32.
//
// Template: T (dtype of x, y and the outputs), Threads (threads a row: a multiple of 32).
// Inputs:  x, y [rows, N], weight [N] (its own dtype, read as float), eps [1] float.
// Outputs: total [rows, N], normed [rows, N].
// Grid (Threads, rows, 1), threadgroup (Threads, 1, 1): thread i takes features i, i + Threads, ...
// A row's sums are in one order whatever rows come with it.
constexpr int Groups = Threads / 32;
threadgroup float partial_squares[Groups];

const int thread_index = thread_position_in_grid.x;
const int row = thread_position_in_grid.y;
const int features = x_shape[1];
const int base = row * features;

float squares = 0.0f;
for (int i = thread_index; i < features; i += Threads) {
    const T sum = static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(y[base + i]));
    total[base + i] = sum;
    squares += static_cast<float>(sum) * static_cast<float>(sum);
}
squares = simd_sum(squares);
if (thread_index_in_simdgroup == 0) {
    partial_squares[thread_index / 32] = squares;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float row_squares = 0.0f;
for (int g = 0; g < Groups; ++g) {
    row_squares += partial_squares[g];
}
const float inverse_rms = metal::rsqrt(row_squares / features + eps[0]);
for (int i = thread_index; i < features; i += Threads) {
    const T scaled = static_cast<T>(static_cast<float>(total[base + i]) * inverse_rms);
    normed[base + i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(scaled));
}
