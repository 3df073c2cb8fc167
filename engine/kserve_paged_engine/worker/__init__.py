"""Running a step: the model runner, and the executors that own it (this process, or
tensor-parallel worker processes); the KV cache's memory on CPU. Nothing here is imported by
this package itself: `kserve_paged_engine.worker.cpu_memory` must load without torch."""
