#include "threadpool.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <system_error>

#include "common.h"
#include "idle_work.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RC_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RC_CPU_RELAX() asm volatile("yield")
#else
#define RC_CPU_RELAX() ((void)0)
#endif

namespace recurra {

namespace {
// A worker spins this long for the next job before it sleeps: long enough to bridge the
// gap between two kernels of one graph, short enough not to take a core from another
// process on a shared machine.
constexpr auto kSpin = std::chrono::microseconds(30);
// True in a thread that is running a job's task (a worker, or a caller inside run()).
thread_local bool t_in_job = false;

struct InJob {
  bool before = t_in_job;
  InJob() { t_in_job = true; }
  ~InJob() { t_in_job = before; }
};
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  workers_.reserve(n_threads_ - 1);
  for (int i = 1; i < n_threads_; ++i) {
    try {
      workers_.emplace_back([this, i] { worker(i); });
    } catch (const std::system_error& e) {
      start_error_ = "could start only " + std::to_string(i) + " of " + std::to_string(n_threads_) +
                     " threads (" + e.what() + ")";
      n_threads_ = i;
      break;
    }
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::worker(int id) {
  InJob in_job;
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly: a graph's next kernel usually follows within microseconds. Meanwhile
    // take any idle work offered (idle_work.h), and spin on from its end.
    auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1; epoch_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed); ++i) {
      RC_CPU_RELAX();
      if ((i & 15) == 0 && gemv_idle_work(epoch_, seen)) until = std::chrono::steady_clock::now() + kSpin;
      if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) break;
    }
    const std::function<void(int64_t, int)>* job;
    int64_t n;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_.load() || epoch_.load() != seen; });
      if (stop_.load()) return;
      seen = epoch_.load();
      if (!job_) continue;  // that job ended before this worker came: nothing to do
      job = job_;
      n = n_tasks_;
      ++active_;
    }
    std::exception_ptr err;
    try {
      for (int64_t t; (t = next_.fetch_add(1)) < n;) (*job)(t, id);
    } catch (...) {
      err = std::current_exception();
      next_.store(n);
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (err && !error_) error_ = err;
    if (--active_ == 0) cv_done_.notify_one();
  }
}

void ThreadPool::run(int64_t n_tasks, const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  if (n_threads_ == 1 || n_tasks == 1 || t_in_job) {  // nested jobs run inline
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> turn(job_mu_);  // another thread's job finishes first
  InJob in_job;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    n_tasks_ = n_tasks;
    next_.store(0);
    error_ = nullptr;
    epoch_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  std::exception_ptr err;
  try {
    for (int64_t t; (t = next_.fetch_add(1)) < n_tasks;) fn(t, 0);
  } catch (...) {
    err = std::current_exception();
    next_.store(n_tasks);  // let the workers drain quickly
  }
  // Every task is taken: wait for the workers that joined, not for those still asleep
  // (they see job_ == nullptr when they wake and go back to sleep).
  std::unique_lock<std::mutex> lk(mu_);
  job_ = nullptr;
  if (active_.load() != 0) {  // they are finishing their last task: spin briefly, then sleep
    lk.unlock();
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1; active_.load(std::memory_order_acquire) != 0; ++i) {
      RC_CPU_RELAX();
      if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) break;
    }
    lk.lock();
    cv_done_.wait(lk, [&] { return active_.load() == 0; });
  }
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
  // Several chunks per thread, taken from a shared counter: a thread that runs late (its
  // core busy with another process) takes fewer.
  int64_t chunks = std::min<int64_t>(max_chunks, static_cast<int64_t>(n_threads_) * 8);
  if (chunks <= 1 || t_in_job) {
    fn(0, n, 0);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  chunks = (n + step - 1) / step;
  run(chunks, [&](int64_t c, int tid) {
    int64_t b = c * step, e = std::min(n, b + step);
    if (b < e) fn(b, e, tid);
  });
}

namespace {
std::mutex g_gate_mu;
std::condition_variable g_gate_cv;
int g_leases = 0;          // threads holding a PoolLease
bool g_resizing = false;   // set_num_threads is waiting or working
thread_local int t_lease_depth = 0;
std::shared_ptr<ThreadPool> g_pool;  // guarded by g_gate_mu

std::shared_ptr<ThreadPool> current_pool_locked() {
  if (!g_pool) g_pool = std::make_shared<ThreadPool>(default_num_threads());
  return g_pool;
}
}  // namespace

int default_num_threads() {
  // The CPUs this process may run on (taskset, cgroups' cpusets), as os.sched_getaffinity.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

PoolLease::PoolLease() {
  std::unique_lock<std::mutex> lk(g_gate_mu);
  if (t_lease_depth++ == 0) {
    g_gate_cv.wait(lk, [] { return !g_resizing; });
    ++g_leases;
  }
  pool_ = current_pool_locked();
}

PoolLease::~PoolLease() {
  std::lock_guard<std::mutex> lk(g_gate_mu);
  if (--t_lease_depth == 0 && --g_leases == 0) g_gate_cv.notify_all();
}

ThreadPool& pool() {
  std::lock_guard<std::mutex> lk(g_gate_mu);
  return *current_pool_locked();
}

std::string set_num_threads(int n) {
  if (n < 1) throw ValueError("set_num_threads: the thread count must be >= 1, got " + std::to_string(n));
  if (t_lease_depth > 0) throw StateError("set_num_threads: called from inside a computation");
  std::unique_lock<std::mutex> lk(g_gate_mu);
  // Wait for the computations that run now (and for another set_num_threads); new ones
  // wait for this one.
  g_gate_cv.wait(lk, [] { return !g_resizing; });
  g_resizing = true;
  g_gate_cv.wait(lk, [] { return g_leases == 0; });
  std::string warning;
  try {
    if (!g_pool || g_pool->size() != n) {
      g_pool.reset();  // joins the old workers first: they do not add to the new count
      g_pool = std::make_shared<ThreadPool>(n);
      warning = g_pool->start_error();
    }
  } catch (...) {
    g_resizing = false;
    g_gate_cv.notify_all();
    throw;
  }
  g_resizing = false;
  g_gate_cv.notify_all();
  return warning.empty() ? warning : "set_num_threads(" + std::to_string(n) + "): " + warning;
}

int get_num_threads() {
  std::lock_guard<std::mutex> lk(g_gate_mu);
  return current_pool_locked()->size();
}

}  // namespace recurra
