"""Backends: how a process group moves tensors (gloo for CPU tensors, NCCL for CUDA ones)."""
