// Stand-in for <torch/library.h> in the AMX emulation build (tests/amx_emulation): the kernel's operator
// registration compiles into an unused function, so the build needs no PyTorch headers and registers nothing.
#pragma once

namespace tallyserve_amx_emulation {
struct NoLibrary {
  template <typename... Args>
  void def(Args&&...) {}
};
}  // namespace tallyserve_amx_emulation

#define TORCH_LIBRARY_FRAGMENT(ns, m) \
  [[maybe_unused]] static void tallyserve_unused_fragment_##ns(::tallyserve_amx_emulation::NoLibrary& m)
