// The integer block kernels against the affine ones, one thread, one process: each type's matmul of
// an 8960 x 1536 weight (random bytes, sane float16 scales) by M activation rows, best of 30 calls.
//
//   g++ -O3 -fno-math-errno -std=c++17 -mavx2 -mfma -mf16c -Ibaselm/cpu/csrc \
//       scripts/qdot_blocks_bench.cpp baselm/cpu/csrc/qdot_avx2.cpp -o /tmp/qdot_blocks_bench
//   /tmp/qdot_blocks_bench "" 1      # every type, one activation row ("q3_k q8aff" picks some)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
#include "kernels.h"
#include "qdot.h"
using namespace base_cpu;
constexpr uint16_t kHalf = 0x1d1f;  // float16 0.0052: each block's d (and dmin, m)
int main(int argc, char** argv) {
  const int N = 8960, K = 1536, M = argc > 2 ? atoi(argv[2]) : 1;
  const auto& kern = avx2::qdot_kernels();
  std::mt19937 rng(1);
  std::vector<float> x(M * K);
  for (auto& v : x) v = (rng() % 2000) / 1000.0f - 1.0f;
  std::vector<int16_t> q(M * K); std::vector<float> d(M * K / 32), sum(M * K / 32), qsum(M * K / 32), hs(M * K / 16);
  for (int h = 0; h < M * K / 16; ++h) { float t = 0; for (int i = 0; i < 16; ++i) t += x[16*h+i]; hs[h] = t; }
  std::vector<float> y(M * N), scratch(4 * K / 32 + 16);
  struct T { const char* name; int type; int d_at[2]; };
  T types[] = {{"q2_k", kQ2K, {80, 82}}, {"q3_k", kQ3K, {108, -1}}, {"q4_k", kQ4K, {0, 2}}, {"q6_k", kQ6K, {208, -1}},
               {"iq4_xs", kIQ4XS, {0, -1}}, {"iq4_nl", kIQ4NL, {0, -1}}, {"q4_0", kQ4_0, {0, -1}},
               {"q8_0", kQ8_0, {0, -1}}, {"q8aff", 8, {-1, -1}}, {"q4aff", 4, {-1, -1}}};
  const char* only = argc > 1 ? argv[1] : "";
  for (auto& t : types) {
    if (*only && strstr(only, t.name) == nullptr) continue;
    const bool block = is_block(t.type);
    kern.quantize(x.data(), K, M, K, t.type, 32, 16, q.data(), d.data(), sum.data(), qsum.data());
    const int64_t row_bytes = block ? K / block_values(t.type) * block_bytes(t.type) : K * t.type / 8;
    std::vector<uint8_t> w(N * row_bytes);
    for (auto& b : w) b = rng();
    std::vector<float> sc(N * K / 32), bi(N * K / 32);
    for (auto& v : sc) v = 0.01f; for (auto& v : bi) v = -0.1f;
    if (block) for (int64_t s = 0; s < N * K / block_values(t.type); ++s) for (int at : t.d_at) if (at >= 0) memcpy(&w[s * block_bytes(t.type) + at], &kHalf, 2);
    QdotArgs a{QActivations{q.data(), 16, d.data(), sum.data(), qsum.data(), hs.data()}, M, K, w.data(), row_bytes,
               sc.data(), bi.data(), K / 32, kScaleF32, t.type, 32, nullptr, y.data(), N};
    double best = 1e9;
    for (int r = 0; r < 30; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      kern.matmul(a, 0, N, scratch.data());
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, us);
    }
    printf("%-7s M=%d %8.0f us  (%.1f ns/block)\n", t.name, M, best, best * 1000 / (N * (double)K / 32));
  }
}
