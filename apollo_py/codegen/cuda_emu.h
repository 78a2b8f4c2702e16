// apollo_py: run generated CUDA C++ on the CPU (g++ -std=c++17 -DAPOLLO_CUDA_EMU).
//
// Each block's threads are fibers (ucontext) run on one OS thread, one after another, until
// each reaches a barrier or returns: __syncthreads() yields to the scheduler, which releases
// the barrier once every live thread of the block has arrived.  A warp shuffle is a write to a
// per-thread slot, a barrier, a read of the partner's slot and a barrier, so the kernels must
// call shuffles from block-uniform control flow (the generated ones do: the block and column
// reductions are called by every thread of the block).  __shared__ variables are function
// statics, shared by the fibers of a block; blocks run one after another.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)
#define __restrict__ __restrict

struct ap_dim3 { unsigned int x, y, z; };
static ap_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct ap_half { unsigned short x; };
static inline float ap_h2f(ap_half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
static inline ap_half ap_f2h(float v) { _Float16 f = (_Float16)v; ap_half h; std::memcpy(&h.x, &f, 2); return h; }
#define AP_NAN NAN
#define AP_INF INFINITY

namespace apemu {
enum { RUN = 0, WAIT = 1, DONE = 2 };
struct Fiber { ucontext_t ctx; int state; unsigned x, y, z; };
static const size_t STACK = 128 * 1024;
static ucontext_t sched;
static std::vector<Fiber> fibers;
static char *stacks;      // malloc'd per launch, not zeroed: only the pages a fiber uses are touched
static std::vector<uint64_t> slots;
static int cur;
static std::function<void()> *body;

static void trampoline() {
    (*body)();
    fibers[cur].state = DONE;
    swapcontext(&fibers[cur].ctx, &sched);
}

static inline void barrier() {
    fibers[cur].state = WAIT;
    swapcontext(&fibers[cur].ctx, &sched);
}

static inline void set_thread(int i) {
    cur = i;
    threadIdx.x = fibers[i].x; threadIdx.y = fibers[i].y; threadIdx.z = fibers[i].z;
}

static void run_block() {
    const int n = (int)fibers.size();
    for (int i = 0; i < n; ++i) {
        getcontext(&fibers[i].ctx);
        fibers[i].ctx.uc_stack.ss_sp = stacks + (size_t)i * STACK;
        fibers[i].ctx.uc_stack.ss_size = STACK;
        fibers[i].ctx.uc_link = &sched;
        makecontext(&fibers[i].ctx, trampoline, 0);
        fibers[i].state = RUN;
    }
    for (;;) {
        for (int i = 0; i < n; ++i) {
            if (fibers[i].state != RUN) continue;
            set_thread(i);
            swapcontext(&sched, &fibers[i].ctx);
        }
        int waiting = 0;
        for (int i = 0; i < n; ++i) waiting += fibers[i].state == WAIT;
        if (!waiting) return;
        for (int i = 0; i < n; ++i) if (fibers[i].state == WAIT) fibers[i].state = RUN;
    }
}

// d = grid x, y, z, block x, y, z
static void launch(const long long *d, std::function<void()> f) {
    gridDim = {(unsigned)d[0], (unsigned)d[1], (unsigned)d[2]};
    blockDim = {(unsigned)d[3], (unsigned)d[4], (unsigned)d[5]};
    const int n = (int)(d[3] * d[4] * d[5]);
    fibers.assign(n, Fiber());
    stacks = (char *)std::malloc((size_t)n * STACK);
    slots.assign(n, 0);
    int i = 0;
    for (unsigned z = 0; z < blockDim.z; ++z)
        for (unsigned y = 0; y < blockDim.y; ++y)
            for (unsigned x = 0; x < blockDim.x; ++x, ++i) { fibers[i].x = x; fibers[i].y = y; fibers[i].z = z; }
    body = &f;
    for (unsigned bz = 0; bz < gridDim.z; ++bz)
        for (unsigned by = 0; by < gridDim.y; ++by)
            for (unsigned bx = 0; bx < gridDim.x; ++bx) {
                blockIdx = {bx, by, bz};
                run_block();
            }
    std::free(stacks);
    stacks = nullptr;
    std::vector<Fiber>().swap(fibers);
    std::vector<uint64_t>().swap(slots);
}

static inline int linear_tid() {
    return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}
}  // namespace apemu

static inline void __syncthreads() { apemu::barrier(); }

template <class T> static inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const int me = apemu::linear_tid();
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    apemu::slots[me] = bits;
    apemu::barrier();
    const int partner = (me & ~31) | ((me & 31) ^ lane_mask);
    T out;
    bits = apemu::slots[partner < (int)apemu::slots.size() ? partner : me];
    std::memcpy(&out, &bits, sizeof(T));
    apemu::barrier();
    return out;
}
