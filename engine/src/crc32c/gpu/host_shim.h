// Runs a CUDA kernel's source on the CPU, for tests: each block's threads
// are OS threads, a warp's shuffles meet at a barrier, atomics are C++
// atomics. Only what kernel.cu uses. C++20.
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define PDSTOR_HOST_EMULATION 1
typedef unsigned int u32;
typedef unsigned long long u64;
struct uint4 { u32 x, y, z, w; };
struct dim3 { u32 x = 1, y = 1, z = 1; };

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

struct Warp {
    std::barrier<> meet{32};
    u32 slot[32];
};
thread_local Warp* this_warp;

inline u32 __shfl_xor_sync(u32, u32 v, int mask) {
    const u32 lane = threadIdx.x & 31u;
    this_warp->slot[lane] = v;
    this_warp->meet.arrive_and_wait();
    const u32 got = this_warp->slot[lane ^ static_cast<u32>(mask)];
    this_warp->meet.arrive_and_wait();
    return got;
}

inline u32 atomicXor(u32* p, u32 v) { return std::atomic_ref<u32>(*p).fetch_xor(v); }

// kernel<<<blocks, threads>>>(): the blocks one after another, each block's
// threads at once.
inline void launch(u32 blocks, u32 threads, const std::function<void()>& kernel) {
    gridDim.x = blocks;
    blockDim.x = threads;
    for (u32 b = 0; b < blocks; ++b) {
        std::vector<std::unique_ptr<Warp>> warps;
        for (u32 w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Warp>());
        std::vector<std::thread> running;
        for (u32 i = 0; i < threads; ++i) {
            running.emplace_back([&, b, i] {
                blockIdx.x = b;
                threadIdx.x = i;
                this_warp = warps[i / 32].get();
                kernel();
            });
        }
        for (auto& t : running) t.join();
    }
}
