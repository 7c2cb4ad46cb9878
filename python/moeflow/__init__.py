"""moeflow — Python binding of the moeflow expert-parallel MoE library (include/moeflow.h).

    moeflow          Group, Comm, Layer over the C API (ctypes; moeflow.core)
    moeflow.torch    the layer, dispatch and combine on torch tensors, as torch.library custom ops
    moeflow.reference  the torch fp64 reference of the layer's numerics

Importing moeflow loads libmoeflow.so and checks its struct sizes (moeflow._lib).
"""
from ._lib import MoeflowError, check
from .core import Comm, Group, Layer, LayerInfo, backend_available, run_ranks, version

__all__ = ["Comm", "Group", "Layer", "LayerInfo", "MoeflowError", "backend_available", "check",
           "run_ranks", "version"]
