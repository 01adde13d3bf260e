// CRC-32C on the GPU, over whole 512-byte rows of device memory, in place.
//
// The host half (engine/src/crc32c/gpu.rs) cuts a range into a head of under
// 16 bytes, whole rows from a 16-byte-aligned address, and a tail of under
// 512 bytes; checksums head and tail on the CPU; launches this over the rows
// with the tables it builds from the same definition as the CPU's (gf2.rs);
// and combines the three. This file is the kernel's only source: nvcc makes
// kernel.ptx of it (`cargo xtask cuda-ptx`), and the engine's tests compile
// it as C++ and run it on the CPU through host_shim.h against the reference.
//
// A warp owns a run of consecutive rows; lane l reads the 16 bytes at
// 16·l of each row (one coalesced 512-byte read per warp per row) and keeps
// the raw CRC (no inversions) of its words as if the 496 bytes between them
// were zero, by Horner's rule: acc = acc · x^(8·512) ⊕ crc(word). Each lane
// then moves its acc past the bytes after its last word in the row, the warp
// XORs its lanes (a shuffle tree), and lane 0 moves that past the rows after
// the warp's and XORs it into *out. XOR is linear, so the order in which
// warps land does not matter: *out is the raw CRC of all rows from zero.

#ifndef PDSTOR_HOST_EMULATION
typedef unsigned int u32;
typedef unsigned long long u64;
#endif

#define ROW_BYTES 512u
// Where each table starts in `t` (u32 words); the host builds them.
#define T_SLICE 0u    // 16 x 256: raw CRC of byte b then k zero bytes, at k*256 + b
#define T_ROW 4096u   // 4 x 256: (b << 8i) * x^(8*512) mod P, at T_ROW + i*256 + b
#define T_LANE 5120u  // 32: x^(8*16*j) mod P
#define T_X2N 5152u   // 64: x^(2^k) mod P

// a * b mod P, reflected (bit 31 is x^0), without branches.
__device__ __forceinline__ u32 gf2_mul(u32 a, u32 b) {
    u32 p = 0;
    for (int i = 0; i < 32; ++i) {
        p ^= b & (0u - ((a >> (31 - i)) & 1u));
        b = (b >> 1) ^ (0x82f63b78u & (0u - (b & 1u)));
    }
    return p;
}

// v * x^(8n) mod P: v moved past n zero bytes.
__device__ __forceinline__ u32 shift_bytes(u32 v, u64 n, const u32* __restrict__ t) {
    u64 bits = n * 8u;
    for (u32 k = 0; bits != 0; ++k, bits >>= 1) {
        if (bits & 1u) {
            v = gf2_mul(v, t[T_X2N + k]);
        }
    }
    return v;
}

// The raw CRC of 16 bytes from zero: byte j is followed by 15 - j more.
__device__ __forceinline__ u32 crc16(uint4 w, const u32* __restrict__ t) {
    const u32 q[4] = {w.x, w.y, w.z, w.w};
    u32 c = 0;
    for (u32 j = 0; j < 16; ++j) {
        c ^= t[T_SLICE + (15u - j) * 256u + ((q[j >> 2] >> (8u * (j & 3u))) & 0xffu)];
    }
    return c;
}

// acc * x^(8*512) mod P, a byte of acc at a time.
__device__ __forceinline__ u32 times_row(u32 acc, const u32* __restrict__ t) {
    return t[T_ROW + (acc & 0xffu)] ^ t[T_ROW + 256u + ((acc >> 8) & 0xffu)] ^
           t[T_ROW + 512u + ((acc >> 16) & 0xffu)] ^ t[T_ROW + 768u + (acc >> 24)];
}

// rows: whole 512-byte rows at `data` (16-byte aligned); each warp takes
// rows_per_warp of them in turn; blockDim.x a multiple of 32. *out must be
// 0 before the launch; it ends as the rows' raw CRC from zero.
extern "C" __global__ void pdstor_crc32c_rows(const uint4* __restrict__ data, u64 rows, u64 rows_per_warp,
                                              const u32* __restrict__ t, u32* out) {
    const u32 lane = threadIdx.x & 31u;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 first = warp * rows_per_warp;
    if (first >= rows) {
        return;  // the whole warp: `first` is the same for its 32 lanes
    }
    const u64 end = first + rows_per_warp < rows ? first + rows_per_warp : rows;
    u32 acc = 0;
    for (u64 r = first; r < end; ++r) {
        acc = times_row(acc, t) ^ crc16(data[r * 32u + lane], t);
    }
    acc = gf2_mul(acc, t[T_LANE + (31u - lane)]);
    for (int m = 16; m != 0; m >>= 1) {
        acc ^= __shfl_xor_sync(0xffffffffu, acc, m);
    }
    if (lane == 0) {
        atomicXor(out, shift_bytes(acc, (rows - end) * ROW_BYTES, t));
    }
}
