// What the translation units of the CPU kernels' module share (mlx_hybrid/ops/cpu_extension.py
// lists the kernels and builds their units into one module): the thread pool, the binders each unit
// gives the module, and how an input becomes what the kernels read.
#pragma once

#include <immintrin.h>
#include <nanobind/nanobind.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlx_hybrid {

void bind_quantized_matmul(nanobind::module_& m);
void bind_gated_delta(nanobind::module_& m);
void bind_conv1d_silu(nanobind::module_& m);
void bind_norms(nanobind::module_& m);
void bind_linear_attention(nanobind::module_& m);
void bind_attention(nanobind::module_& m);
void bind_gated_product(nanobind::module_& m);
void bind_int8_products(nanobind::module_& m);

// Whether the products run their AVX-512 builds: the CPU has AVX-512 (F, VL, BW, DQ) and
// use_instruction_set left them on (quantized_matmul.cpp)
bool avx512_in_use();
// and with them the CPU's VBMI byte permutes and shifts (Ice Lake and later, Zen 4 and later)
bool avx512_vbmi_in_use();
// and its VNNI dot products of bytes (Cascade Lake and later, Zen 4 and later)
bool avx512_vnni_in_use();

// The target of the units' AVX2 functions (within what cpu_supported() checks; the quantized
// products' body, compiled per instruction set, names its own).
#define AVX2_FN __attribute__((target("avx2,fma")))

// The target of the AVX-512 builds (int8_products.cpp's wide functions, the quantized products' body),
// with BMI2's scalar bit deposits, which every CPU with these AVX-512 parts has.
#define AVX512_TARGET "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2"
#define AVX512_FN __attribute__((target(AVX512_TARGET)))
#define AVX512_VBMI_FN __attribute__((target(AVX512_TARGET ",avx512vbmi")))
#define AVX512_VNNI_FN __attribute__((target(AVX512_TARGET ",avx512vnni")))

// The last instructions of an AVX-512 function before it returns to code built for any x86-64: vector
// registers 16-31 zeroed, then VZEROUPPER. VZEROUPPER leaves registers 16-31 as they are, and while they
// hold wide values every return to SSE code (the caller's loop, MLX's operations) costs a state
// transition: on an Intel Xeon (Emerald Rapids) hundreds of cycles, which took an IQ1_M product of 4
// blocks a row 2.7x its time. (GCC's own VZEROUPPER does not zero them.)
AVX512_FN __attribute__((always_inline)) inline void leave_avx512() {
    asm volatile(
        "vpxord %%xmm16, %%xmm16, %%xmm16\n\t"
        "vpxord %%xmm17, %%xmm17, %%xmm17\n\t"
        "vpxord %%xmm18, %%xmm18, %%xmm18\n\t"
        "vpxord %%xmm19, %%xmm19, %%xmm19\n\t"
        "vpxord %%xmm20, %%xmm20, %%xmm20\n\t"
        "vpxord %%xmm21, %%xmm21, %%xmm21\n\t"
        "vpxord %%xmm22, %%xmm22, %%xmm22\n\t"
        "vpxord %%xmm23, %%xmm23, %%xmm23\n\t"
        "vpxord %%xmm24, %%xmm24, %%xmm24\n\t"
        "vpxord %%xmm25, %%xmm25, %%xmm25\n\t"
        "vpxord %%xmm26, %%xmm26, %%xmm26\n\t"
        "vpxord %%xmm27, %%xmm27, %%xmm27\n\t"
        "vpxord %%xmm28, %%xmm28, %%xmm28\n\t"
        "vpxord %%xmm29, %%xmm29, %%xmm29\n\t"
        "vpxord %%xmm30, %%xmm30, %%xmm30\n\t"
        "vpxord %%xmm31, %%xmm31, %%xmm31\n\t"
        "vzeroupper"
        :
        :
        : "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26",
          "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "memory");
}

// An allocator of memory that starts at a 64-byte boundary, for the buffers kernels read in vectors
// (LineVector): their loads then stay within cache lines. malloc aligns to 16 bytes, which splits half
// the 32-byte loads and every 64-byte one over two lines, and slows every product.
template <class T>
struct LineAligned {
    using value_type = T;
    LineAligned() = default;
    template <class U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const LineAligned<U>&) const { return true; }
};
template <class T>
using LineVector = std::vector<T, LineAligned<T>>;

// `count` floats from `buffer`, which grows as needed and is kept
inline float* aligned_floats(LineVector<float>& buffer, size_t count) {
    buffer.resize(count);
    return buffer.data();
}

// whether this CPU runs the kernels: AVX2, FMA and F16C
inline bool cpu_supported() {
    static bool known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                        __builtin_cpu_supports("f16c");
    return known;
}

