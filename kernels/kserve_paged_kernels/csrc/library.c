/* Library-wide entry points of the native CPU kernels (kp_native.h). */
#include "kp_native.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Read from the file by cpu_native.loader.built_level (ISA_TAG there). */
__attribute__((used)) static const char kp_isa_tag[] = "kp-native-isa=" KP_ISA ";";

int kp_abi_version(void) { return KP_ABI_VERSION; }

#ifdef _OPENMP
void kp_set_threads(int n) { if (n > 0) omp_set_num_threads(n); }
#else
void kp_set_threads(int n) { (void)n; }
#endif
