// A linear-attention layer's work between its projections, as ops.reference.linear_attention
// composes it, in one launch (body for mx.fast.metal_kernel): the causal conv + SiLU of the
// head's q, k and v channels (rounded to T, as the conv kernel writes them), q and k
// L2-normalised (q then scaled), the gates g = A softplus(a + dt_bias) and beta = sigmoid(b), the
// gated delta rule, and the output's RMSNorm times the gate's activation.
//
// Template: T (dtype of x and the conv tails), Dk (key head size), K (conv width), Columns (value
// columns a simdgroup holds), VectorGate (a and dt_bias per key channel: Kimi's KDA),
// SigmoidGate (out times sigmoid(gate): KDA; else silu(gate): Qwen's GDN), Snapshots (the tail
// and the state after every token).
// Inputs:  x [B, T, C], C = 2 Hk Dk + Hv Dv (q | k | v), conv_weight [C, K],
//          a [B, T, Hv] or [B, T, Hv, Dk], b [B, T, Hv], gate [B, T, Hv Dv], A [Hv],
//          dt_bias [Hv] or [Hv Dk], norm_weight [Dv] (each in its own dtype, read as float),
//          scalars [3] float: the output norm's eps, the L2 norm's eps, q's scale,
//          tail_in [B, K-1, C], state_in [B, Hv, Dk, Dv] float.
// Outputs: out [B, T, Hv Dv] (T), tail_out [B, K-1, C], state_out [B, Hv, Dk, Dv] float,
//          tail_snapshots [B, T, K-1, C], state_snapshots [B, T, Hv, Dk, Dv] float (one element
//          each when Snapshots is false).
// Grid (32, Dv / Columns, B Hv), threadgroup (32, Dv / Columns, 1): one threadgroup per sequence
// and value head; simdgroup y holds the state's columns y Columns .. y Columns + Columns - 1, lane l
// its rows l, l + 32, ... Each simdgroup computes the key head's q and k itself (K FMAs a
// channel), so that only the output norm's sum of squares crosses simdgroups.
constexpr int PerLane = (Dk + 31) / 32;
constexpr int Tail = K - 1;
constexpr int MaxGroups = 32;
threadgroup float squares[2][MaxGroups];  // by token parity: one barrier a token suffices

const uint lane = thread_index_in_simdgroup;
const int simdgroup = thread_position_in_grid.y;
const int head_row = thread_position_in_grid.z;  // b * Hv + h
const int steps = x_shape[1];
const int channels = x_shape[2];
const int value_heads = state_in_shape[1];
const int value_dim = state_in_shape[3];
const int groups = value_dim / Columns;
const int key_heads = (channels - value_heads * value_dim) / (2 * Dk);
const int batch = head_row / value_heads;
const int head = head_row % value_heads;
const int ratio = value_heads / key_heads;  // value head h reads key head h / ratio
const int q_channel = (head / ratio) * Dk;
const int k_channel = q_channel + key_heads * Dk;
const int first_column = simdgroup * Columns;
const int v_channel = 2 * key_heads * Dk + head * value_dim + first_column;
// the key head's tails are written by one simdgroup of its first value head; a column's by lane 0
const bool writes_key_tails = head % ratio == 0 && simdgroup == 0;
const float norm_eps = scalars[0], l2_eps = scalars[1], q_scale = scalars[2];

