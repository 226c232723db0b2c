// tallyserve CPU: how the compiled kernels spread their work over threads (task_pool_cpu.cpp).
//
// Normally on ATen's OpenMP threads. While the thread governor shares the cores with other processes
// (runner/cpu_threads.py), on tallyserve's task pool instead: more threads than cores, each call's work cut into
// tasks taken from a shared counter, and the call returns as soon as every task is done. An OpenMP region ends
// only when every one of its threads has come through it, so with a busy neighbour each region waited for the
// thread the OS had descheduled (a scheduler slice, milliseconds) even when the others had done all the work;
// a decode step runs hundreds of regions.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace tallyserve_cpu_ops {

// Threads that the pool runs on (the caller included), 0 while it is off.
int64_t task_pool_threads();

// Runs fn(t) for every t in [0, n), each task taken once from a shared counter by whichever thread is free: on the
// pool while it is on, else on ATen's threads. Returns when every task is done; rethrows a task's exception. A call
// from inside a task, or from a second thread while the pool is busy, runs on ATen's threads (inline when those
// are one).
void run_tasks(int64_t n, const std::function<void(int64_t)>& fn);

// Threads run_tasks spreads over: the pool's while it is on, else ATen's.
inline int64_t task_threads() {
  const int64_t pool = task_pool_threads();
  return pool > 1 ? pool : std::max<int64_t>(1, at::get_num_threads());
}

// at::parallel_for's contract (f(begin, end) over pieces of at least grain elements) on the pool while it is on
// (about four pieces per thread), else at::parallel_for itself.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t pool = task_pool_threads();
  if (pool <= 1) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(4 * pool, n / std::max<int64_t>(grain, 1)));
  if (pieces == 1) {
    f(begin, end);
    return;
  }
  const int64_t step = (n + pieces - 1) / pieces;
  run_tasks((n + step - 1) / step, [&](int64_t t) { f(begin + t * step, std::min(end, begin + (t + 1) * step)); });
}

}  // namespace tallyserve_cpu_ops
