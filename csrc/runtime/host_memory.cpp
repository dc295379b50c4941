// Keeping freed host memory in the process; see host_memory.h.
#include "runtime/host_memory.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace zbpipe::runtime {

namespace {

bool apply() {
#if defined(__GLIBC__)
  const char* env = std::getenv("ZBPIPE_KEEP_HOST_MEMORY");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  constexpr int kLimit = 1 << 30;  // 1 GiB
  // A fixed threshold also stops glibc's own adjustment (which never goes above 32 MiB).
  const bool heap = mallopt(M_MMAP_THRESHOLD, kLimit) == 1 || mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool kept = mallopt(M_TRIM_THRESHOLD, kLimit) == 1;
  return heap && kept;
#else
  return false;
#endif
}

}  // namespace

bool keep_freed_host_memory() {
  static const bool in_force = apply();  // thread-safe, once per process
  return in_force;
}

}  // namespace zbpipe::runtime
