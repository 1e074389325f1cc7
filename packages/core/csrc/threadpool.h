// A persistent pool of worker threads. Kernels split their work with parallel_for; the
// calling thread takes part, so a pool of N threads has N-1 workers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace recurra {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(task, thread_id) for task in [0, n_tasks). Tasks are handed out dynamically;
  // thread_id is in [0, size()) and is stable within one task, so a kernel can keep
  // per-thread partial sums indexed by it. Exceptions thrown by fn are rethrown here.
  void run(int64_t n_tasks, const std::function<void(int64_t task, int thread_id)>& fn);

  // Splits [0, n) into contiguous ranges of at least `grain` items, one or more per thread,
  // and runs fn(begin, end, thread_id) on each.
  void parallel_for(int64_t n, int64_t grain,
                    const std::function<void(int64_t begin, int64_t end, int thread_id)>& fn);

 private:
  void worker(int id);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int)>* job_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int pending_ = 0;
  uint64_t epoch_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The process-wide pool (recurra.set_num_threads replaces it).
ThreadPool& pool();
void set_num_threads(int n);
int get_num_threads();

}  // namespace recurra
