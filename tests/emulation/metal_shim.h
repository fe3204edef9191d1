// Emulates, on the CPU, exactly the Metal features the kernels in metal/ use:
// thread positions, simdgroup lanes, simd_sum, address-space qualifiers and metal::exp.
//
// Threads run as fibers, one per lane of a simdgroup; the lanes of a simdgroup run
// in turn up to each simd_sum, a barrier at which the scheduler adds their values
// and resumes them all. On x86-64 fibers switch with a few instructions (the
// callee-saved registers and the stack pointer); elsewhere with ucontext. Threadgroups and simdgroups follow Metal's
// dispatchThreads: lanes are consecutive linear indices within a threadgroup.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>

typedef unsigned int uint;
struct uint3 {
    uint x, y, z;
};
#define device
#define constant
#define threadgroup
#define thread

namespace metal {
inline float exp(float x) { return std::exp(x); }
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

using Body = std::function<void(uint3, uint)>;

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

struct Simdgroup {
    Fiber scheduler;
    Fiber lanes[kLanes];
    char* stacks[kLanes] = {};
    bool done[kLanes];
    bool waiting[kLanes];
    uint3 position[kLanes];
    float values[kLanes];
    float result = 0.0f;
    int count = 0;
    int current = -1;
    const Body* body = nullptr;
    long barriers = 0;  // simd_sum calls completed, for the harness's checks
};

inline Simdgroup& group() {
    static Simdgroup g;
    return g;
}

inline void lane_entry() {
    Simdgroup& g = group();
    const int lane = g.current;
    (*g.body)(g.position[lane], static_cast<uint>(lane));
    g.done[lane] = true;
    switch_to(g.lanes[lane], g.scheduler);
}

// Run one simdgroup of `count` lanes to completion.
inline void run_simdgroup(const Body& body, const uint3* positions, int count) {
    Simdgroup& g = group();
    g.body = &body;
    g.count = count;
    for (int lane = 0; lane < count; ++lane) {
        if (!g.stacks[lane]) g.stacks[lane] = static_cast<char*>(std::malloc(kStack));
        g.position[lane] = positions[lane];
        g.done[lane] = false;
        g.waiting[lane] = false;
        g.lanes[lane].start(g.stacks[lane], lane_entry);
    }
    for (;;) {
        int live = 0, waiting = 0;
        for (int lane = 0; lane < count; ++lane) {
            if (g.done[lane]) continue;
            g.current = lane;
            g.waiting[lane] = false;
            switch_to(g.scheduler, g.lanes[lane]);
            if (!g.done[lane]) {
                ++live;
                waiting += g.waiting[lane];
            }
        }
        if (live == 0) return;
        if (waiting != live) std::abort();  // lanes diverged around a simd_sum
        float sum = 0.0f;
        for (int lane = 0; lane < count; ++lane) sum += g.values[lane];
        g.result = sum;
        ++g.barriers;
    }
}

}  // namespace emu

inline float simd_sum(float value) {
    emu::Simdgroup& g = emu::group();
    const int lane = g.current;
    g.values[lane] = value;
    g.waiting[lane] = true;
    emu::switch_to(g.lanes[lane], g.scheduler);
    return g.result;
}

namespace emu {

// dispatchThreads(grid, threadgroup): every thread of the grid, none beyond it.
inline long dispatch(const Body& body, uint3 grid, uint3 tg) {
    group().barriers = 0;
    for (uint gz = 0; gz < grid.z; gz += tg.z)
        for (uint gy = 0; gy < grid.y; gy += tg.y)
            for (uint gx = 0; gx < grid.x; gx += tg.x) {
                // linear order within the threadgroup; every 32 consecutive threads form a simdgroup
                uint3 positions[kLanes];
                int n = 0;
                for (uint z = gz; z < gz + tg.z && z < grid.z; ++z)
                    for (uint y = gy; y < gy + tg.y && y < grid.y; ++y)
                        for (uint x = gx; x < gx + tg.x && x < grid.x; ++x) {
                            positions[n++] = uint3{x, y, z};
                            if (n == kLanes) {
                                run_simdgroup(body, positions, n);
                                n = 0;
                            }
                        }
                if (n) run_simdgroup(body, positions, n);
            }
    return group().barriers;
}

}  // namespace emu