// registers: the conv's weights and last K-1 inputs of this lane's q and k rows and of the
// simdgroup's value columns, and the lane's rows of the simdgroup's columns of S
float wq[PerLane][K], wk[PerLane][K], window_q[PerLane][Tail], window_k[PerLane][Tail];
float wv[Columns][K], window_v[Columns][Tail];
float s[PerLane][Columns];
for (int r = 0; r < PerLane; ++r) {
    const int i = lane + 32 * r;
    for (int j = 0; j < K; ++j) {
        wq[r][j] = i < Dk ? static_cast<float>(conv_weight[(q_channel + i) * K + j]) : 0.0f;
        wk[r][j] = i < Dk ? static_cast<float>(conv_weight[(k_channel + i) * K + j]) : 0.0f;
    }
    for (int j = 0; j < Tail; ++j) {
        window_q[r][j] = i < Dk ? static_cast<float>(tail_in[(batch * Tail + j) * channels + q_channel + i]) : 0.0f;
        window_k[r][j] = i < Dk ? static_cast<float>(tail_in[(batch * Tail + j) * channels + k_channel + i]) : 0.0f;
    }
    for (int c = 0; c < Columns; ++c) {
        s[r][c] = i < Dk ? state_in[(head_row * Dk + i) * value_dim + first_column + c] : 0.0f;
    }
}
for (int c = 0; c < Columns; ++c) {
    for (int j = 0; j < K; ++j) {
        wv[c][j] = static_cast<float>(conv_weight[(v_channel + c) * K + j]);
    }
    for (int j = 0; j < Tail; ++j) {
        window_v[c][j] = static_cast<float>(tail_in[(batch * Tail + j) * channels + v_channel + c]);
    }
}

