// Runs the parallel loops of TVM-compiled CPU kernels on torch's intra-op threads.
//
// A kernel library exported by TVM calls its parallel loops through the function pointer
// `__TVMBackendParallelLaunch`, which TVM's loader points at TVM's own thread pool. Two pools
// (TVM's and torch's OpenMP team) then share the cores, and each one's idle workers spin while
// the other works. tvm_deform points that variable at `tvm_deform_parallel_launch` instead, so
// every task of a kernel runs through `at::parallel_for`: `torch.set_num_threads` governs it, a
// call from inside a torch parallel region runs inline, and no second pool exists.
//
// Built with -fopenmp (ATen's header-only `parallel_for` is serial without it) and linked
// against the OpenMP runtime torch itself loaded, so that there is one OpenMP runtime.

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

extern "C" {

// The two types of tvm/runtime/c_backend_api.h, declared here so that no TVM header is needed.
typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

// TVMBackendParallelLaunch's contract: run `flambda(task_id, env, cdata)` for every task id in
// [0, num_task) (num_task 0: as many tasks as there are threads) and return 0, or -1 when a
// task failed. The kernels split their loop by `env->num_task`, so any task count is correct;
// one task per thread keeps the chunks large. No kernel of ours uses TVM's barrier
// (`sync_handle` stays null): the loader refuses a library that would.
int tvm_deform_parallel_launch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  const int64_t tasks = num_task > 0 ? num_task : at::get_num_threads();
  TVMParallelGroupEnv env{nullptr, static_cast<int32_t>(tasks)};
  std::atomic<int> failed{0};
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      if (flambda(static_cast<int>(task), &env, cdata) != 0) failed.store(1);
    }
  });
  return failed.load() ? -1 : 0;
}

// How many tasks a launch with num_task 0 gets: for tests and `tvm-deform info`.
int tvm_deform_launcher_threads() { return at::get_num_threads(); }

}  // extern "C"
