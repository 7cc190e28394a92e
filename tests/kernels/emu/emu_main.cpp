// Standalone driver for the sanitizer builds (real-thread mode): a launch read from a file, run on
// plain malloc'd buffers of exactly the tensors' sizes (so AddressSanitizer's redzones sit right
// at their ends), buffers written back to a file. Included by the wrapper harness.py generates;
// it defines emu_table, one entry per name expression.
//
// Input (little-endian): i64 kernel index, u32 grid[3], u32 block[3], i64 smem, i64 nbuf,
// per buffer i64 nbytes + bytes; i64 nargs, per arg i32 code + u64 value, where a pointer's value
// is (buffer index << 40 | byte offset). Output: every buffer's bytes, in order.
#include <fstream>
#include <iostream>

template <typename T> static T read_pod(std::ifstream& in) {
  T v{};
  in.read(reinterpret_cast<char*>(&v), sizeof(T));
  return v;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " IN OUT\n";
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  const long long index = read_pod<long long>(in);
  emu::LaunchArgs a{};
  for (auto& g : a.grid) g = read_pod<unsigned>(in);
  for (auto& b : a.block) b = read_pod<unsigned>(in);
  a.smem_bytes = read_pod<long long>(in);
  std::vector<char*> bufs((size_t)read_pod<long long>(in));
  std::vector<long long> sizes(bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) {
    sizes[i] = read_pod<long long>(in);
    bufs[i] = static_cast<char*>(std::malloc((size_t)std::max(sizes[i], 1LL)));
    in.read(bufs[i], sizes[i]);
  }
  a.nargs = (int)read_pod<long long>(in);
  std::vector<int> codes((size_t)a.nargs);
  std::vector<uint64_t> values((size_t)a.nargs);
  for (int i = 0; i < a.nargs; ++i) {
    codes[i] = read_pod<int>(in);
    values[i] = read_pod<uint64_t>(in);
    if (codes[i] < emu::S_I32) values[i] = (uint64_t)(uintptr_t)(bufs[values[i] >> 40] + (values[i] & ((1ULL << 40) - 1)));
  }
  std::vector<char> error(1024);
  a.codes = codes.data();
  a.values = values.data();
  a.error = error.data();
  a.error_len = (long long)error.size();
  if (emu_table[index](&a)) {
    std::cerr << "launch failed: " << error.data() << "\n";
    return 3;
  }
  std::ofstream out(argv[2], std::ios::binary);
  for (size_t i = 0; i < bufs.size(); ++i) out.write(bufs[i], sizes[i]);
  for (char* b : bufs) std::free(b);
  return 0;
}
