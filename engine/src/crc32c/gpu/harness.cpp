// The test harness: runs kernel.cu on the CPU (host_shim.h).
// argv: tables file (u32 LE), rows file (bytes), rows_per_warp, blocks, threads.
// Prints the rows' raw CRC from zero as 8 hex digits.
#include "host_shim.h"
#include "kernel.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

static std::vector<char> slurp(const char* path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: %s TABLES ROWS ROWS_PER_WARP BLOCKS THREADS\n", argv[0]);
        return 64;
    }
    const std::vector<char> t = slurp(argv[1]), d = slurp(argv[2]);
    std::vector<u32> tables(t.size() / 4);
    std::memcpy(tables.data(), t.data(), tables.size() * 4);
    std::vector<uint4> rows(d.size() / 16);
    std::memcpy(rows.data(), d.data(), rows.size() * 16);
    const u64 per_warp = std::strtoull(argv[3], nullptr, 10);
    u32 out = 0;
    launch(std::strtoul(argv[4], nullptr, 10), std::strtoul(argv[5], nullptr, 10), [&] {
        pdstor_crc32c_rows(rows.data(), d.size() / ROW_BYTES, per_warp, tables.data(), &out);
    });
    std::printf("%08x\n", out);
    return 0;
}
