// Grace periods: when is it safe to free an object that readers found
// through an atomic pointer, without a lock on the read side?
//
// A reader brackets its use of such objects with a ReadScope: one atomic
// increment on entry and one decrement on exit, of a counter picked by the
// calling thread (a cache line of its own while at most kSlots threads call)
// and by the current phase. A writer first unpublishes the object (stores a
// null or another pointer where readers find it), then calls Wait(): it
// returns once every ReadScope that could have found the object has ended,
// and the object can be freed. This is the two-counter scheme of sleepable
// RCU (Linux's SRCU), flipping the phase twice:
//
// * A reader that found the object incremented its counter before it loaded
//   the pointer, and that load came before the writer's unpublishing store
//   (all seq_cst, so one total order): Wait(), which reads counters after
//   the store, sees the increment and waits for the matching decrement. Each
//   counter is only incremented and decremented by scopes on it, so it is
//   never below the scopes that hold it and cannot hide one.
// * Which phase a reader counts in does not matter for safety (Wait() drains
//   both); the phases make Wait() finish under a steady stream of readers:
//   after a flip, new scopes count in the other phase, so the one drained
//   only loses scopes (and gains at most one per thread that read the phase
//   just before the flip).
//
// Wait() blocks until the readers in flight have finished their calls; it is
// for rare writers (DropTable) and must be serialised among them. A thread
// must not Wait() inside its own ReadScope (it would wait for itself).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace wuliang::ps::details {

class GracePeriod {
 public:
  static constexpr int kSlots = 64;

  class ReadScope {
   public:
    explicit ReadScope(const GracePeriod& grace)
        : counter_(
              &grace.counters_[grace.phase_.load(std::memory_order_relaxed) & 1][ThreadSlot()].n) {
      counter_->fetch_add(1, std::memory_order_seq_cst);
    }
    ~ReadScope() { counter_->fetch_sub(1, std::memory_order_release); }
    ReadScope(const ReadScope&) = delete;
    ReadScope& operator=(const ReadScope&) = delete;

   private:
    std::atomic<int64_t>* counter_;
  };

  // Returns once every ReadScope begun before the call has ended (see top).
  void Wait() {
    for (int flip = 0; flip < 2; ++flip) {
      const uint32_t old = phase_.fetch_add(1, std::memory_order_seq_cst) & 1;
      for (Counter& c : counters_[old]) {
        for (int spins = 0; c.n.load(std::memory_order_seq_cst) != 0; ++spins) {
          if (spins < 64) {
            std::this_thread::yield();
          } else {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
        }
      }
    }
  }

 private:
  struct alignas(64) Counter {
    std::atomic<int64_t> n{0};
  };

  // The calling thread's counter: threads take slots in turn.
  static int ThreadSlot() {
    static std::atomic<uint32_t> next{0};
    thread_local const int slot =
        static_cast<int>(next.fetch_add(1, std::memory_order_relaxed) % kSlots);
    return slot;
  }

  std::atomic<uint32_t> phase_{0};
  mutable std::array<std::array<Counter, kSlots>, 2> counters_{};
};

}  // namespace wuliang::ps::details
