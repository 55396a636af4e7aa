// One worker thread per shard, fed by a lock-free multi-producer queue.
//
// Producers (any thread) Enqueue tasks; the worker runs them in FIFO order.
// The queue is Vyukov's intrusive MPSC list; an atomic "ticket" counter with
// C++20 atomic wait/notify puts an idle worker to sleep without a mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

namespace wuliang::ps::details {

struct Task {
  std::atomic<Task*> next{nullptr};
  void (*run)(Task* self) = nullptr;  // must not throw
};

class MpscQueue {
 public:
  MpscQueue() : head_(&stub_), tail_(&stub_) {}
  void Push(Task* task);  // any thread
  Task* Pop();            // consumer only; nullptr when empty (or mid-push)

 private:
  std::atomic<Task*> head_;  // most recently pushed
  Task* tail_;               // next to pop
  Task stub_;
};

class ShardWorker {
 public:
  // idle (optional): work of the worker's own, run on it between tasks
  // when its queue is empty, a bounded piece at a time; returns whether
  // more remains (then the queue is looked at and idle called again).
  explicit ShardWorker(std::function<bool()> idle = {});
  ~ShardWorker();  // runs the tasks already queued, then joins
  ShardWorker(const ShardWorker&) = delete;
  ShardWorker& operator=(const ShardWorker&) = delete;

  void Enqueue(Task* task);
  // Runs before the tasks queued by Enqueue that have not started (still in
  // order among urgent ones): for work that no queued task needs to come
  // first (a prefetch's installs, whose result is the same either way).
  void EnqueueUrgent(Task* task);

 private:
  void Loop();
  Task* Next();  // an urgent task first

  std::function<bool()> idle_;
  MpscQueue queue_;
  MpscQueue urgent_;
  std::atomic<uint32_t> tickets_{0};  // bumped after every push
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace wuliang::ps::details
