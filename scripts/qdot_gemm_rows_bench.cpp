// The few-row integer loops against the integer GEMM at M activation rows, one process: each type's
// product of an N x 1536 weight (random bytes, sane float16 scales; N 8960 stays in L3, 143360 is
// read from memory) by M rows, on 1 or 2 threads (each half of the weight rows), best of 20 (6 from
// memory) calls; and the largest difference between the two paths' results against the largest value.
// The GEMM's rows as linear.cpp's gemm_buffers lays them out (VNNI: up to 8 rows in pairs of lanes).
//
//   F="-O3 -fno-math-errno -std=c++17 -mavx2 -mfma -mf16c -pthread -Ibaselm/cpu/csrc"
//   g++ $F -DISA=avx2 scripts/qdot_gemm_rows_bench.cpp baselm/cpu/csrc/qdot_avx2.cpp -o /tmp/rows_avx2
//   g++ $F -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -DISA=avx512 \
//       scripts/qdot_gemm_rows_bench.cpp baselm/cpu/csrc/qdot_avx512.cpp -o /tmp/rows_avx512
//   /tmp/rows_avx512 "q4_k q6_k" 8960 1      # types, N, threads
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels.h"
#include "qdot.h"
using namespace base_cpu;
constexpr uint16_t kHalf = 0x1d1f;  // float16 0.0052: each block's d (and dmin)

template <class Call>
double best_us(int calls, int threads, int N, Call call) {
  double best = 1e9;
  for (int r = 0; r < calls; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    if (threads == 1) {
      call(0, N, 0);
    } else {
      std::thread other([&] { call(N / 2, N, 1); });
      call(0, N / 2, 0);
      other.join();
    }
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  const int K = 1536, N = argc > 2 ? atoi(argv[2]) : 8960, threads = argc > 3 ? atoi(argv[3]) : 1;
  const int calls = N > 20000 ? 6 : 20;
  const auto& kern = ISA::qdot_kernels();
  std::mt19937 rng(1);
  struct T { const char* name; int type; int d_at[2]; };
  T types[] = {{"q4_k", kQ4K, {0, 2}}, {"q6_k", kQ6K, {208, -1}}, {"q4_0", kQ4_0, {0, -1}}, {"q8_0", kQ8_0, {0, -1}}};
  const char* only = argc > 1 ? argv[1] : "";
  for (auto& t : types) {
    if (*only && strstr(only, t.name) == nullptr) continue;
    const int64_t row_bytes = K / block_values(t.type) * block_bytes(t.type);
    std::vector<uint8_t> w(N * row_bytes);
    for (auto& b : w) b = rng();
    for (int64_t s = 0; s < N * K / block_values(t.type); ++s)
      for (int at : t.d_at)
        if (at >= 0) memcpy(&w[s * block_bytes(t.type) + at], &kHalf, 2);
    for (int M : {1, 2, 4, 6, 8, 12, 16, 32, 48}) {
      std::vector<float> x(M * K), few(M * N), gemm(M * N);
      for (auto& v : x) v = (rng() % 2000) / 1000.0f - 1.0f;
      double few_us = 0, gemm_us = 0;
      if (M <= 32) {
        std::vector<int16_t> q(M * K);
        std::vector<float> d(M * K / 32), sum(M * K / 32), qsum(M * K / 32), half(M * K / 16);
        kern.quantize(x.data(), K, M, K, t.type, 32, 16, q.data(), d.data(), sum.data(), qsum.data());
        QdotArgs a{QActivations{q.data(), 16, d.data(), sum.data(), qsum.data(), half.data()}, M, K, w.data(), row_bytes,
                   nullptr, nullptr, 0, kScaleF32, t.type, 32, nullptr, few.data(), N};
        std::vector<float> scratch[2] = {std::vector<float>(qdot_scratch_floats(K)), std::vector<float>(qdot_scratch_floats(K))};
        few_us = best_us(calls, threads, N, [&](int n0, int n1, int th) { kern.matmul(a, n0, n1, scratch[th].data()); });
      }
      if (kern.gemm != nullptr && M >= 4) {
        const bool pairs = kern.gemm_bytes && M <= 8;
        int rows = (M + 15) / 16 * 16;
        if (rows / 16 % 2 == 0 && !pairs) rows += 16;
        const size_t values = static_cast<size_t>(rows) * K;
        std::vector<int16_t> q(values);
        std::vector<float> sc(values / 8);
        float* d = sc.data();
        GemmActivations ga{q.data(), 16, gemm_code_top(16, t.type), d, d + values / 32, d + 3 * (values / 32), rows, pairs};
        kern.gemm_quantize(x.data(), K, M, 0, rows, K, ga);
        GemmArgs g{ga, M, K, w.data(), row_bytes, t.type, nullptr, gemm.data(), N};
        std::vector<float> scratch[2] = {std::vector<float>(gemm_scratch_floats(K, rows)),
                                         std::vector<float>(gemm_scratch_floats(K, rows))};
        gemm_us = best_us(calls, threads, N, [&](int n0, int n1, int th) { kern.gemm(g, n0, n1, scratch[th].data()); });
      }
      double err = 0, top = 0;
      if (few_us > 0 && gemm_us > 0)
        for (int i = 0; i < M * N; ++i) err = std::max(err, (double)std::fabs(few[i] - gemm[i])), top = std::max(top, (double)std::fabs(few[i]));
      printf("%-5s M=%2d  few-row %8.0f us  gemm %8.0f us  gemm/few-row speed %5.2fx  difference %.2g of %.2g\n", t.name, M,
             few_us, gemm_us, few_us > 0 && gemm_us > 0 ? few_us / gemm_us : 0.0, err, top);
    }
  }
}
