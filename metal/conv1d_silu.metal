// Causal depthwise conv1d + SiLU over T tokens, continuing from a carried tail
// (body for mx.fast.metal_kernel).
//
// Template: T (dtype of x and the tails), K (kernel width), Snapshots (write the
// tail after every token).
// Inputs:  x [B, T, C], weight [C, K] float, tail_in [B, K-1, C].
// Outputs: y [B, T, C], tail_out [B, K-1, C], snapshots [B, T, K-1, C] (one element
//          when Snapshots is false).
// Grid (C, B, 1): one thread per channel and sequence; the window of the last
// K-1 inputs lives in registers.
const int channel = thread_position_in_grid.x;
const int batch = thread_position_in_grid.y;
const int steps = x_shape[1];
const int channels = x_shape[2];
constexpr int Tail = K - 1;

float w[K];
for (int j = 0; j < K; ++j) {
    w[j] = static_cast<float>(weight[channel * K + j]);
}
float window[Tail];
for (int j = 0; j < Tail; ++j) {
    window[j] = static_cast<float>(tail_in[(batch * Tail + j) * channels + channel]);
}
for (int t = 0; t < steps; ++t) {
    const int token = batch * steps + t;
    const float current = static_cast<float>(x[token * channels + channel]);
    // oldest input first, as the reference sums
    float acc = window[0] * w[0];
    for (int j = 1; j < Tail; ++j) {
        acc += window[j] * w[j];
    }
    acc += current * w[Tail];
    y[token * channels + channel] = static_cast<T>(acc / (1.0f + metal::exp(-acc)));
    for (int j = 0; j + 1 < Tail; ++j) {
        window[j] = window[j + 1];
    }
    window[Tail - 1] = current;
    if (Snapshots) {
        for (int j = 0; j < Tail; ++j) {
            snapshots[(token * Tail + j) * channels + channel] = static_cast<T>(window[j]);
        }
    }
}
for (int j = 0; j < Tail; ++j) {
    tail_out[(batch * Tail + j) * channels + channel] = static_cast<T>(window[j]);
}
