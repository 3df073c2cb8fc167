// A no-op CUDA device guard for a CPU-only PyTorch build, for the stand-in CUDA device of
// tests/helpers/standin_cuda.py: without one, torch refuses to slice or copy any tensor that
// says it is on `cuda` ("PyTorch is not linked with support for cuda devices"). Loading the
// library registers it; nothing else in torch changes (no allocator, no kernels).
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
const c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> standin_cuda_guard;
const c10::impl::DeviceGuardImplRegistrar standin_cuda_registrar(c10::DeviceType::CUDA,
                                                                 &standin_cuda_guard);
}  // namespace
