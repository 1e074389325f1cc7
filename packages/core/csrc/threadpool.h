// A persistent pool of worker threads. Kernels split their work with parallel_for; the
// calling thread takes part, so a pool of N threads has N-1 workers.
//
// Several threads may compute at once (two graphs from two Python threads, the lazy API
// beside a graph): their jobs take turns on the pool, one job at a time, each job over all
// of the pool's threads. A job started from inside a task runs inline in that thread.
// Workers spin briefly after a job, then sleep on a condition variable. The caller never
// waits for a worker that has not joined the job yet: work is handed out dynamically from a
// shared counter, so a worker that is not scheduled (a core taken by another process) only
// means the others take its share.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace recurra {

class ThreadPool {
 public:
  // Starts n_threads - 1 workers. When the system refuses a thread, the pool keeps the
  // threads that did start (size() says how many) and start_error() says why.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  const std::string& start_error() const { return start_error_; }

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
  void stop_workers();

  int n_threads_;
  std::string start_error_;
  std::vector<std::thread> workers_;
  std::mutex job_mu_;  // held by the thread whose job runs: jobs take turns
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t, int)>* job_ = nullptr;  // null between jobs
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> active_{0};  // workers inside the current job (changed under mu_)
  std::exception_ptr error_;
};

// Holds the process-wide pool for as long as it lives: a graph computes with one pool from
// start to end. set_num_threads waits until no lease is held, so the pool (and BLAS's
// threads) never change under a running computation. Re-entrant within a thread.
class PoolLease {
 public:
  PoolLease();
  ~PoolLease();
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;
  ThreadPool& pool() const { return *pool_; }

 private:
  std::shared_ptr<ThreadPool> pool_;
};

// The process-wide pool (recurra.set_num_threads replaces it). Use it through a PoolLease
// when other threads may call set_num_threads.
ThreadPool& pool();
// Returns a warning ("" when all threads started).
std::string set_num_threads(int n);
int get_num_threads();
int default_num_threads();

}  // namespace recurra
