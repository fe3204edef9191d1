// Gated delta rule over T tokens for one layer (body for mx.fast.metal_kernel).
//
// Template: T (dtype of q, k, v, g, beta), Dk (key head size), VectorGate (g per key
// channel, Kimi KDA, instead of one per head), Snapshots (write S after every token).
// Inputs:  q, k [B, T, Hk, Dk] (L2-normalised, q scaled), v [B, T, Hv, Dv],
//          g [B, T, Hv] or [B, T, Hv, Dk], beta [B, T, Hv], state_in [B, Hv, Dk, Dv] float.
// Outputs: out [B, T, Hv, Dv] float, state_out [B, Hv, Dk, Dv] float,
//          snapshots [B, T, Hv, Dk, Dv] float (one element when Snapshots is false).
// Grid (32, Dv, B * Hv), threadgroup (32, d, 1): one simdgroup per (batch, value head,
// value column); lane l keeps rows l, l + 32, ... of that column of S in registers.
const uint lane = thread_index_in_simdgroup;
const uint column = thread_position_in_grid.y;
const uint head_row = thread_position_in_grid.z;  // b * Hv + h
const int steps = v_shape[1];
const int value_heads = v_shape[2];
const int key_heads = q_shape[2];
const int value_dim = v_shape[3];
const int batch = head_row / value_heads;
const int head = head_row % value_heads;
const int key_head = head / (value_heads / key_heads);  // value head h reads key head h // R
constexpr int PerLane = (Dk + 31) / 32;

float s[PerLane];
for (int r = 0; r < PerLane; ++r) {
    const int i = lane + 32 * r;
    s[r] = i < Dk ? state_in[(head_row * Dk + i) * value_dim + column] : 0.0f;
}
for (int t = 0; t < steps; ++t) {
    const int token = batch * steps + t;
    const int qk_base = (token * key_heads + key_head) * Dk;
    const int head_index = token * value_heads + head;
    const float head_decay = VectorGate ? 0.0f : metal::exp(static_cast<float>(g[head_index]));
    float remembered = 0.0f;
    for (int r = 0; r < PerLane; ++r) {
        const int i = lane + 32 * r;
        if (i < Dk) {
            const float decay = VectorGate ? metal::exp(static_cast<float>(g[head_index * Dk + i])) : head_decay;
            s[r] *= decay;
            remembered += s[r] * static_cast<float>(k[qk_base + i]);
        }
    }
    remembered = simd_sum(remembered);
    const float delta = static_cast<float>(beta[head_index])
        * (static_cast<float>(v[head_index * value_dim + column]) - remembered);
    float read = 0.0f;
    for (int r = 0; r < PerLane; ++r) {
        const int i = lane + 32 * r;
        if (i < Dk) {
            s[r] += static_cast<float>(k[qk_base + i]) * delta;
            read += s[r] * static_cast<float>(q[qk_base + i]);
        }
    }
    read = simd_sum(read);
    if (lane == 0) {
        out[head_index * value_dim + column] = read;
    }
    if (Snapshots) {
        for (int r = 0; r < PerLane; ++r) {
            const int i = lane + 32 * r;
            if (i < Dk) {
                snapshots[(head_index * Dk + i) * value_dim + column] = s[r];
            }
        }
    }
}
for (int r = 0; r < PerLane; ++r) {
    const int i = lane + 32 * r;
    if (i < Dk) {
        state_out[(head_row * Dk + i) * value_dim + column] = s[r];
    }
}
