"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA): the layout of a
sharded model, its two parallel layers, and the worker processes beside the engine."""
