"""moeflow._lib — the ctypes mirror of include/moeflow.h.

Loads libmoeflow.so, declares every MF_API function and public struct, and checks at import that
each struct has the size the library reports (mf_get_struct_size), so that a header change the
binding missed fails here, not as memory corruption later. Every failed mf_result_t becomes a
MoeflowError through check(). ctypes drops the GIL around each foreign call, so R virtual ranks
can be driven from R Python threads.

Where the library comes from, first hit wins:
  1. $MOEFLOW_LIB (a path to libmoeflow.so),
  2. libmoeflow.so next to this file (what `pip install ./python` puts there),
  3. <checkout>/build/libmoeflow.so (this file read from a checkout after `make`).
"""
import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_double, c_float, c_int32,
                    c_int64, c_size_t, c_uint8, c_uint16, c_uint32, c_void_p)
from pathlib import Path

# ---- constants of include/moeflow.h --------------------------------------------------------------
API_VERSION = 2
MAX_DIMS = 4
MAX_RANKS = 64
MAX_TOPK = 32
ADDRESS_BYTES = 128
GROUP_CONFIG_MAGIC = 0x6D666772
COMM_CONFIG_MAGIC = 0x6D66636D
MOE_CONFIG_MAGIC = 0x6D666D65
QUANT_BLOCK = 128  # FP8 block edge (1x128 activations, 128x128 weights)

BACKEND = {"cpu": 0, "cuda": 1, "auto": 2}
TRANSPORT = {"local": 0, "ipc": 1, "nccl": 2, "auto": 3}
DTYPE = {"bf16": 0, "fp8": 1, "fp32": 2, "int32": 3}
LAYOUT = {"expert_major": 0, "masked": 1}
DATAFLOW = {"auto": 0, "direct": 1, "pull": 2, "unfused": 3}
PLACEMENT = {"linear": 0, "round_robin": 1}
PHASES = ("prepare", "dispatch", "w13", "w2", "combine")
RESULT_NAMES = ("MF_SUCCESS", "MF_ERR_INVALID_ARGUMENT", "MF_ERR_INVALID_USAGE",
                "MF_ERR_OUT_OF_MEMORY", "MF_ERR_CAPACITY", "MF_ERR_TIMEOUT", "MF_ERR_CUDA",
                "MF_ERR_NCCL", "MF_ERR_SYSTEM", "MF_ERR_NOT_SUPPORTED", "MF_ERR_INTERNAL",
                "MF_ERR_ABORTED")


# ---- structs --------------------------------------------------------------------------------------
Dims = c_int64 * MAX_DIMS


class Tensor(Structure):
    """mf_tensor_t: a non-owning descriptor of contiguous row-major memory."""
    _fields_ = [("data", c_void_p), ("dtype", c_int32), ("ndim", c_int32), ("dims", Dims)]


class GroupConfig(Structure):
    _fields_ = [("size", c_uint32), ("magic", c_uint32), ("version", c_uint32),
                ("backend", c_int32), ("transport", c_int32), ("num_ranks", c_int32),
                ("device", c_int32), ("num_sms", c_int32), ("timeout_ms", c_int64),
                ("heap_bytes", c_int64)]


class CommConfig(Structure):
    _fields_ = [("size", c_uint32), ("magic", c_uint32), ("version", c_uint32),
                ("backend", c_int32), ("transport", c_int32), ("device", c_int32),
                ("num_sms", c_int32), ("timeout_ms", c_int64), ("heap_bytes", c_int64),
                ("nccl_comm", c_void_p)]


ALLGATHER_FN = CFUNCTYPE(c_int32, c_void_p, c_void_p, c_void_p, c_size_t)
DESTROY_FN = CFUNCTYPE(None, c_void_p)


class Bootstrap(Structure):
    _fields_ = [("allgather", ALLGATHER_FN), ("ctx", c_void_p), ("destroy", DESTROY_FN)]


class MoeConfig(Structure):
    _fields_ = [("size", c_uint32), ("magic", c_uint32), ("version", c_uint32),
                ("num_experts", c_int32), ("num_topk", c_int32), ("hidden", c_int32),
                ("intermediate", c_int32), ("max_tokens_per_rank", c_int32), ("dtype", c_int32),
                ("layout", c_int32), ("block_m", c_int32), ("expert_capacity", c_int32),
                ("max_recv_rows", c_int32), ("ue8m0_scales", c_int32), ("profile", c_int32),
                ("dataflow", c_int32), ("num_physical_experts", c_int32),
                ("spare_slots", c_int32), ("placement", c_int32), ("max_in_flight", c_int32)]


class MoeInfo(Structure):
    _fields_ = [("num_ranks", c_int32), ("rank", c_int32), ("num_local_experts", c_int32),
                ("first_expert", c_int32), ("block_m", c_int32), ("expert_capacity", c_int32),
                ("max_recv_rows", c_int32), ("heap_bytes", c_int64), ("placement", c_int32),
                ("num_local_slots", c_int32)]


