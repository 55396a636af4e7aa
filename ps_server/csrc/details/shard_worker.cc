#include "details/shard_worker.h"

#include <immintrin.h>
#include <pthread.h>

#include <utility>

namespace wuliang::ps::details {

void MpscQueue::Push(Task* task) {
  task->next.store(nullptr, std::memory_order_relaxed);
  Task* prev = head_.exchange(task, std::memory_order_acq_rel);
  prev->next.store(task, std::memory_order_release);
}

Task* MpscQueue::Pop() {
  Task* tail = tail_;
  Task* next = tail->next.load(std::memory_order_acquire);
  if (tail == &stub_) {
    if (next == nullptr) return nullptr;
    tail_ = next;
    tail = next;
    next = next->next.load(std::memory_order_acquire);
  }
  if (next != nullptr) {
    tail_ = next;
    return tail;
  }
  if (tail != head_.load(std::memory_order_acquire)) return nullptr;  // mid-push
  Push(&stub_);
  next = tail->next.load(std::memory_order_acquire);
  if (next != nullptr) {
    tail_ = next;
    return tail;
  }
  return nullptr;
}

ShardWorker::ShardWorker(std::function<bool()> idle)
    : idle_(std::move(idle)), thread_([this] { Loop(); }) {
  pthread_setname_np(thread_.native_handle(), "wuliang-shard");  // for top, perf
}

ShardWorker::~ShardWorker() {
  stop_.store(true, std::memory_order_release);
  tickets_.fetch_add(1, std::memory_order_release);
  tickets_.notify_one();
  thread_.join();
}

void ShardWorker::Enqueue(Task* task) {
  queue_.Push(task);
  tickets_.fetch_add(1, std::memory_order_release);
  tickets_.notify_one();
}

void ShardWorker::EnqueueUrgent(Task* task) {
  urgent_.Push(task);
  tickets_.fetch_add(1, std::memory_order_release);
  tickets_.notify_one();
}

Task* ShardWorker::Next() {
  if (Task* task = urgent_.Pop()) return task;
  return queue_.Pop();
}

void ShardWorker::Loop() {
  constexpr int kSpins = 64;
  for (;;) {
    const uint32_t seen = tickets_.load(std::memory_order_acquire);
    while (Task* task = Next()) task->run(task);
    if (stop_.load(std::memory_order_acquire)) {
      while (Task* task = Next()) task->run(task);
      return;
    }
    if (idle_ && idle_()) continue;  // more to do: the queue first, then the next piece
    bool woke = false;
    for (int i = 0; i < kSpins && !woke; ++i) {
      _mm_pause();
      woke = tickets_.load(std::memory_order_acquire) != seen;
    }
    if (!woke) tickets_.wait(seen, std::memory_order_acquire);
  }
}

}  // namespace wuliang::ps::details