for (int t = 0; t < steps; ++t) {
    const int token = batch * steps + t;
    const int x_row = token * channels;
    const int head_index = token * value_heads + head;

    // the conv + SiLU (oldest input first, as the reference sums), rounded to T; the window moves on
    float q[PerLane], k[PerLane], v[Columns];
    float q_squares = 0.0f, k_squares = 0.0f;
    for (int r = 0; r < PerLane; ++r) {
        const int i = lane + 32 * r;
        q[r] = 0.0f;
        k[r] = 0.0f;
        if (i < Dk) {
            const float x_q = static_cast<float>(x[x_row + q_channel + i]);
            const float x_k = static_cast<float>(x[x_row + k_channel + i]);
            float acc_q = window_q[r][0] * wq[r][0], acc_k = window_k[r][0] * wk[r][0];
            for (int j = 1; j < Tail; ++j) {
                acc_q += window_q[r][j] * wq[r][j];
                acc_k += window_k[r][j] * wk[r][j];
            }
            acc_q += x_q * wq[r][Tail];
            acc_k += x_k * wk[r][Tail];
            q[r] = static_cast<float>(static_cast<T>(acc_q / (1.0f + metal::exp(-acc_q))));
            k[r] = static_cast<float>(static_cast<T>(acc_k / (1.0f + metal::exp(-acc_k))));
            for (int j = 0; j + 1 < Tail; ++j) {
                window_q[r][j] = window_q[r][j + 1];
                window_k[r][j] = window_k[r][j + 1];
            }
            window_q[r][Tail - 1] = x_q;
            window_k[r][Tail - 1] = x_k;
            q_squares += q[r] * q[r];
            k_squares += k[r] * k[r];
        }
    }
    for (int c = 0; c < Columns; ++c) {
        const float x_v = static_cast<float>(x[x_row + v_channel + c]);
        float acc = window_v[c][0] * wv[c][0];
        for (int j = 1; j < Tail; ++j) {
            acc += window_v[c][j] * wv[c][j];
        }
        acc += x_v * wv[c][Tail];
        v[c] = static_cast<float>(static_cast<T>(acc / (1.0f + metal::exp(-acc))));
        for (int j = 0; j + 1 < Tail; ++j) {
            window_v[c][j] = window_v[c][j + 1];
        }
        window_v[c][Tail - 1] = x_v;
    }
    const float q_norm = metal::rsqrt(simd_sum(q_squares) + l2_eps);
    const float k_norm = metal::rsqrt(simd_sum(k_squares) + l2_eps);

    // the gates: log decay A softplus(a + dt_bias) (softplus as logaddexp(x, 0)), beta = sigmoid(b)
    const float beta = 1.0f / (1.0f + metal::exp(-static_cast<float>(b[head_index])));
    float decay[PerLane];
    for (int r = 0; r < PerLane; ++r) {
        const int i = lane + 32 * r;
        const int channel = VectorGate ? (i < Dk ? i : 0) : 0;
        const float z = static_cast<float>(a[VectorGate ? head_index * Dk + channel : head_index])
            + static_cast<float>(dt_bias[VectorGate ? head * Dk + channel : head]);
        const float softplus = (z > 0.0f ? z : 0.0f) + metal::log(1.0f + metal::exp(-(z > 0.0f ? z : -z)));
        decay[r] = metal::exp(static_cast<float>(A[head]) * softplus);
        q[r] = q[r] * q_norm * q_scale;
        k[r] = k[r] * k_norm;
    }

    // the rule, column by column: S = D S; delta = beta (v - k^T S); S += k delta; read = q^T S
    float reads[Columns];
    float read_squares = 0.0f;
    for (int c = 0; c < Columns; ++c) {
        float remembered = 0.0f;
        for (int r = 0; r < PerLane; ++r) {
            s[r][c] *= decay[r];
            remembered += s[r][c] * k[r];
        }
        const float delta = beta * (v[c] - simd_sum(remembered));
        float read = 0.0f;
        for (int r = 0; r < PerLane; ++r) {
            s[r][c] += k[r] * delta;
            read += s[r][c] * q[r];
        }
        reads[c] = simd_sum(read);
        read_squares += reads[c] * reads[c];
    }

    // the output norm over the head's value_dim outputs: each simdgroup's sum, then all of them in order
    if (lane == 0) {
        squares[t & 1][simdgroup] = read_squares;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (int y = 0; y < groups; ++y) {
        total += squares[t & 1][y];
    }
    const float inverse_rms = metal::rsqrt(total / value_dim + norm_eps);
    if (lane == 0) {
        for (int c = 0; c < Columns; ++c) {
            const int column = first_column + c;
            const float z = static_cast<float>(gate[head_index * value_dim + column]);
            const float gate_sigmoid = 1.0f / (1.0f + metal::exp(-z));
            const float activation = SigmoidGate ? gate_sigmoid : z * gate_sigmoid;
            const float normed = reads[c] * inverse_rms * static_cast<float>(norm_weight[column]);
            out[head_index * value_dim + column] = static_cast<T>(normed * activation);
        }
    }

    if (Snapshots) {
        for (int r = 0; r < PerLane; ++r) {
            const int i = lane + 32 * r;
            for (int c = 0; c < Columns; ++c) {
                if (i < Dk) {
                    state_snapshots[(head_index * Dk + i) * value_dim + first_column + c] = s[r][c];
                }
            }
            for (int j = 0; j < Tail; ++j) {
                if (writes_key_tails && i < Dk) {
                    tail_snapshots[(token * Tail + j) * channels + q_channel + i] = static_cast<T>(window_q[r][j]);
                    tail_snapshots[(token * Tail + j) * channels + k_channel + i] = static_cast<T>(window_k[r][j]);
                }
            }
        }
        for (int c = 0; c < Columns; ++c) {
            for (int j = 0; j < Tail; ++j) {
                if (lane == 0) {
                    tail_snapshots[(token * Tail + j) * channels + v_channel + c] = static_cast<T>(window_v[c][j]);
                }
            }
        }
    }
}

for (int r = 0; r < PerLane; ++r) {
    const int i = lane + 32 * r;
    for (int c = 0; c < Columns; ++c) {
        if (i < Dk) {
            state_out[(head_row * Dk + i) * value_dim + first_column + c] = s[r][c];
        }
    }
    for (int j = 0; j < Tail; ++j) {
        if (writes_key_tails && i < Dk) {
            tail_out[(batch * Tail + j) * channels + q_channel + i] = static_cast<T>(window_q[r][j]);
            tail_out[(batch * Tail + j) * channels + k_channel + i] = static_cast<T>(window_k[r][j]);
        }
    }
}
for (int c = 0; c < Columns; ++c) {
    for (int j = 0; j < Tail; ++j) {
        if (lane == 0) {
            tail_out[(batch * Tail + j) * channels + v_channel + c] = static_cast<T>(window_v[c][j]);
        }
    }
}
