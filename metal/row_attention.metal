// Attention of a decode step's or a verify pass's few query tokens over a KV cache, each query
// token's sums in one order whatever tokens, rows or cache length come with it (body for
// mx.fast.metal_kernel): a token of a verify pass gets the bits its decode step gets.
//
// Template: T (q and out; k and v too when Bits is 0), Bits (0: float entries; 4 or 8: the codes of
//           mx.quantize, each group of GroupSize features scale * code + bias), GroupSize, Dk, Dv
//           (head sizes), Causal (query token t of T sees the keys up to its own position), KeyGroups
//           (simdgroups a query token: fixed by Dv alone, so a layer's every call sums alike).
// Inputs:  q [B, H, T, Dk]; k [B, Hkv, S, Dk] and v [B, Hkv, S, Dv], or their codes [..., D * Bits / 32]
//          uint32; k_scales, k_biases [B, Hkv, S, Dk / GroupSize], v_scales, v_biases [..., Dv /
//          GroupSize] (one element each when Bits is 0), all read through their strides (a cache's
//          views); lengths [B] int32 (keys row b holds, its last the newest); scale [1] float.
// Output:  out [B, H, T, Dv].
// Grid (32, KeyGroups, B * H * T), threadgroup (32, KeyGroups, 1): simdgroup g takes keys g,
// g + KeyGroups, ... in order, a softmax running over them (lane l holding features l * PerLane
// ...); the groups' maxima, sums and outputs are then combined in group order. Which keys a
// simdgroup takes depends on a key's index alone, and a key no query token sees is never read.
constexpr int KeyPerLane = (Dk + 31) / 32, ValuePerLane = (Dv + 31) / 32;
constexpr float NoScore = -3.4028235e38f;  // below every score: exp(NoScore - score) is 0
threadgroup float group_max[KeyGroups];
threadgroup float group_sum[KeyGroups];
threadgroup float group_out[KeyGroups][Dv];

const uint lane = thread_index_in_simdgroup;
const int key_group = thread_position_in_grid.y;
const int heads = q_shape[1], tokens = q_shape[2];
const int query = thread_position_in_grid.z;  // (b * H + h) * T + t
const int t = query % tokens, h = (query / tokens) % heads, b = query / (tokens * heads);
const int kv_head = h / (heads / k_shape[1]);
const int seen = lengths[b] - (Causal ? tokens - 1 - t : 0);
const device uint* k_codes = reinterpret_cast<const device uint*>(k);
const device uint* v_codes = reinterpret_cast<const device uint*>(v);

float q_row[KeyPerLane];
for (int i = 0; i < KeyPerLane; ++i) {
    const int feature = lane * KeyPerLane + i;
    q_row[i] = feature < Dk ? static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + t * q_strides[2]
                                                  + feature * q_strides[3]]) : 0.0f;
}
float running_max = NoScore, running_sum = 0.0f, out_row[ValuePerLane];
for (int i = 0; i < ValuePerLane; ++i) {
    out_row[i] = 0.0f;
}
for (int key = key_group; key < seen; key += KeyGroups) {
    float dot = 0.0f;
    for (int i = 0; i < KeyPerLane; ++i) {
        const int feature = lane * KeyPerLane + i;
        if (feature < Dk) {
            float entry;
            if (Bits == 0) {
                entry = static_cast<float>(k[b * k_strides[0] + kv_head * k_strides[1] + key * k_strides[2]
                                             + feature * k_strides[3]]);
            } else {
                const int bit = feature * Bits, group = feature / GroupSize;
                const uint word = k_codes[b * k_strides[0] + kv_head * k_strides[1] + key * k_strides[2]
                                          + (bit / 32) * k_strides[3]];
                const int at = b * k_scales_strides[0] + kv_head * k_scales_strides[1] + key * k_scales_strides[2]
                    + group * k_scales_strides[3];
                const int bias_at = b * k_biases_strides[0] + kv_head * k_biases_strides[1]
                    + key * k_biases_strides[2] + group * k_biases_strides[3];
                const uint code = (word >> (bit % 32)) & ((1u << Bits) - 1u);
                entry = metal::fma(static_cast<float>(k_scales[at]), static_cast<float>(code),
                                   static_cast<float>(k_biases[bias_at]));
            }
            dot = metal::fma(q_row[i], entry, dot);
        }
    }
    const float score = simd_sum(dot) * scale[0];
    const float new_max = score > running_max ? score : running_max;
    const float kept = metal::exp(running_max - new_max), weight = metal::exp(score - new_max);
    running_sum = metal::fma(running_sum, kept, weight);
    running_max = new_max;
    for (int i = 0; i < ValuePerLane; ++i) {
        const int feature = lane * ValuePerLane + i;
        if (feature < Dv) {
            float entry;
            if (Bits == 0) {
                entry = static_cast<float>(v[b * v_strides[0] + kv_head * v_strides[1] + key * v_strides[2]
                                             + feature * v_strides[3]]);
            } else {
                const int bit = feature * Bits, group = feature / GroupSize;
                const uint word = v_codes[b * v_strides[0] + kv_head * v_strides[1] + key * v_strides[2]
                                          + (bit / 32) * v_strides[3]];
                const int at = b * v_scales_strides[0] + kv_head * v_scales_strides[1] + key * v_scales_strides[2]
                    + group * v_scales_strides[3];
                const int bias_at = b * v_biases_strides[0] + kv_head * v_biases_strides[1]
                    + key * v_biases_strides[2] + group * v_biases_strides[3];
                const uint code = (word >> (bit % 32)) & ((1u << Bits) - 1u);
                entry = metal::fma(static_cast<float>(v_scales[at]), static_cast<float>(code),
                                   static_cast<float>(v_biases[bias_at]));
            }
            out_row[i] = metal::fma(weight, entry, out_row[i] * kept);
        }
    }
}
if (lane == 0) {
    group_max[key_group] = running_max;
    group_sum[key_group] = running_sum;
}
for (int i = 0; i < ValuePerLane; ++i) {
    const int feature = lane * ValuePerLane + i;
    if (feature < Dv) {
        group_out[key_group][feature] = out_row[i];
    }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

float overall_max = NoScore;
for (int g = 0; g < KeyGroups; ++g) {
    overall_max = group_max[g] > overall_max ? group_max[g] : overall_max;
}
float total = 0.0f, factors[KeyGroups];
for (int g = 0; g < KeyGroups; ++g) {
    factors[g] = metal::exp(group_max[g] - overall_max);
    total = metal::fma(group_sum[g], factors[g], total);
}
for (int feature = key_group * 32 + lane; feature < Dv; feature += 32 * KeyGroups) {
    float value = 0.0f;
    for (int g = 0; g < KeyGroups; ++g) {
        value = metal::fma(group_out[g][feature], factors[g], value);
    }
    out[query * Dv + feature] = static_cast<T>(total > 0.0f ? value / total : 0.0f);
}