class MoeWeights(Structure):
    _fields_ = [("w13", Tensor), ("w13_scales", Tensor), ("w2", Tensor), ("w2_scales", Tensor)]


class ForwardIn(Structure):
    _fields_ = [("x", Tensor), ("topk_ids", Tensor), ("topk_weights", Tensor)]


class ForwardOut(Structure):
    _fields_ = [("y", Tensor)]


class DispatchIn(Structure):
    _fields_ = [("x", Tensor), ("topk_ids", Tensor)]


class DispatchOut(Structure):
    _fields_ = [("recv_x", Tensor), ("recv_scales", Tensor), ("recv_src", Tensor),
                ("expert_counts", Tensor), ("expert_offsets", Tensor)]


class CombineIn(Structure):
    _fields_ = [("expert_out", Tensor), ("topk_weights", Tensor)]


class CombineOut(Structure):
    _fields_ = [("y", Tensor)]


class ExpertsIn(Structure):
    _fields_ = [("recv_x", Tensor), ("recv_scales", Tensor), ("expert_counts", Tensor)]


class ExpertsOut(Structure):
    _fields_ = [("expert_out", Tensor)]


class ExchangeEvents(Structure):
    """mf_exchange_events_t: cudaEvent_t handles around one half (previous, finished), or NULL."""
    _fields_ = [("previous", c_void_p), ("finished", c_void_p)]


MAX_IN_FLIGHT = 4  # MF_MAX_IN_FLIGHT


class PhaseTimes(Structure):
    _fields_ = [("us", c_double * len(PHASES)), ("total_us", c_double)]


MAX_RANKS = 64  # MF_MAX_RANKS


class BalanceStats(Structure):
    _fields_ = [("size", c_uint32), ("num_physical_experts", c_int32), ("slots_per_rank", c_int32),
                ("spare_slots", c_int32), ("recv_rows", c_int64 * MAX_RANKS),
                ("home_rows", c_int64 * MAX_RANKS), ("prefetch_bytes", c_int64),
                ("prefetch_bytes_all", c_int64), ("spare_resident", c_int32), ("pad", c_int32),
                ("stage_bytes", c_int64), ("stage_bytes_all", c_int64), ("stage_local_bytes", c_int64),
                ("stage_steps_left", c_int32), ("map_switches", c_int32)]


# mf_struct_t order: the index is the enum value.
STRUCTS = (Tensor, GroupConfig, CommConfig, Bootstrap, MoeConfig, MoeInfo, MoeWeights, ForwardIn,
           ForwardOut, DispatchIn, DispatchOut, CombineIn, CombineOut, PhaseTimes, BalanceStats,
           ExpertsIn, ExpertsOut, ExchangeEvents)


# ---- loading --------------------------------------------------------------------------------------
def _find_library():
    env = os.environ.get("MOEFLOW_LIB")
    if env:
        return env
    here = Path(__file__).resolve().parent
    for candidate in (here / "libmoeflow.so", here.parent.parent / "build" / "libmoeflow.so"):
        if candidate.is_file():
            return str(candidate)
    raise ImportError("moeflow: libmoeflow.so not found: set MOEFLOW_LIB, install the package "
                      "(pip install ./python) or run `make` in the checkout")


path = _find_library()
lib = ctypes.CDLL(path)

