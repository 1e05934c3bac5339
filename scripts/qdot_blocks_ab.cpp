// The integer block kernels of two source trees in one process, alternating call by call, one thread:
// each existing block type's matmul of an N x K weight by M activation rows, p25 of 40 calls each, and
// whether both give the same bits. Written for the change that added QActivations.half_sum (Q2_K's
// offsets per 16 values): "old" is the tree before it (5f8e86c), "new" the tree with it.
//
//   mkdir -p /tmp/ab/old /tmp/ab/new && cd /tmp/ab
//   git -C REPO archive 5f8e86c baselm/cpu/csrc | tar -x -C old --strip-components=3
//   cp REPO/baselm/cpu/csrc/* new/
//   printf '#define base_cpu base_cpu_old\n#include "old/qdot_avx2.cpp"\n' > old_tu.cpp
//   printf '#include "new/qdot_avx2.cpp"\n' > new_tu.cpp
//   F="-O3 -fno-math-errno -std=c++17 -mavx2 -mfma -mf16c"
//   g++ $F -c old_tu.cpp && g++ $F -c new_tu.cpp && g++ $F -I. REPO/scripts/qdot_blocks_ab.cpp old_tu.o new_tu.o -o ab
//   ./ab 8960 1536 1; ./ab 8960 1536 8
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#define base_cpu base_cpu_old
#include "old/qdot.h"
#undef base_cpu
#include "new/qdot.h"

template <class Kern, class Args>
double time_call(const Kern& k, const Args& a, float* scratch) {
  auto t0 = std::chrono::steady_clock::now();
  k.matmul(a, 0, a.ldy, scratch);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
  const int N = atoi(argv[1]), K = atoi(argv[2]), M = atoi(argv[3]);
  const auto& kold = base_cpu_old::avx2::qdot_kernels();
  const auto& knew = base_cpu::avx2::qdot_kernels();
  std::mt19937 rng(1);
  std::vector<float> x(M * K);
  for (auto& v : x) v = (rng() % 2000) / 1000.0f - 1.0f;
  struct T { const char* name; int type; int d_at[2]; };
  T types[] = {{"q4_k", 104, {0, 2}}, {"q5_k", 105, {0, 2}}, {"q6_k", 106, {208, -1}}, {"q4_0", 110, {0, -1}},
               {"q4_1", 111, {0, 2}}, {"q5_0", 112, {0, -1}}, {"q8_0", 118, {0, -1}}, {"q4_0r", 120, {0, -1}},
               {"q4_1r", 121, {0, 2}}, {"q8_0r", 128, {0, -1}}};
  for (auto& t : types) {
    const bool super = t.type < 110;
    const int bb = base_cpu::block_bytes(t.type), bv = super ? 256 : 32;
    const int64_t row_bytes = K / bv * bb;
    std::vector<uint8_t> w(N * row_bytes);
    for (auto& b : w) b = rng();
    for (int64_t s = 0; s < N * (int64_t)K / bv; ++s)
      for (int at : t.d_at) if (at >= 0 && !(t.type >= 120)) { w[s * bb + at] = 0x1f; w[s * bb + at + 1] = 0x1d; }
    if (t.type >= 120) for (int64_t s = 0; s < N * (int64_t)K / bv / 8; ++s) for (int i = 0; i < 16 + (t.d_at[1] >= 0 ? 16 : 0); i += 2) { w[s * 8 * bb + i] = 0x1f; w[s * 8 * bb + i + 1] = 0x1d; }
    std::vector<int16_t> q(M * K); std::vector<float> d(M * K / 32), sum(M * K / 32), qsum(M * K / 32);
    std::vector<float> yo(M * N), yn(M * N), scratch(4 * K / 32 + 16);
    knew.quantize(x.data(), K, M, K, t.type, 32, 16, q.data(), d.data(), sum.data(), qsum.data());
    base_cpu_old::QdotArgs ao{base_cpu_old::QActivations{q.data(), 16, d.data(), sum.data(), qsum.data()}, M, K, w.data(), row_bytes, nullptr, nullptr, 0, 0, t.type, 32, nullptr, yo.data(), N};
    base_cpu::QdotArgs an{base_cpu::QActivations{q.data(), 16, d.data(), sum.data(), qsum.data(), nullptr}, M, K, w.data(), row_bytes, nullptr, nullptr, 0, 0, t.type, 32, nullptr, yn.data(), N};
    std::vector<double> to, tn;
    for (int r = 0; r < 40; ++r) {
      to.push_back(time_call(kold, ao, scratch.data()));
      tn.push_back(time_call(knew, an, scratch.data()));
    }
    std::sort(to.begin(), to.end()); std::sort(tn.begin(), tn.end());
    double o = to[10], n = tn[10];
    bool same = std::memcmp(yo.data(), yn.data(), yo.size() * sizeof(float)) == 0;
    printf("%-6s %dx%d M=%d  old %8.1f us  new %8.1f us  new/old %.3f  same bits %s\n", t.name, N, K, M, o, n, n / o, same ? "yes" : "NO");
  }
}
