// What a table is: dimension, optimizer, initializer, admission and eviction.
#pragma once

#include <cstdint>
#include <string>

namespace wuliang::ps {

enum class OptimizerKind : uint8_t { kSgd, kAdagrad, kAdam, kFtrl };

// Hyper-parameters of the optimizer applied on the engine. Fields that an
// optimizer does not use are ignored.
struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kAdagrad;
  float learning_rate = 0.01f;       // all (FTRL: alpha)
  float initial_accumulator = 0.1f;  // Adagrad, FTRL: start of the g^2 sum
  float epsilon = 1e-7f;             // Adagrad, Adam
  float beta1 = 0.9f;                // Adam
  float beta2 = 0.999f;              // Adam
  float beta = 0.0f;                 // FTRL (McMahan et al. 2013)
  float l1 = 0.0f;                   // FTRL
  float l2 = 0.0f;                   // FTRL (paper's lambda2, not TF's 2*l2)
  float clip_norm = 0.0f;            // > 0: clip each row's gradient L2 norm
};

// Floats of optimizer state per row.
int StateDim(OptimizerKind kind, int dim);

enum class InitKind : uint8_t {
  kNormal,
  kTruncatedNormal,  // redraws values beyond 2 stddev
  kUniform,
  kZeros,
  kConstant,
};

// Initial vectors are a pure function of (table seed, key, InitSpec).
struct InitSpec {
  InitKind kind = InitKind::kTruncatedNormal;
  float mean = 0.0f;      // normal, truncated normal
  float stddev = 0.05f;   // normal, truncated normal
  float minval = -0.05f;  // uniform
  float maxval = 0.05f;   // uniform
  float value = 0.0f;     // constant
};

// A key gets a row on its min_count-th sighting in a training pull. Until
// then it reads as its initial vector and updates to it are dropped.
struct AdmissionSpec {
  uint32_t min_count = 1;                // 1: admit at first sight
  uint32_t pending_capacity = 1u << 20;  // pending keys per shard (bounded)
};

// Applied by Engine::Evict. Zero disables a criterion.
struct EvictionSpec {
  uint64_t ttl_steps = 0;    // last update older than this many steps
  uint64_t ttl_seconds = 0;  // last update older than this many seconds
  uint32_t min_count = 0;    // fewer sightings than this
  uint64_t max_rows = 0;     // keep at most this many rows (least frequent go)
};

enum class NanPolicy : uint8_t { kDrop, kRaise };

// How a table stores its weights (details/precision.h has the encodings).
// Rows go in and out as float32 whatever the precision: Load and StageRows
// encode, Lookup, Pull(train=false), Export decode. A compressed table
// (kFp16, kInt8) is for serving: training calls on it (Pull with train,
// Push, PullMany with train, PushMany) throw std::invalid_argument.
enum class Precision : uint8_t {
  kFp32,  // float32, exact
  kFp16,  // IEEE half: round to nearest even, saturating at +-65504
  kInt8,  // int8 with a float32 scale per row: scale = max|w| / 127
};

// "fp32", "fp16" or "int8".
const char* PrecisionName(Precision precision);

struct TableSpec {
  std::string name;
  int dim = 0;
  OptimizerSpec optimizer;
  InitSpec initializer;
  uint64_t seed = 0;
  AdmissionSpec admission;
  EvictionSpec eviction;
  NanPolicy nan_policy = NanPolicy::kDrop;  // non-finite gradient rows
  // Rows to hold memory for from creation on (pool chunks and index, faulted
  // in, split over the shards); the table grows past it as usual, and its
  // memory never shrinks below it. 0: grow from empty.
  uint64_t reserve_rows = 0;
  // A serving table: only version applies (Engine::BeginApply ..
  // CommitApply) change it; pushes, training pulls, loads, erases and
  // evictions are refused, and lookups run on the caller's thread.
  bool serving = false;
  Precision precision = Precision::kFp32;
  // Half-life in steps of the rows' show and click statistics (pushes feed
  // them); 0: no decay.
  double stats_half_life = 0.0;
  // An extension block of a sized table (docs/ps_engine.md, "Sizes"): a key
  // gets a row here only while its row in table `grow_base` (same engine,
  // created first) scores at least `grow_promote`, its decayed shows plus
  // grow_click_weight times its decayed clicks; Evict removes rows whose
  // base row scores below `grow_demote` or is gone. Empty: a plain table.
  std::string grow_base;
  double grow_promote = 0.0;
  double grow_demote = 0.0;
  double grow_click_weight = 0.0;
};

// Throws std::invalid_argument naming the bad field.
void ValidateSpec(const TableSpec& spec);

}  // namespace wuliang::ps
