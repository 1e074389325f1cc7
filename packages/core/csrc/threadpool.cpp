#include "threadpool.h"

#include <algorithm>
#include <memory>

#include "blas.h"
#include "common.h"

namespace recurra {

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker(int id) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int)>* job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || epoch_ != seen; });
      if (stop_) return;
      seen = epoch_;
      job = job_;
    }
    std::exception_ptr err;
    try {
      for (int64_t t; (t = next_.fetch_add(1)) < n_tasks_;) (*job)(t, id);
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (err && !error_) error_ = err;
    if (--pending_ == 0) cv_done_.notify_one();
  }
}

void ThreadPool::run(int64_t n_tasks, const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  if (n_threads_ == 1 || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    n_tasks_ = n_tasks;
    next_.store(0);
    pending_ = n_threads_ - 1;
    error_ = nullptr;
    ++epoch_;
  }
  cv_start_.notify_all();
  std::exception_ptr err;
  try {
    for (int64_t t; (t = next_.fetch_add(1)) < n_tasks;) fn(t, 0);
  } catch (...) {
    err = std::current_exception();
    next_.store(n_tasks);  // let the workers drain quickly
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_done_.wait(lk, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (!err) err = error_;
  error_ = nullptr;
  lk.unlock();
  if (err) std::rethrow_exception(err);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  int64_t max_chunks = (n + grain - 1) / grain;
  int64_t chunks = std::min<int64_t>(max_chunks, static_cast<int64_t>(n_threads_) * 4);
  if (chunks <= 1) {
    fn(0, n, 0);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  run(chunks, [&](int64_t c, int tid) {
    int64_t b = c * step, e = std::min(n, b + step);
    if (b < e) fn(b, e, tid);
  });
}

namespace {
std::unique_ptr<ThreadPool>& pool_slot() {
  static std::unique_ptr<ThreadPool> p;
  return p;
}
int default_threads() {
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}
}  // namespace

ThreadPool& pool() {
  auto& p = pool_slot();
  if (!p) p = std::make_unique<ThreadPool>(default_threads());
  return *p;
}

void set_num_threads(int n) {
  if (n < 1) throw ValueError("set_num_threads: the thread count must be >= 1, got " + std::to_string(n));
  auto& p = pool_slot();
  if (p && p->size() == n) return;
  p.reset();
  p = std::make_unique<ThreadPool>(n);
  blas_set_num_threads(n);
}

int get_num_threads() { return pool().size(); }

}  // namespace recurra
