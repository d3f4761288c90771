/* Prepared kernel calls run in a row (pagellm.native.CallChain): one ctypes call for a
   step's kernels instead of one per kernel. Each kernel takes a pointer to its argument
   structure, read when it runs, so fields set between runs hold. */
#include <stdint.h>

typedef void (*kernel_fn)(void*);

void run_calls(int64_t n, const kernel_fn* functions, void* const* args) {
  for (int64_t i = 0; i < n; i++) functions[i](args[i]);
}