_handle = c_void_p
_P = POINTER
# name: (restype, argtypes); every MF_API function of the header.
_FUNCTIONS = {
    "mf_get_version": (c_int32, []),
    "mf_result_string": (c_char_p, [c_int32]),
    "mf_last_error": (c_char_p, []),
    "mf_backend_available": (c_int32, [c_int32]),
    "mf_group_create": (c_int32, [_P(GroupConfig), _P(_handle)]),
    "mf_group_get_comm": (c_int32, [_handle, c_int32, _P(_handle)]),
    "mf_group_get_backend": (c_int32, [_handle, _P(c_int32)]),
    "mf_group_destroy": (c_int32, [_handle]),
    "mf_comm_get_rank": (c_int32, [_handle, _P(c_int32)]),
    "mf_comm_get_size": (c_int32, [_handle, _P(c_int32)]),
    "mf_comm_get_async_error": (c_int32, [_handle]),
    "mf_rendezvous_address": (c_int32, [_P(c_char)]),
    "mf_rendezvous_bootstrap": (c_int32, [c_char_p, c_int32, c_int32, c_int64, _P(Bootstrap)]),
    "mf_comm_init": (c_int32, [_P(CommConfig), c_int32, c_int32, _P(Bootstrap), _P(_handle)]),
    "mf_comm_abort": (c_int32, [_handle]),
    "mf_comm_destroy": (c_int32, [_handle]),
    "mf_comm_get_transport": (c_int32, [_handle, _P(c_int32)]),
    "mf_moe_heap_bytes": (c_int32, [_P(MoeConfig), c_int32, _P(c_int64)]),
    "mf_moe_create": (c_int32, [_handle, _P(MoeConfig), _P(_handle)]),
    "mf_moe_get_info": (c_int32, [_handle, _P(MoeInfo)]),
    "mf_moe_destroy": (c_int32, [_handle]),
    "mf_moe_set_weights": (c_int32, [_handle, _P(MoeWeights)]),
    "mf_moe_forward": (c_int32, [_handle, _P(ForwardIn), _P(ForwardOut), c_void_p]),
    "mf_moe_get_phase_times": (c_int32, [_handle, _P(PhaseTimes)]),
    "mf_moe_set_expert_map": (c_int32, [_handle, _P(c_int32), c_int32]),
    "mf_moe_prefetch": (c_int32, [_handle, c_void_p]),
    "mf_moe_stage_expert_map": (c_int32, [_handle, _P(c_int32), c_int32, _P(MoeWeights), c_int32]),
    "mf_moe_get_balance_stats": (c_int32, [_handle, _P(BalanceStats)]),
    "mf_dispatch": (c_int32, [_handle, _P(DispatchIn), _P(DispatchOut), c_void_p]),
    "mf_combine": (c_int32, [_handle, _P(CombineIn), _P(CombineOut), c_void_p]),
    "mf_exchange_create": (c_int32, [_handle, _P(_handle)]),
    "mf_exchange_destroy": (c_int32, [_handle]),
    "mf_dispatch_send": (c_int32, [_handle, _P(DispatchIn), _P(DispatchOut), _P(ExchangeEvents), c_void_p]),
    "mf_dispatch_recv": (c_int32, [_handle, _P(ExchangeEvents), c_void_p]),
    "mf_combine_send": (c_int32, [_handle, _P(CombineIn), _P(CombineOut), _P(ExchangeEvents), c_void_p]),
    "mf_combine_recv": (c_int32, [_handle, _P(ExchangeEvents), c_void_p]),
    "mf_comm_set_num_sms": (c_int32, [_handle, c_int32]),
    "mf_comm_get_num_sms": (c_int32, [_handle, _P(c_int32)]),
    "mf_moe_experts": (c_int32, [_handle, _P(ExpertsIn), _P(ExpertsOut), c_void_p]),
    "mf_fp8_e4m3_from_float": (c_uint8, [c_float]),
    "mf_fp8_e4m3_to_float": (c_float, [c_uint8]),
    "mf_bf16_from_float": (c_uint16, [c_float]),
    "mf_bf16_to_float": (c_float, [c_uint16]),
    "mf_quantize_fp8": (c_int32, [_P(Tensor), _P(Tensor), _P(Tensor), c_int32, c_int32]),
    "mf_get_struct_size": (c_int64, [c_int32]),
}
for _name, (_restype, _argtypes) in _FUNCTIONS.items():
    _fn = getattr(lib, _name)
    _fn.restype, _fn.argtypes = _restype, _argtypes
    globals()[_name] = _fn


def _check_struct_sizes():
    for which, struct in enumerate(STRUCTS):
        size = mf_get_struct_size(which)
        if size != ctypes.sizeof(struct):
            raise ImportError(f"moeflow: {path} has sizeof({struct.__name__}) = {size}, this "
                              f"binding {ctypes.sizeof(struct)}: the binding and the library "
                              f"are of different versions")


_check_struct_sizes()


# ---- errors ---------------------------------------------------------------------------------------
class MoeflowError(RuntimeError):
    """A failed moeflow call: .code (the mf_result_t), .name ("MF_ERR_CAPACITY"), .message
    (mf_last_error() of the failing thread)."""

    def __init__(self, code, message):
        self.code = int(code)
        self.name = RESULT_NAMES[code] if 0 <= code < len(RESULT_NAMES) else f"MF_ERR_{code}"
        self.message = message
        super().__init__(f"{self.name}: {message}")


def check(result):
    """Raises MoeflowError carrying mf_last_error() when `result` is not MF_SUCCESS. Call it on
    the thread that made the call (the message is per thread)."""
    if result != 0:
        raise MoeflowError(result, mf_last_error().decode(errors="replace"))


# ---- helpers --------------------------------------------------------------------------------------
def config(struct, magic, **fields):
    """A config struct with size / magic / version filled in as its INIT macro does."""
    return struct(size=ctypes.sizeof(struct), magic=magic, version=API_VERSION, **fields)


def tensor(data, dtype, shape):
    """An mf_tensor_t over `data` (an address, or 0 / None) of mf_dtype_t `dtype`."""
    t = Tensor(data or None, dtype, len(shape))
    t.dims[:len(shape)] = shape
    return t
