// The benchmark's naive engine against Engine (run under TSan and ASan by
// `make test`): the baseline must do the same math for its timings to mean
// anything.
#include "naive_engine.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "wuliang/ps/engine.h"

using namespace wuliang;
using namespace wuliang::ps;

namespace {

// The naive baseline runs the same initializer and optimizer code: on unique
// keys both engines must agree bit for bit, for every optimizer.
void TestEngineMatchesNaiveBaseline() {
  for (OptimizerKind kind :
       {OptimizerKind::kSgd, OptimizerKind::kAdagrad, OptimizerKind::kAdam, OptimizerKind::kFtrl}) {
    TableSpec spec;
    spec.name = std::string("t");  // not a char* assign: GCC 12 -Wrestrict false positive
    spec.dim = 8;
    spec.seed = 3;
    spec.optimizer.kind = kind;
    spec.optimizer.l1 = 0.01f;
    Engine engine(EngineOptions{3});
    const int table = engine.CreateTable(spec);
    bench::NaiveEngine naive(spec);
    std::mt19937_64 rng(11);
    std::vector<uint64_t> keys(300);
    std::vector<float> grads(300 * 8), a(300 * 8), b(300 * 8);
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < keys.size(); ++i) keys[i] = i * 2654435761ULL + (step % 2);
      for (float& g : grads) g = static_cast<float>(rng() % 2001) / 1000.0f - 1.0f;
      engine.Push(table, keys.data(), keys.size(), grads.data(), /*keys_unique=*/true);
      naive.Push(keys.data(), keys.size(), grads.data());
    }
    engine.Pull(table, keys.data(), keys.size(), a.data(), false);
    naive.Pull(keys.data(), keys.size(), b.data(), false);
    CHECK(a == b);
  }
}

}  // namespace

int main() {
  TestEngineMatchesNaiveBaseline();
  std::puts("naive_engine_test: all passed");
  return 0;
}
