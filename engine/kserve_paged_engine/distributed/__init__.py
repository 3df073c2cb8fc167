"""Communication between tensor-parallel ranks on torch.distributed (gloo on CPU, NCCL on
CUDA): joining the group and the collectives a sharded layer calls. The sharded layers are
in engine/kserve_paged_engine/model_executor/, the worker processes in engine/kserve_paged_engine/worker/."""
