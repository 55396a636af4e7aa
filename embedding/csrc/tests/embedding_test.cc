// C++ tests of the training bridge's host kernels (run under TSan and ASan).
#include <cstdio>
#include <random>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "wuliang/embedding/kernels.h"

using namespace wuliang::embedding;

namespace {

void TestIndexIn() {
  const uint64_t a[] = {5, 9, 2, 7, 9, 11};
  const uint64_t b[] = {7, 9, 100};
  int32_t out[6];
  IndexIn(a, 6, b, 3, 10, out);
  CHECK((std::vector<int32_t>(out, out + 6) == std::vector<int32_t>{-1, 11, -1, 10, 11, -1}));
  IndexIn(a, 6, b, 0, 0, out);
  CHECK((std::vector<int32_t>(out, out + 6) == std::vector<int32_t>(6, -1)));
}

// Random keys against a std::unordered_map, from several threads at once
// (each with its own scratch set).
void TestIndexInRandomConcurrent() {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      std::mt19937_64 rng(t);
      for (int round = 0; round < 20; ++round) {
        std::vector<uint64_t> b;
        std::unordered_map<uint64_t, int32_t> where;
        for (size_t j = 0, nb = rng() % 3000; j < nb; ++j) {
          const uint64_t k = rng() % 5000;
          if (where.emplace(k, static_cast<int32_t>(b.size())).second) b.push_back(k);
        }
        std::vector<uint64_t> a(rng() % 3000);
        for (auto& k : a) k = rng() % 5000;
        std::vector<int32_t> out(a.size());
        IndexIn(a.data(), a.size(), b.data(), b.size(), 7, out.data());
        for (size_t i = 0; i < a.size(); ++i) {
          auto it = where.find(a[i]);
          CHECK(out[i] == (it == where.end() ? -1 : 7 + it->second));
        }
      }
    });
  }
  for (auto& th : threads) th.join();
}

void TestScatterAddRows() {
  float out[3 * 2] = {};
  const int32_t index[] = {2, 0, 2};
  const float values[] = {1, 2, 3, 4, 5, 6};
  ScatterAddRows(out, 3, 2, index, 3, values);
  CHECK((std::vector<float>(out, out + 6) == std::vector<float>{3, 4, 0, 0, 6, 8}));
  const int32_t bad[] = {0, 3};
  bool threw = false;
  try {
    ScatterAddRows(out, 3, 2, bad, 2, values);
  } catch (const std::out_of_range&) {
    threw = true;
  }
  CHECK(threw && out[0] == 3);  // checked before anything is written
}

}  // namespace

int main() {
  TestIndexIn();
  TestIndexInRandomConcurrent();
  TestScatterAddRows();
  std::puts("embedding_test: all passed");
  return 0;
}
