// llama.cpp's product of one GGUF type alone, one thread: an N x K matrix of that type (random values
// quantized by llama.cpp, an importance matrix of ones) times one row of x in the type's activation
// blocks (Q8_K, Q8_0, ...), row by row through the type's vec_dot, as a decode step's matrix-vector
// product runs on one thread. The best of 30 rounds, to set beside `gguf_types.py --kernels` with
// MLX_HYBRID_GEMV_THREADS=1. Built against a llama.cpp build (BUILD: its build directory):
//
//     gcc -O2 benchmarks/llama_vec_dot.c -I$LLAMA/ggml/include -L$BUILD/bin -lggml-cpu -lggml-base -lggml
//         -Wl,-rpath,$BUILD/bin -o /tmp/llama_vec_dot      (one command; LLAMA: llama.cpp's source)
//     /tmp/llama_vec_dot iq1_m 3584 1024
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s TYPE N K (TYPE as ggml names it: q4_k, iq1_m, ...)\n", argv[0]);
        return 2;
    }
    ggml_cpu_init();
    const int rows = atoi(argv[2]), cols = atoi(argv[3]);
    enum ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; t++)
        if (ggml_type_name(t) != NULL && strcasecmp(ggml_type_name(t), argv[1]) == 0) type = t;
    if (type == GGML_TYPE_COUNT || rows <= 0 || cols <= 0 || cols % ggml_blck_size(type) != 0) {
        fprintf(stderr, "%s: no such type, or K not a multiple of its block\n", argv[1]);
        return 2;
    }
    const struct ggml_type_traits_cpu* traits = ggml_get_type_traits_cpu(type);
    const struct ggml_type_traits_cpu* x_traits = ggml_get_type_traits_cpu(traits->vec_dot_type);
    const size_t row_bytes = ggml_row_size(type, cols);
    float* values = malloc(sizeof(float) * rows * cols);
    float* importance = malloc(sizeof(float) * cols);
    for (long i = 0; i < (long)rows * cols; i++) values[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int i = 0; i < cols; i++) importance[i] = 1.0f;
    char* weights = malloc(row_bytes * rows);
    ggml_quantize_init(type);
    ggml_quantize_chunk(type, values, weights, 0, rows, cols, importance);
    void* x = malloc(ggml_row_size(traits->vec_dot_type, cols));
    x_traits->from_float(values, x, cols);
    float* out = malloc(sizeof(float) * rows);
    double best = 1e9;
    for (int round = 0; round < 30; round++) {
        const double start = seconds();
        for (int r = 0; r < rows; r++) traits->vec_dot(cols, out + r, 0, weights + r * row_bytes, 0, x, 0, 1);
        const double took = seconds() - start;
        best = took < best ? took : best;
    }
    printf("%s %d x %d: %.1f us, one thread (out[0] %g)\n", ggml_type_name(type), rows, cols, best * 1e6, out[0]);
    return 0;
}
