#include "workers.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

namespace ferry::sim::planning {

std::size_t workers_for(std::int32_t jobs) {
  if (jobs > 0) return static_cast<std::size_t>(jobs);
  return std::max<std::size_t>(1, std::thread::hardware_concurrency());
}

void for_each_parallel(std::size_t n, std::size_t workers,
                       const std::function<void(std::size_t)>& task) {
  std::vector<std::exception_ptr> errors(n);
  std::atomic<std::size_t> next{0};
  const auto work = [&] {
    for (std::size_t i = next++; i < n; i = next++) {
      try {
        task(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  const std::size_t threads = std::min(workers, n);
  if (threads <= 1) {
    work();
  } else {
    std::vector<std::jthread> others;
    others.reserve(threads - 1);
    for (std::size_t t = 1; t < threads; ++t) others.emplace_back(work);
    work();
  }  // the jthreads join here
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace ferry::sim::planning
