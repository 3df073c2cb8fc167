"""The /proc/cpuinfo flags of each machine type this project has landed on, for tests that
stub the CPU (tests/kernels/test_isa.py: the native level each gets; tests/kernels/
test_cpu_dtype.py: what `--dtype auto` means there)."""

_ZEN3 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx "
         "fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm rep_good nopl cpuid "
         "extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic "
         "movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm "
         "sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single ssbd ibrs ibpb stibp "
         "vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb "
         "sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru wbnoinvd arat npt "
         "nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm")
_ICELAKE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush "
            "mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl "
            "xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid "
            "sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand "
            "hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp "
            "ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f "
            "avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw "
            "avx512vl xsaveopt xsavec xgetbv1 xsaves wbnoinvd arat avx512vbmi umip pku ospke "
            "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid "
            "md_clear arch_capabilities")
_COOPERLAKE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 "
               "clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc "
               "rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 "
               "fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave "
               "avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs "
               "ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid "
               "avx512f avx512dq rdseed adx smap clflushopt clwb avx512cd avx512bw avx512vl "
               "xsaveopt xsavec xgetbv1 xsaves avx512_bf16 arat pku ospke avx512_vnni md_clear "
               "arch_capabilities")
_SAPPHIRE_RAPIDS = _ICELAKE + (" avx_vnni avx512_bf16 cldemote movdiri movdir64b serialize "
                               "tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8")
MACHINES = {  # machine types this project has landed on -> the level each must get
    "AMD EPYC Zen 3": (_ZEN3, "avx2"),
    "Intel Xeon Ice Lake": (_ICELAKE, "avx512"),
    "Intel Xeon with AVX512-BF16, no AMX": (_COOPERLAKE, "avx512_bf16"),
    "Intel Xeon Sapphire Rapids (AMX)": (_SAPPHIRE_RAPIDS, "amx"),
}
