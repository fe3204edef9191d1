// Emulates, on the CPU, exactly the Metal features the kernels in metal/ use:
// thread positions, simdgroup lanes, simd_sum, threadgroup memory and threadgroup_barrier,
// address-space qualifiers and metal::exp, log, rsqrt, fma.
//
// Threads run as fibers, all the threads of a threadgroup at once; they run in turn up to each
// simd_sum (where the scheduler adds their simdgroup's values and resumes it) or
// threadgroup_barrier (where it resumes them when all have come). On x86-64 fibers switch with a few instructions (the
// callee-saved registers and the stack pointer); elsewhere with ucontext. Threadgroups and simdgroups follow Metal's
// dispatchThreads: lanes are consecutive linear indices within a threadgroup.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>

typedef unsigned int uint;
struct uint3 {
    uint x, y, z;
};
#define device
#define constant
// one threadgroup runs at a time, so its memory can be one static array for all of them
#define threadgroup static
#define thread

namespace metal {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
}  // namespace metal

// Metal's 16-bit floats, converted from float32 rounding to nearest even, as MLX and the GPUs
// do (a NaN stays a NaN).
inline uint32_t bits_of(float value) {
    uint32_t u;
    std::memcpy(&u, &value, sizeof u);
    return u;
}
inline float float_of(uint32_t u) {
    float value;
    std::memcpy(&value, &u, sizeof value);
    return value;
}
// bfloat: the top half of a float32.
struct bfloat {
    uint16_t bits;
    bfloat() = default;
    bfloat(float value) {
        const uint32_t u = bits_of(value);
        bits = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    operator float() const { return float_of(uint32_t(bits) << 16); }
};
// half: IEEE binary16 (written out: compilers before GCC 12 have no _Float16 on x86-64).
struct half {
    uint16_t bits;
    half() = default;
    half(float value) {
        const uint32_t sign = (bits_of(value) >> 16) & 0x8000u, magnitude = bits_of(value) & 0x7fffffffu;
        if (magnitude > 0x7f800000u) {
            bits = uint16_t(sign | 0x7e00u);  // NaN
        } else if (magnitude >= 0x477ff000u) {
            bits = uint16_t(sign | 0x7c00u);  // 65520 and up round to infinity
        } else if (magnitude < 0x38800000u) {
            // below 2^-14: a multiple of 2^-24 (scaling by 2^24 is exact; nearbyint rounds to even)
            bits = uint16_t(sign | uint32_t(std::nearbyint(std::fabs(value) * 16777216.0f)));
        } else {
            // 23 mantissa bits to 10, to nearest even (a carry moves into the exponent), and
            // the exponent's bias from 127 to 15
            bits = uint16_t(sign | ((magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23)) >> 13));
        }
    }
    operator float() const {
        const uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
        const float value = exponent == 0    ? std::ldexp(float(mantissa), -24)
                            : exponent == 31 ? float_of(0x7f800000u | (mantissa << 13))
                                             : float_of(((exponent + 112u) << 23) | (mantissa << 13));
        return bits & 0x8000u ? -value : value;
    }
};

