// tallyserve CPU task pool (task_pool_cpu.h): worker threads that take a call's tasks from a shared counter; the
// call returns when its tasks are done, whichever threads did them.
//
// One word holds the call's generation (high 32 bits) and its next task (low 32): a thread claims a task by a
// compare-and-swap that also checks the generation, so a worker that wakes after its call ended (the OS had
// descheduled it) claims nothing and goes back to sleep, and never touches the next call's state. The caller
// runs tasks too and then waits for the ones in flight on other threads, yielding its core to them.

#include "task_pool_cpu.h"

#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TALLYSERVE_PAUSE() _mm_pause()
#else
#define TALLYSERVE_PAUSE() std::this_thread::yield()
#endif

namespace {

constexpr int64_t kMaxThreads = 256;
constexpr int kWorkerSpins = 256;   // a worker polls this many times for the next call before it sleeps
constexpr int kCallerSpins = 1024;  // the caller polls the tasks in flight this many times, then yields its core

thread_local bool t_in_task = false;

class TaskPool {
 public:
  ~TaskPool() {
    if (getpid() == pid_) stop_workers();
  }

  int64_t threads() const { return threads_.load(std::memory_order_relaxed); }

  void resize(int64_t n) {
    std::lock_guard<std::mutex> calls(call_mu_);  // no call in flight meanwhile
    if (getpid() != pid_) {  // a forked child: the parent's workers do not exist here
      workers_.release();
      workers_.reset(new std::vector<std::thread>());
      pid_ = getpid();
    }
    const int64_t want = n > 1 ? n : 0;
    if (want == threads_.load()) return;
    stop_workers();
    threads_.store(want);
    for (int64_t i = 1; i < want; ++i) workers_->emplace_back([this] { worker(); });
  }

  // false: not run here (the pool is off, busy with another thread's call, or this is a task's nested call)
  bool run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (t_in_task || threads() <= 1) return false;
    std::unique_lock<std::mutex> calls(call_mu_, std::try_to_lock);
    if (!calls.owns_lock() || threads() <= 1 || getpid() != pid_) return false;
    TORCH_CHECK(n < (int64_t{1} << 31), "run_tasks: too many tasks");
    fn_ = &fn;
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = gen_.load(std::memory_order_relaxed) + 1;
      claim_.store(gen << 32, std::memory_order_release);
      gen_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    work(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < kCallerSpins)
        TALLYSERVE_PAUSE();
      else
        std::this_thread::yield();
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void work(uint64_t gen) {
    t_in_task = true;
    for (;;) {
      uint64_t s = claim_.load(std::memory_order_acquire);
      do {
        if ((s >> 32) != gen || static_cast<int64_t>(s & 0xffffffffu) >= n_.load(std::memory_order_relaxed)) {
          t_in_task = false;
          return;
        }
      } while (!claim_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      try {
        (*fn_)(static_cast<int64_t>(s & 0xffffffffu));
      } catch (...) {
        std::lock_guard<std::mutex> lk(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void worker() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      for (int i = 0; i < kWorkerSpins && g == seen; ++i) {
        TALLYSERVE_PAUSE();
        g = gen_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || gen_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
        g = gen_.load(std::memory_order_acquire);
      }
      seen = g;
      work(g);
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : *workers_) t.join();
    workers_->clear();
    stop_ = false;
    threads_.store(0);
  }

  std::mutex call_mu_;  // one call at a time
  std::mutex mu_;       // with cv_: workers sleep between calls
  std::condition_variable cv_;
  bool stop_ = false;
  std::unique_ptr<std::vector<std::thread>> workers_{new std::vector<std::thread>()};
  pid_t pid_ = getpid();
  std::atomic<int64_t> threads_{0};
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> claim_{0};  // generation << 32 | next task
  std::atomic<int64_t> n_{0};
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::mutex error_mu_;
  std::exception_ptr error_;
};

TaskPool& pool() {
  static TaskPool* p = new TaskPool();  // never destroyed: workers must not be joined during static destruction
  return *p;
}

void set_task_pool_threads(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= kMaxThreads, "set_task_pool_threads: 0 (off) to ", kMaxThreads, " threads, got ", n);
  pool().resize(n);
}

int64_t get_task_pool_threads() { return pool().threads(); }

// The load-time probe's error (cpu_kernels.py runs it once per build, in a subprocess): where 0, thrown on the
// calling thread; where 1, in a task of tallyserve's parallel_for (on the pool while it is on, else on ATen's
// threads) and rethrown to the caller. The probe passes when Python catches both as RuntimeError; on a host where
// an exception from the extension does not reach Python (issue 36: a segmentation fault instead), the kernels
// stay off. Any other `where` returns x. It takes a tensor and is registered for the CPU dispatch key like every
// kernel: on the GPU host of issue 37 an error from an operator registered without a dispatch key (int in, int
// out) reached Python while one from the CPU-key paged_attention ended the process.
at::Tensor probe_error(const at::Tensor& x, int64_t where) {
  const char* what = "tallyserve_cpu::probe_error: the error the load-time probe expects";
  TORCH_CHECK(where != 0, what);
  if (where == 1) {
    tallyserve_cpu_ops::parallel_for(0, 64, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) TORCH_CHECK(i != 37, what, " (from a task)");
    });
  }
  return x;
}

}  // namespace

namespace tallyserve_cpu_ops {

int64_t task_pool_threads() { return pool().threads(); }

void run_tasks(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1) {
    fn(0);
    return;
  }
  if (pool().run(n, fn)) return;
  const int64_t lanes = std::min<int64_t>(n, std::max<int64_t>(1, at::get_num_threads()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, lanes, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(t);
  });
}

}  // namespace tallyserve_cpu_ops

TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("set_task_pool_threads(int n) -> ()", &set_task_pool_threads);
  m.def("task_pool_threads() -> int", &get_task_pool_threads);
  m.def("task_pool_max_threads() -> int", [] { return kMaxThreads; });
  m.def("probe_error(Tensor x, int where) -> Tensor");
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) { m.impl("probe_error", &probe_error); }