// e^u as 2^n e^r, n = round(u / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor series to degree 7
// (truncation below 3e-9 relative; the result within 2 ulp of e^u). u is clamped to [-87, 88],
// where 2^n is a normal float: SiLU and the sigmoid are saturated long before (1 + e^-87 rounds to 1).
AVX2_FN inline __m256 exp_ps(__m256 u) {
    u = _mm256_min_ps(_mm256_max_ps(u, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(u, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // ln 2 in two parts, the first with few enough bits that n times it is exact
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), u);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
    constexpr float inverse_factorials[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(inverse_factorials[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(inverse_factorials[i]));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// 1 / (1 + e^-x)
AVX2_FN inline __m256 sigmoid_ps(__m256 x) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// x / (1 + e^-x)
AVX2_FN inline __m256 silu_ps(__m256 x) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(x, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// the 8 lanes' sum by a fixed tree: lane i + lane i+4, then i + i+2, then the last two
AVX2_FN inline float sum_lanes(__m256 v) {
    __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

AVX2_FN inline __m256i lane_mask(int lanes) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// the first `lanes` (<= 8) floats at p; loads and stores of 8 unmasked (AMD's masked stores are slow)
AVX2_FN inline __m256 load_lanes(const float* p, int lanes) {
    return lanes == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(lanes));
}

AVX2_FN inline void store_lanes(float* p, __m256 v, int lanes) {
    if (lanes == 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, lane_mask(lanes), v);
}

// The steps of a linear-attention layer, each defined with the kernel that runs it alone and
// shared with linear_attention.cpp, which runs them all in one primitive: the same code, the
// same bits.

// The causal conv + SiLU (conv1d_silu.cpp) over x [B, T, C] behind its tail [B, K-1, C].
struct ConvShape {
    int batch, tokens, channels, width;
    bool snapshots;
    bool operator==(const ConvShape&) const = default;
};
constexpr int CONV_MAX_WIDTH = 8;    // the widest kernel it takes (Qwen3.5, Qwen3-Next, Kimi Linear: 4)
constexpr int CONV_MAX_RANGE = 256;  // channels a call of conv_silu_channels takes, a multiple of 8
// Sequence b's channels [first, end) over all its tokens: y row t at y + t * y_stride (from
// channel first), the tail after the last token into tail_out [B, K-1, C], the tail after
// each token into snapshots [B, T, K-1, C] (or nullptr).
void conv_silu_channels(const ConvShape& s, int b, int first, int end, const float* x, const float* weight,
                        const float* tail_in, float* y, long y_stride, float* tail_out, float* snapshots);

// One head of the gated delta rule over a run of tokens (gated_delta.cpp): token t reads the state
// token t - 1 wrote (the first reads s_in) and writes its own to its s_out (a snapshot of its own,
// or for every token the same buffer, s_in's too), its output to out [Dv].
struct DeltaRuleHead {
    int key_dim, value_dim;
    bool vector_gate;  // g per key row (Kimi), else one per head
};
struct DeltaRuleToken {
    const float *q, *k, *v, *g;  // q, k [Dk]; v [Dv]; g [Dk] (vector_gate) or [1]
    float beta;
    float *out, *s_out;
};
struct DeltaRuleScratch {
    std::vector<float> decay, q_decayed, k_decayed, qk;  // a chunk's tokens', each [Dk] (qk: one a token)
    LineVector<float> columns;                           // the columns of the state a chunk works on
};
void delta_rule_tokens(const DeltaRuleHead& h, const float* s_in, const DeltaRuleToken* tokens, int count,
                       DeltaRuleScratch& scratch);

// RMSNorm or L2 normalization of a row (rms_norm.cpp).
struct Norm {
    int dim;
    float eps;
    bool mean;      // RMSNorm: the mean of the squares; else (L2) their sum
    bool weighted;  // a weight [dim] multiplies the result
    bool operator==(const Norm&) const = default;
};
void normalize_row(const Norm& n, const float* x, const float* weight, float* y);

// y [n] = x * SiLU(gate) or x * sigmoid(gate) (gated_product.cpp); y may be x.
void gate_values(const float* x, const float* gate, float* y, long n, bool sigmoid);

// dst, row-contiguous, from src's elements read by its strides (a slice, a transpose, a broadcast)
inline void copy_by_strides(const mlx::core::array& src, mlx::core::array& dst) {
    size_t item = src.itemsize(), inner = src.ndim() ? src.shape(-1) : 1;
    int64_t step = src.ndim() ? src.strides().back() : 0;
    const char* from = src.data<char>();
    char* to = dst.data<char>();
    std::vector<int> index(src.ndim() > 1 ? src.ndim() - 1 : 0, 0);
    for (size_t row = 0, rows = inner ? src.size() / inner : 0; row < rows; row++) {
        int64_t offset = 0;
        for (size_t d = 0; d < index.size(); d++) offset += index[d] * src.strides()[d];
        if (step == 1) {
            std::memcpy(to, from + offset * item, inner * item);
        } else {
            for (size_t i = 0; i < inner; i++)
                std::memcpy(to + i * item, from + (offset + (int64_t)i * step) * item, item);
        }
        to += inner * item;
        for (int d = (int)index.size() - 1; d >= 0 && ++index[d] == src.shape(d); d--) index[d] = 0;
    }
}

// A primitive's eval_cpu: its outputs allocated, then compute(inputs, outputs) queued on the
// stream's encoder (over views that do not hold the buffers: the encoder keeps them alive). The
// kernels read their inputs row-contiguous: an input that is not gets a copy made in the same
// task, so that MLX needs no Contiguous node for every lazy input (a few microseconds each,
// hundreds in a decode step). Inputs in the `strided` mask (bit i: input i) whose last axis is
// contiguous come as they are, for a kernel that reads them by their strides (a KV cache's
// slice of its grown buffer, which a copy would read whole every step). in_place: output 0 takes
// input 0's buffer where nothing else holds it (a matrix replaced by its own transform: no second
// copy at the peak, no fresh pages to fault in).
template <class Compute>
void dispatch_on_cpu(mlx::core::Stream stream, const std::vector<mlx::core::array>& inputs,
                     std::vector<mlx::core::array>& outputs, Compute compute, unsigned strided = 0,
                     bool in_place = false) {
    namespace mx = mlx::core;
    auto& encoder = mx::cpu::get_command_encoder(stream);
    std::vector<mx::array> held, written, copied_from, copied_to;
    for (size_t i = 0; i < inputs.size(); i++) {
        auto& input = inputs[i];
        encoder.set_input_array(input);
        bool as_strided =
            (strided >> i & 1) && input.ndim() > 0 && (input.strides().back() == 1 || input.shape(-1) == 1);
        if (input.flags().row_contiguous || as_strided) {
            held.push_back(mx::array::unsafe_weak_copy(input));
            continue;
        }
        mx::array copy(input.shape(), input.dtype(), nullptr, {});
        copy.set_data(mx::allocator::malloc(copy.nbytes()));
        encoder.add_temporary(copy);
        copied_from.push_back(mx::array::unsafe_weak_copy(input));
        copied_to.push_back(mx::array::unsafe_weak_copy(copy));
        held.push_back(mx::array::unsafe_weak_copy(copy));
    }
    const bool donated = in_place && inputs[0].flags().row_contiguous && inputs[0].is_donatable() &&
                         inputs[0].nbytes() == outputs[0].nbytes();
    for (auto& output : outputs) {
        if (donated && &output == &outputs[0])
            output.copy_shared_buffer(inputs[0]);
        else
            output.set_data(mx::allocator::malloc(output.nbytes()));
        encoder.set_output_array(output);
        written.push_back(mx::array::unsafe_weak_copy(output));
    }
    encoder.dispatch([held = std::move(held), written = std::move(written), copied_from = std::move(copied_from),
                      copied_to = std::move(copied_to), compute]() mutable {
        for (size_t i = 0; i < copied_from.size(); i++) copy_by_strides(copied_from[i], copied_to[i]);
        compute(held, written);
    });
}

// An MLX primitive whose outputs compute(params, inputs, outputs) writes on the CPU stream;
// equivalent to another (for mx.compile) when their params are equal. strided: the inputs it
// reads by their strides; in_place: its output may be its input's buffer (see dispatch_on_cpu).
template <class Params,
          void (*compute)(const Params&, const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&),
          unsigned strided = 0, bool in_place = false>
class CpuPrimitive : public mlx::core::Primitive {
   public:
    CpuPrimitive(mlx::core::Stream stream, Params params, const char* name)
        : mlx::core::Primitive(stream), params_(params), name_(name) {}

    void eval_cpu(const std::vector<mlx::core::array>& inputs, std::vector<mlx::core::array>& outputs) override {
        auto run = [params = params_](auto& held, auto& written) { compute(params, held, written); };
        dispatch_on_cpu(stream(), inputs, outputs, run, strided, in_place);
    }

    void eval_gpu(const std::vector<mlx::core::array>&, std::vector<mlx::core::array>&) override {
        throw std::runtime_error(std::string(name_) + " runs on the CPU only");
    }

    const char* name() const override { return name_; }

    // No backward pass: gradients go through the pure-MLX ops (mlx_hybrid.ops.differentiable)
    std::vector<mlx::core::array> vjp(const std::vector<mlx::core::array>&, const std::vector<mlx::core::array>&,
                                      const std::vector<int>&, const std::vector<mlx::core::array>&) override {
        throw std::invalid_argument(no_gradient());
    }

    std::vector<mlx::core::array> jvp(const std::vector<mlx::core::array>&, const std::vector<mlx::core::array>&,
                                      const std::vector<int>&) override {
        throw std::invalid_argument(no_gradient());
    }

    bool is_equivalent(const mlx::core::Primitive& other) const override {
        return params_ == static_cast<const CpuPrimitive&>(other).params_;
    }

   private:
    std::string no_gradient() const {
        return std::string("mlx_hybrid's CPU kernel ") + name_ +
               " has no gradient: compute gradients inside `with mlx_hybrid.ops.differentiable():` "
               "(the pure-MLX ops, which MLX differentiates)";
    }

    Params params_;
    const char* name_;
};

// A pool: the calling thread and `helpers` threads each take a share of a job's parts. One
// for the module (an inline function's static: the same object in every unit).

class Pool {
   public:
    static Pool& get() {
        static Pool* pool = new Pool;  // never destroyed: its threads wait on it until the process ends
        return *pool;
    }

    // run(part) for part in [0, parts): in parallel when `parallel`, else on this thread
    void run(int parts, bool parallel, const std::function<void(int)>& work) {
        if (!parallel || one_thread_.load(std::memory_order_relaxed) || helpers_.empty() || parts < 2 ||
            !busy_.try_lock()) {
            for (int p = 0; p < parts; p++) work(p);
            return;
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            work_ = &work;
            parts_ = parts;
            next_.store(0);
            unfinished_.store((int)helpers_.size());
            generation_.fetch_add(1, std::memory_order_release);
        }
        start_.notify_all();
        take(work, parts);
        auto finished = [&] { return unfinished_.load(std::memory_order_acquire) == 0; };
        if (!spin_until(finished)) {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, finished);
        }
        busy_.unlock();
    }

    int threads() const { return (int)helpers_.size() + 1; }

    // Whether run(parts, parallel, ...) hands parts to the helpers (unless another run holds them)
    bool spreads(bool parallel) const {
        return parallel && !helpers_.empty() && !one_thread_.load(std::memory_order_relaxed);
    }

    // Whether every job runs on the calling thread alone, whatever `parallel` says: while the host
    // builds the next layers on the other core (mlx_hybrid/ops/schedule.py decides)
    void keep_to_one_thread(bool value) { one_thread_.store(value, std::memory_order_relaxed); }
    bool kept_to_one_thread() const { return one_thread_.load(std::memory_order_relaxed); }

   private:
    Pool() {
        int wanted = threads_wanted();
        for (int i = 1; i < wanted; i++) helpers_.emplace_back([this] { helper(); });
        for (auto& t : helpers_) t.detach();
    }

    static int threads_wanted() {
        for (const char* name : {"MLX_HYBRID_GEMV_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"}) {
            const char* value = getenv(name);
            if (value != nullptr && atoi(value) > 0) return std::min(atoi(value), 16);
        }
        int count = (int)std::thread::hardware_concurrency();
        cpu_set_t cpus;
        if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) count = CPU_COUNT(&cpus);
        return std::max(1, std::min(count, 16));
    }

    void take(const std::function<void(int)>& work, int parts) {
        for (int p = next_.fetch_add(1); p < parts; p = next_.fetch_add(1)) work(p);
    }

    // A decode step's products come a hundred microseconds or so apart, and waking a sleeping
    // thread takes tens: waiters spin this long before they sleep.
    static constexpr auto SPIN = std::chrono::microseconds(200);

    template <class Done>
    static bool spin_until(const Done& done) {
        auto until = std::chrono::steady_clock::now() + SPIN;
        for (int i = 1;; i++) {
            if (done()) return true;
            _mm_pause();
            if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return false;
        }
    }

    void helper() {
        unsigned long seen = 0;
        auto started = [&] { return generation_.load(std::memory_order_acquire) != seen; };
        for (;;) {
            if (!spin_until(started)) {
                std::unique_lock<std::mutex> lock(mutex_);
                start_.wait(lock, started);
            }
            seen = generation_.load(std::memory_order_acquire);
            // the job stays until every helper has counted itself finished
            take(*work_, parts_);
            if (unfinished_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lock(mutex_);
                done_.notify_one();
            }
        }
    }

    std::vector<std::thread> helpers_;
    std::mutex busy_, mutex_;
    std::condition_variable start_, done_;
    std::atomic<unsigned long> generation_{0};
    std::atomic<int> unfinished_{0};
    int parts_ = 0;
    std::atomic<int> next_{0};
    std::atomic<bool> one_thread_{false};
    const std::function<void(int)>* work_ = nullptr;
};

}  // namespace mlx_hybrid