namespace emu {

constexpr int kLanes = 32;
constexpr size_t kStack = 64 * 1024;

// A kernel body: a callable of (thread_position_in_grid, thread_index_in_simdgroup), by reference
// (no <functional>: it would double each kernel's compile time).
struct Body {
    void (*call)(const void* body, uint3 position, uint lane);
    const void* body;
    void operator()(uint3 position, uint lane) const { call(body, position, lane); }
};
template <class F>
Body body_of(const F& f) {
    auto call = [](const void* body, uint3 position, uint lane) { (*static_cast<const F*>(body))(position, lane); };
    return Body{call, &f};
}

#if defined(__x86_64__)
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");

struct Fiber {
    void* sp = nullptr;
    // a fresh stack that "returns" into entry, aligned as after a call
    void start(char* stack, void (*entry)()) {
        auto top = reinterpret_cast<uintptr_t>(stack + kStack) & ~uintptr_t(15);
        auto* slot = reinterpret_cast<void**>(top);
        *--slot = nullptr;                              // entry's (never used) return address
        *--slot = reinterpret_cast<void*>(entry);       // popped by emu_switch's ret
        for (int i = 0; i < 6; ++i) *--slot = nullptr;  // rbp, rbx, r12-r15
        sp = slot;
    }
};
inline void switch_to(Fiber& from, Fiber& to) { emu_switch(&from.sp, to.sp); }
#else
struct Fiber {
    ucontext_t context;
    void start(char* stack, void (*entry)()) {
        getcontext(&context);
        context.uc_stack.ss_sp = stack;
        context.uc_stack.ss_size = kStack;
        context.uc_link = nullptr;
        makecontext(&context, entry, 0);
    }
};
inline void switch_to(Fiber& from, Fiber& to) { swapcontext(&from.context, &to.context); }
#endif

constexpr int kMaxThreads = 1024;  // Metal's and CUDA's largest threadgroup

enum Wait : char { kRunning, kSimdSum, kBarrier };

// The threads of one threadgroup, each a fiber. A thread runs until it reaches simd_sum or
// threadgroup_barrier (or ends); the scheduler then adds the values of each simdgroup whose
// threads all wait in simd_sum, in lane order, and lets them go on, or, when every thread waits
// at the barrier, lets them all go on.
struct Threadgroup {
    Fiber scheduler;
    Fiber threads[kMaxThreads];
    char* stacks[kMaxThreads] = {};
    bool done[kMaxThreads];
    Wait waiting[kMaxThreads];
    uint3 position[kMaxThreads];
    float values[kMaxThreads];
    float results[kMaxThreads / kLanes];
    int count = 0;
    int current = -1;
    const Body* body = nullptr;
    long barriers = 0;  // simd_sum calls completed (one a simdgroup), for the harness's checks
};

inline Threadgroup& group() {
    static Threadgroup g;
    return g;
}

inline void thread_entry() {
    Threadgroup& g = group();
    const int self = g.current;
    (*g.body)(g.position[self], static_cast<uint>(self % kLanes));
    g.done[self] = true;
    switch_to(g.threads[self], g.scheduler);
}

// Lets the threads of each simdgroup that all wait in simd_sum go on; whether any did.
inline bool finish_simd_sums(Threadgroup& g) {
    bool any = false;
    for (int first = 0; first < g.count; first += kLanes) {
        const int last = first + kLanes < g.count ? first + kLanes : g.count;
        int live = 0, summing = 0;
        for (int t = first; t < last; ++t) {
            live += !g.done[t];
            summing += !g.done[t] && g.waiting[t] == kSimdSum;
        }
        if (summing == 0) continue;
        if (summing != live) std::abort();  // lanes of a simdgroup diverged around a simd_sum
        float sum = 0.0f;
        for (int t = first; t < last; ++t) {
            if (!g.done[t]) {
                sum += g.values[t];
                g.waiting[t] = kRunning;
            }
        }
        g.results[first / kLanes] = sum;
        ++g.barriers;
        any = true;
    }
    return any;
}

// Run one threadgroup of `count` threads (in linear order) to completion.
inline void run_threadgroup(const Body& body, const uint3* positions, int count) {
    Threadgroup& g = group();
    g.body = &body;
    g.count = count;
    for (int t = 0; t < count; ++t) {
        if (!g.stacks[t]) g.stacks[t] = static_cast<char*>(std::malloc(kStack));
        g.position[t] = positions[t];
        g.done[t] = false;
        g.waiting[t] = kRunning;
        g.threads[t].start(g.stacks[t], thread_entry);
    }
    for (;;) {
        for (int t = 0; t < count; ++t) {
            if (g.done[t] || g.waiting[t] != kRunning) continue;
            g.current = t;
            switch_to(g.scheduler, g.threads[t]);
        }
        if (finish_simd_sums(g)) continue;
        int live = 0, at_barrier = 0;
        for (int t = 0; t < count; ++t) {
            live += !g.done[t];
            at_barrier += !g.done[t] && g.waiting[t] == kBarrier;
        }
        if (live == 0) return;
        if (at_barrier != count) std::abort();  // a thread ended, or waits elsewhere, while others wait at the barrier
        for (int t = 0; t < count; ++t) g.waiting[t] = kRunning;
    }
}

}  // namespace emu

inline float simd_sum(float value) {
    emu::Threadgroup& g = emu::group();
    const int self = g.current;
    g.values[self] = value;
    g.waiting[self] = emu::kSimdSum;
    emu::switch_to(g.threads[self], g.scheduler);
    return g.results[self / emu::kLanes];
}

enum class mem_flags { mem_none, mem_device, mem_threadgroup };

inline void threadgroup_barrier(mem_flags) {
    emu::Threadgroup& g = emu::group();
    const int self = g.current;
    g.waiting[self] = emu::kBarrier;
    emu::switch_to(g.threads[self], g.scheduler);
}

namespace emu {

// dispatchThreads(grid, threadgroup): every thread of the grid, none beyond it.
inline long dispatch(const Body& body, uint3 grid, uint3 tg) {
    if (tg.x * tg.y * tg.z > kMaxThreads) std::abort();
    group().barriers = 0;
    static uint3 positions[kMaxThreads];
    for (uint gz = 0; gz < grid.z; gz += tg.z)
        for (uint gy = 0; gy < grid.y; gy += tg.y)
            for (uint gx = 0; gx < grid.x; gx += tg.x) {
                // linear order within the threadgroup; every 32 consecutive threads form a simdgroup
                int n = 0;
                for (uint z = gz; z < gz + tg.z && z < grid.z; ++z)
                    for (uint y = gy; y < gy + tg.y && y < grid.y; ++y)
                        for (uint x = gx; x < gx + tg.x && x < grid.x; ++x) positions[n++] = uint3{x, y, z};
                run_threadgroup(body, positions, n);
            }
    return group().barriers;
}

}  // namespace emu
