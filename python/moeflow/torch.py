"""moeflow.torch — the MoE layer, dispatch and combine on torch tensors.

    comm = moeflow.torch.comm_from_process_group()      # one rank per process (torch.distributed)
    comms = moeflow.torch.virtual_comms(4, "cpu")       # or R virtual ranks of this process
    layer = MoELayer(comm, E, K, H, I, max_tokens, dtype=torch.float8_e4m3fn)
    layer.set_weights(w13, w2, w13_scale, w2_scale)     # this rank's experts; borrowed
    y = layer(x, topk_ids, topk_weights)                # collective

The three calls are torch.library custom ops, torch.ops.moeflow.forward / dispatch / combine, whose
first argument is the layer's int handle (a key of a registry in this module); they run on
torch.cuda.current_stream() (CUDA backend) or synchronously on host memory (CPU backend), so CUDA
graph capture and torch.compile see them as opaque ops with fake (meta) implementations.

Overlap (docs/API.md section 16): the halves are ops too, dispatch_send / dispatch_recv /
combine_send / combine_recv, whose second argument is an exchange's int handle; DeepEP's hooks sit
on them:

    d, hook = layer.dispatch(x, ids, return_recv_hook=True)   # sends, returns at once
    ...                                                        # other work (the other micro-batch)
    hook()                                                     # waits; d's tensors now hold the rows
    y, hook = layer.combine(expert_out, w, d, return_recv_hook=True)
    hook()                                                     # y now holds the sum

A layer made with max_in_flight = 2 holds two such exchanges at once (two micro-batches). On CUDA
the halves of one comm are chained by events, so a hook may run on another stream than its send
(vLLM's dual-batch overlap runs one micro-batch's receive on the other's stream).

Every tensor is checked before the C call (dtype -> TypeError; device, shape, contiguity,
alignment -> ValueError, naming the argument); the library's own failures raise MoeflowError.
topk_ids may be int64 (torch.topk's dtype): MoELayer converts them to int32, one small copy.
"""
import itertools
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import _lib
from .core import Comm, Group, Layer, resolve_backend

_MF_DTYPE = {torch.bfloat16: _lib.DTYPE["bf16"], torch.float8_e4m3fn: _lib.DTYPE["fp8"],
             torch.float32: _lib.DTYPE["fp32"], torch.int32: _lib.DTYPE["int32"]}
_LAYER_DTYPE = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
_ROW_ALIGN = 16  # bytes: activations, payloads, expert outputs and weights (include/moeflow.h)
_UNUSED = _lib.Tensor()  # a field the layer's dtype or layout does not use


# ---- comms ----------------------------------------------------------------------------------------
def comm_from_process_group(group=None, backend="auto", device=None, transport="auto",
                            heap_bytes=0, timeout_ms=0, num_sms=0):
    """This process's rank of torch.distributed process group `group` (None: the default group):
    mf_comm_init with a bootstrap whose allgather is dist.all_gather of a uint8 tensor over the
    group (on the current CUDA device for an nccl group, else on the CPU). Collective over the
    group. CUDA backend: `device` defaults to torch.cuda.current_device(). `transport` "auto"
    (ipc for ranks of one host), "ipc" or "local"; `num_sms` the SMs this rank's peer-waiting
    kernels may use (0: all, or num_sms / ranks sharing the device), as mf_comm_config_t. The
    group must stay usable until the comm is closed (setup calls and close() use it)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    backend = resolve_backend(backend)
    if backend == "cuda" and device is None:
        device = torch.cuda.current_device()
    on = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
          else torch.device("cpu"))

    def allgather(data):  # every rank passes the same number of bytes (mf_allgather_fn)
        if not data:
            return [b""] * size
        send = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(on)
        recv = [torch.empty_like(send) for _ in range(size)]
        dist.all_gather(recv, send, group=group)
        return [bytes(t.cpu().tolist()) for t in recv]

    return Comm.init(rank, size, allgather, backend=backend, transport=transport,
                     device=device or 0, heap_bytes=heap_bytes, timeout_ms=timeout_ms,
                     num_sms=num_sms)


def virtual_comms(num_ranks, backend="auto", device=None, timeout_ms=0, heap_bytes=0):
    """The comms of a new Group of `num_ranks` virtual ranks of this process (one thread per rank
    must make each collective call: moeflow.run_ranks). comms[0].group.close() frees them, after
    their layers. CUDA with R > 1: each rank's thread must use its own torch.cuda.Stream (never
    the default stream), and the process should set CUDA_DEVICE_MAX_CONNECTIONS=32 and
    CUDA_MODULE_LOADING=EAGER before it first uses CUDA (docs/API.md section 10)."""
    if device is None:
        device = torch.cuda.current_device() if resolve_backend(backend) == "cuda" else 0
    return Group(num_ranks, backend, device=device, timeout_ms=timeout_ms,
                 heap_bytes=heap_bytes).comms


# ---- checks ---------------------------------------------------------------------------------------
def _check(name, t, dtype, shape, device, row=False):
    """Raises TypeError / ValueError unless t is a contiguous tensor of `dtype` and `shape` (None:
    any extent) on `device`, and, if `row` and t has memory (not a fake tensor of torch.compile),
    16-byte aligned. (Plain loops: this runs on every call.)"""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"moeflow: {name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"moeflow: {name} must be {dtype}, not {t.dtype}")
    if t.device != device:
        raise ValueError(f"moeflow: {name} is on {t.device}, the layer's comm on {device}")
    got = t.shape
    if len(got) != len(shape):
        _bad_shape(name, shape, got)
    for want, have in zip(shape, got):
        if want is not None and want != have:
            _bad_shape(name, shape, got)
    if not t.is_contiguous():
        raise ValueError(f"moeflow: {name} must be contiguous (call .contiguous())")
    if row and not _is_fake(t) and t.data_ptr() % _ROW_ALIGN:
        raise ValueError(f"moeflow: {name} must be {_ROW_ALIGN}-byte aligned")


def _bad_shape(name, shape, got):
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise ValueError(f"moeflow: {name} must have shape {want}, not {list(got)}")


def _is_fake(t):
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _desc(t):
    ndim = t.dim()
    d = _lib.Tensor(t.data_ptr() or None, _MF_DTYPE[t.dtype], ndim)
    d.dims[:ndim] = t.shape
    return d


# ---- the layer registry and the custom ops --------------------------------------------------------
_layers = {}
_next_handle = itertools.count(1)
_registry_lock = threading.Lock()


def _layer(handle):
    try:
        return _layers[handle]
    except KeyError:
        raise ValueError(f"moeflow: no open MoELayer has handle {handle}") from None


def _forward(layer, x, topk_ids, topk_weights, y=None):
    layer._check_tokens(x, topk_ids, topk_weights)
    if y is None:
        y = torch.empty_like(x)
    else:
        _check("out", y, torch.bfloat16, tuple(x.shape), layer.device, row=True)
    layer._core.forward(_desc(x), _desc(topk_ids), _desc(topk_weights), _desc(y), layer._stream())
    return y


@torch.library.custom_op("moeflow::forward", mutates_args=())
def _forward_op(handle: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    return _forward(_layer(handle), x, topk_ids, topk_weights)


@_forward_op.register_fake
def _(handle, x, topk_ids, topk_weights):
    _layer(handle)._check_tokens(x, topk_ids, topk_weights)
    return torch.empty_like(x)


@torch.library.custom_op("moeflow::dispatch", mutates_args=())
def _dispatch_op(handle: int, x: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = _layer(handle)
    layer._check_tokens(x, topk_ids)
    out = layer._dispatch_outputs(torch.empty)
    used = layer._dispatch_used()
    layer._core.dispatch(_desc(x), _desc(topk_ids),
                         *(_desc(t) if u else _UNUSED for t, u in zip(out, used)),
                         stream=layer._stream())
    return out


@_dispatch_op.register_fake
def _(handle, x, topk_ids):
    layer = _layer(handle)
    layer._check_tokens(x, topk_ids)
    return layer._dispatch_outputs(torch.empty)


def _combine(layer, expert_out, topk_weights, recv_src, y=None):
    layer._check_combine(expert_out, topk_weights, recv_src)
    if y is None:
        y = layer._new((topk_weights.shape[0], layer.hidden), torch.bfloat16)
    else:
        _check("out", y, torch.bfloat16, (topk_weights.shape[0], layer.hidden), layer.device,
               row=True)
    layer._core.combine(_desc(expert_out), _desc(topk_weights), _desc(y), layer._stream())
    return y


@torch.library.custom_op("moeflow::combine", mutates_args=())
def _combine_op(handle: int, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                recv_src: torch.Tensor) -> torch.Tensor:
    # recv_src (of the dispatch being combined) is read by no one: it orders combine after
    # its dispatch for graph transforms.
    return _combine(_layer(handle), expert_out, topk_weights, recv_src)


@_combine_op.register_fake
def _(handle, expert_out, topk_weights, recv_src):
    layer = _layer(handle)
    layer._check_combine(expert_out, topk_weights, recv_src)
    return layer._new((topk_weights.shape[0], layer.hidden), torch.bfloat16)


def _experts(layer, recv_x, recv_scales, expert_counts, out):
    lead, H = layer._rows_shape(), layer.hidden
    if layer.layout != "masked":
        raise ValueError("moeflow: layer.experts runs on the MASKED layout (make the layer with "
                         "layout='masked')")
    _check("recv_x", recv_x, layer.dtype, (*lead, H), layer.device, row=True)
    fp8 = layer.dtype == torch.float8_e4m3fn
    if fp8:
        _check("recv_scales", recv_scales, torch.float32, (*lead, H // _lib.QUANT_BLOCK),
               layer.device)
    _check("expert_counts", expert_counts, torch.int32, lead[:1], layer.device)
    if out is None:
        out = layer._new((*lead, H), torch.bfloat16)
    else:
        _check("out", out, torch.bfloat16, (*lead, H), layer.device, row=True)
    layer._core.experts(_desc(recv_x), _desc(recv_scales) if fp8 else _UNUSED,
                        _desc(expert_counts), _desc(out), layer._stream())
    return out


@torch.library.custom_op("moeflow::experts", mutates_args=("out",))
def _experts_op(handle: int, recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                expert_counts: torch.Tensor, out: torch.Tensor) -> None:
    _experts(_layer(handle), recv_x, recv_scales, expert_counts, out)


@_experts_op.register_fake
def _(handle, recv_x, recv_scales, expert_counts, out):
    return None


# ---- the halves: exchanges, their registry and their ops ------------------------------------------
_exchanges = {}
_next_exchange = itertools.count(1)


def _exchange(key):
    try:
        return _exchanges[key]
    except KeyError:
        raise ValueError(f"moeflow: no open exchange has handle {key}") from None


class _Chain:
    """CUDA: orders every half of a comm on the device whatever stream runs it: each half waits
    for the event recorded after the one before (the halves' stream-order contract)."""

    def __init__(self):
        self.tail = None

    def enter(self, layer):
        if layer.device.type == "cuda" and self.tail is not None:
            torch.cuda.current_stream(layer.device).wait_event(self.tail)

    def leave(self, layer):
        if layer.device.type == "cuda":
            self.tail = torch.cuda.Event()
            self.tail.record(torch.cuda.current_stream(layer.device))
            return self.tail
        return None


def _chain(layer):
    comm = layer.comm
    if not hasattr(comm, "_moeflow_chain"):
        comm._moeflow_chain = _Chain()
    return comm._moeflow_chain


def _half(layer, call):
    """Runs one half between the comm's chain events; returns the event after it (CUDA)."""
    ch = _chain(layer)
    ch.enter(layer)
    call()
    return ch.leave(layer)


@torch.library.custom_op("moeflow::dispatch_send", mutates_args=())
def _dispatch_send_op(handle: int, exchange: int, x: torch.Tensor, topk_ids: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = _layer(handle)
    layer._check_tokens(x, topk_ids)
    out = layer._dispatch_outputs(torch.empty)
    used = layer._dispatch_used()
    descs = [_desc(t) if u else _UNUSED for t, u in zip(out, used)]
    _half(layer, lambda: _exchange(exchange).dispatch_send(_desc(x), _desc(topk_ids), *descs,
                                                           stream=layer._stream()))
    return out


@_dispatch_send_op.register_fake
def _(handle, exchange, x, topk_ids):
    layer = _layer(handle)
    layer._check_tokens(x, topk_ids)
    return layer._dispatch_outputs(torch.empty)


@torch.library.custom_op("moeflow::dispatch_recv",
                         mutates_args=("recv_x", "recv_scales", "recv_src", "expert_counts",
                                       "expert_offsets"))
def _dispatch_recv_op(handle: int, exchange: int, recv_x: torch.Tensor, recv_scales: torch.Tensor,
                      recv_src: torch.Tensor, expert_counts: torch.Tensor,
                      expert_offsets: torch.Tensor) -> None:
    # The outputs were given to the send (its C call keeps their pointers); they are arguments
    # here so that graph transforms order their readers after the receive.
    layer = _layer(handle)
    _half(layer, lambda: _exchange(exchange).dispatch_recv(stream=layer._stream()))


@_dispatch_recv_op.register_fake
def _(handle, exchange, recv_x, recv_scales, recv_src, expert_counts, expert_offsets):
    return None


@torch.library.custom_op("moeflow::combine_send", mutates_args=())
def _combine_send_op(handle: int, exchange: int, expert_out: torch.Tensor, topk_weights: torch.Tensor,
                     recv_src: torch.Tensor) -> torch.Tensor:
    layer = _layer(handle)
    layer._check_combine(expert_out, topk_weights, recv_src)
    y = layer._new((topk_weights.shape[0], layer.hidden), torch.bfloat16)
    _half(layer, lambda: _exchange(exchange).combine_send(_desc(expert_out), _desc(topk_weights),
                                                          _desc(y), stream=layer._stream()))
    return y


@_combine_send_op.register_fake
def _(handle, exchange, expert_out, topk_weights, recv_src):
    layer = _layer(handle)
    layer._check_combine(expert_out, topk_weights, recv_src)
    return layer._new((topk_weights.shape[0], layer.hidden), torch.bfloat16)


@torch.library.custom_op("moeflow::combine_recv", mutates_args=("y",))
def _combine_recv_op(handle: int, exchange: int, y: torch.Tensor) -> None:
    layer = _layer(handle)
    _half(layer, lambda: _exchange(exchange).combine_recv(stream=layer._stream()))


@_combine_recv_op.register_fake
def _(handle, exchange, y):
    return None


class _RecvHook:
    """DeepEP's receive hook: calling it runs the receive half (once) on the current stream. With
    async_finish it returns a torch.cuda.Event recorded after the receive (None on the CPU)."""

    def __init__(self, run, async_finish):
        self._run, self._async_finish, self.done = run, async_finish, None

    @property
    def called(self):
        return self._run is None

    def __call__(self):
        if self._run is None:
            raise RuntimeError("moeflow: this receive hook was already called")
        run, self._run = self._run, None
        self.done = run()
        return self.done if self._async_finish else None

    def wait(self):
        """Makes the current stream wait for the receive (CUDA; the hook must have run)."""
        if self._run is not None:
            raise RuntimeError("moeflow: the receive hook has not been called")
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)


@dataclass
class DispatchResult:
    """mf_dispatch's outputs (docs/LAYOUTS.md). EXPERT_MAJOR: recv_x [rows, H], recv_scales
    [rows, H/128], recv_src [rows, 3], expert_counts [L], expert_offsets [L + 1]; MASKED: recv_x
    [L, C, H], recv_scales [L, C, H/128], recv_src [L, C, 3], expert_counts [L], expert_offsets
    None. recv_scales is None for BF16. Rows past a segment's count hold no data."""
    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_src: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: Optional[torch.Tensor]
    exchange: int = 0   # the exchange of return_recv_hook=True (its combine uses it), else 0
    event: Optional[object] = None  # async_finish: a torch.cuda.Event after the send


class MoELayer(torch.nn.Module):
    """An EP MoE layer on one rank (`comm`): created collectively over the comm's group (virtual
    ranks: one thread each). `dtype` is the weights' and dispatch payload's: torch.float8_e4m3fn
    (block-scaled) or torch.bfloat16. Other arguments as mf_moe_config_t (docs/API.md). Call
    close() before the comm (or its group) is closed; the registry keeps the layer alive until
    then."""

    def __init__(self, comm, num_experts, topk, hidden, intermediate, max_tokens,
                 dtype=torch.float8_e4m3fn, layout="expert_major", block_m=0, expert_capacity=0,
                 max_recv_rows=0, dataflow="auto", ue8m0=False, num_physical_experts=0,
                 spare_slots=0, placement="linear", max_in_flight=0):
        super().__init__()
        if dtype not in _LAYER_DTYPE:
            raise TypeError(f"moeflow: dtype must be torch.float8_e4m3fn or torch.bfloat16, "
                            f"not {dtype}")
        self._core = Layer(comm, num_experts, topk, hidden, intermediate, max_tokens,
                           dtype=_LAYER_DTYPE[dtype], layout=layout, block_m=block_m,
                           expert_capacity=expert_capacity, max_recv_rows=max_recv_rows,
                           dataflow=dataflow, ue8m0=ue8m0,
                           num_physical_experts=num_physical_experts, spare_slots=spare_slots,
                           placement=placement, max_in_flight=max_in_flight)
        self.max_in_flight = max(1, max_in_flight)
        self._idle = []  # exchange keys not in flight (return_recv_hook)
        self.comm, self.dtype, self.layout, self.placement = comm, dtype, layout, placement
        self.num_experts, self.topk, self.hidden = num_experts, topk, hidden
        self.intermediate, self.max_tokens = intermediate, max_tokens
        self.info = self._core.info
        self.slots_per_rank = self.info.num_local_slots  # L_r, or P / R with replicas
        self.device = (torch.device("cuda", comm.device) if comm.backend == "cuda"
                       else torch.device("cpu"))
        self._weights = None
        with _registry_lock:
            self.handle = next(_next_handle)
            _layers[self.handle] = self

    # -- weights ------------------------------------------------------------------------------------
    def set_weights(self, w13, w2, w13_scale=None, w2_scale=None):
        """This rank's L local experts (Lp = num_physical_experts / R slots with replicas, in
        the expert map's order): w13 [L, 2I, H], w2 [L, H, I] in the layer's dtype; FP8 also fp32
        block scales w13_scale [L, 2I/128, H/128], w2_scale [L, H/128, I/128]. The layer keeps
        references (the library borrows the memory): do not resize them; in-place updates are
        seen by the next forward."""
        self._core.set_weights(*self._weight_descs(w13, w2, w13_scale, w2_scale))
        self._weights = (w13, w2, w13_scale, w2_scale)

    def _weight_descs(self, w13, w2, w13_scale, w2_scale):
        """Checked descriptors (w13, w13_scale, w2, w2_scale) of one rank's slot weights."""
        L, H, inter, dev = self.slots_per_rank, self.hidden, self.intermediate, self.device
        _check("w13", w13, self.dtype, (L, 2 * inter, H), dev, row=True)
        _check("w2", w2, self.dtype, (L, H, inter), dev, row=True)
        if self.dtype == torch.float8_e4m3fn:
            b = _lib.QUANT_BLOCK
            _check("w13_scale", w13_scale, torch.float32, (L, 2 * inter // b, H // b), dev)
            _check("w2_scale", w2_scale, torch.float32, (L, H // b, inter // b), dev)
            scales = (_desc(w13_scale), _desc(w2_scale))
        elif w13_scale is not None or w2_scale is not None:
            raise ValueError("moeflow: a BF16 layer takes no weight scales")
        else:
            scales = (_UNUSED, _UNUSED)
        return _desc(w13), scales[0], _desc(w2), scales[1]

    # -- the calls ----------------------------------------------------------------------------------
    def forward(self, x, topk_ids, topk_weights, out=None):
        """y [T, H] bf16 = sum over k of topk_weights[:, k] * expert_{topk_ids[:, k]}(x), for
        x [T, H] bf16 (T <= max_tokens), topk_ids [T, K] int32 (or int64) global expert ids in
        [-1, E), -1 skipping, topk_weights [T, K] fp32; written into `out` ([T, H] bf16,
        contiguous) when given. Collective."""
        _tensors(x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        if torch.compiler.is_compiling():  # traced: the op, which torch.compile sees
            y = torch.ops.moeflow.forward(self.handle, x, _ids(topk_ids), topk_weights)
            return y if out is None else out.copy_(y)
        # eager: the op's body without the dispatcher (~5 us a call); the same checks and call
        return _forward(self, x, _ids(topk_ids), topk_weights, out)

    def dispatch(self, x, topk_ids, return_recv_hook=False, previous_event=None,
                 async_finish=False):
        """Sends every (token, k) to its expert's rank: a DispatchResult in the layer's layout.
        Collective; a combine on this layer must follow.

        return_recv_hook=True (DeepEP's low-latency form): only the send half runs now, which
        returns without waiting on any peer; returns (DispatchResult, hook), and the result's
        tensors hold the rows once hook() has run (the receive half, on the stream current
        then). Up to max_in_flight dispatches of the layer may be in flight; receive them in the
        order they were sent. previous_event (a torch.cuda.Event): the send waits for it;
        async_finish: result.event is an event after the send, and hook() returns one after
        the receive (CUDA)."""
        _tensors(x=x, topk_ids=topk_ids)
        if not (return_recv_hook or previous_event is not None or async_finish):
            out = torch.ops.moeflow.dispatch(self.handle, x, _ids(topk_ids))
            used = self._dispatch_used()
            return DispatchResult(*(t if u else None for t, u in zip(out, used)))
        self._check_events(previous_event)
        key = self._take_exchange()
        try:
            out = torch.ops.moeflow.dispatch_send(self.handle, key, x, _ids(topk_ids))
        except Exception:
            self._idle.append(key)  # a failed send leaves its exchange idle
            raise
        used = self._dispatch_used()
        d = DispatchResult(*(t if u else None for t, u in zip(out, used)), exchange=key,
                           event=_chain(self).tail if async_finish else None)

        def receive():
            try:
                return self._recv(torch.ops.moeflow.dispatch_recv, key, *out)
            except Exception:
                self._idle.append(key)  # a failed receive ends the exchange
                raise

        hook = _RecvHook(receive, async_finish)
        if return_recv_hook:
            return d, hook
        hook()
        return d

    def combine(self, expert_out, topk_weights, dispatch_result, out=None, return_recv_hook=False,
                previous_event=None, async_finish=False):
        """y [T, H] bf16: the weighted K-sum of expert_out (bf16, recv_x's layout and rows) over
        this rank's tokens of the preceding dispatch (`dispatch_result`); written into `out`
        ([T, H] bf16, contiguous) when given. Collective. return_recv_hook=True (the dispatch
        must have been made with it too): returns (y, hook) after the send half; y holds the
        sum once hook() has run. previous_event / async_finish as dispatch's."""
        _tensors(expert_out=expert_out, topk_weights=topk_weights)
        key = getattr(dispatch_result, "exchange", 0)
        if key:
            self._check_events(previous_event)
            y = torch.ops.moeflow.combine_send(self.handle, key, expert_out, topk_weights,
                                               dispatch_result.recv_src)

            def receive():
                try:
                    done = self._recv(torch.ops.moeflow.combine_recv, key, y)
                finally:
                    self._idle.append(key)  # the exchange ended, received or failed
                if out is not None:
                    out.copy_(y)
                return done

            hook = _RecvHook(receive, async_finish)
            if return_recv_hook:
                return (y if out is None else out), hook
            hook()
            return y if out is None else out
        if return_recv_hook or previous_event is not None or async_finish:
            raise ValueError("moeflow: combine with return_recv_hook / events needs a dispatch made "
                             "with return_recv_hook=True (or events)")
        if torch.compiler.is_compiling():
            y = torch.ops.moeflow.combine(self.handle, expert_out, topk_weights,
                                          dispatch_result.recv_src)
            return y if out is None else out.copy_(y)
        return _combine(self, expert_out, topk_weights, dispatch_result.recv_src, out)

    def experts(self, recv_x, recv_scales, expert_counts, out=None):
        """This rank's experts (W13 -> SwiGLU -> W2 with the layer's weights) on rows in the MASKED
        dispatch layout: recv_x [L, C, H] (the layer's dtype; FP8 with recv_scales [L, C, H/128]
        fp32, else None), expert_counts [L] int32 -> expert_out [L, C, H] bf16 (into `out` when
        given; rows past a count not written). The fused layer's rounding, so dispatch ->
        experts -> combine is forward's y (bit for bit on the CPU). Not collective; on CUDA on
        the current stream, counts read on the device (graph-capturable)."""
        if torch.compiler.is_compiling():
            if out is None:
                out = torch.empty((*self._rows_shape(), self.hidden), dtype=torch.bfloat16,
                                  device=self.device)
            torch.ops.moeflow.experts(self.handle, recv_x, recv_scales, expert_counts, out)
            return out
        return _experts(self, recv_x, recv_scales, expert_counts, out)

    def set_expert_map(self, phys_to_logical):
        """The logical expert of each of the P physical slots (a list or an integer tensor, vLLM
        EPLB's physical_to_logical_map for this layer; slot p on rank p // (P / R)). Every rank
        sets the same map between calls, with weights (set_weights) holding its experts."""
        if isinstance(phys_to_logical, torch.Tensor):
            phys_to_logical = phys_to_logical.detach().cpu().tolist()
        self._core.set_expert_map(phys_to_logical)

    def stage_expert_map(self, phys_to_logical, w13, w2, w13_scale=None, w2_scale=None, experts_per_step=0):
        """Rebalancing without a stall: stages a new map whose weights moeflow moves into the given
        tensors (shaped as set_weights'; the library writes them) over the next prefetch() calls,
        at most experts_per_step per rank per call (0 = all at once); the old map and weights serve
        until the switch, after which these tensors are the weights (balance_stats()
        ["stage_steps_left"] == 0; the old ones may then be freed). Collective and blocking; every
        rank stages the same map. The layer keeps references to both sets."""
        if isinstance(phys_to_logical, torch.Tensor):
            phys_to_logical = phys_to_logical.detach().cpu().tolist()
        descs = self._weight_descs(w13, w2, w13_scale, w2_scale)
        self._core.stage_expert_map(phys_to_logical, *descs, experts_per_step=experts_per_step)
        self._staged_weights = (w13, w2, w13_scale, w2_scale)

    def prefetch(self):
        """Per-step balancing (spare_slots > 0): fills the spare slots for the next forward from
        the last forward's counts, on the current stream (e.g. a side stream during attention;
        the next forward waits for it on the device). Collective between two forwards. Not a
        torch op: call it eagerly or inside a captured CUDA graph, not under torch.compile."""
        self._core.prefetch(self._stream())

    def balance_stats(self):
        """Rows per rank with and without replicas in the last forward, bytes the last prefetch
        moved (a dict; synchronises with the last forward on CUDA)."""
        return self._core.balance_stats()

    def close(self):
        """Destroys the C layer (not collective), its exchanges, and drops the weights' references."""
        with _registry_lock:
            _layers.pop(self.handle, None)
            for key in [k for k, x in _exchanges.items() if x.layer is self._core]:
                del _exchanges[key]
        self._core.close()
        self._weights = None

    def extra_repr(self):
        return (f"rank={self.info.rank}/{self.info.num_ranks}, experts={self.num_experts}, "
                f"topk={self.topk}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"dtype={self.dtype}, layout={self.layout!r}")

    # -- internals (also used by the ops) -----------------------------------------------------------
    def _take_exchange(self):
        """An idle exchange of this layer (made on demand: the library refuses more in flight
        than the heap holds, on every rank alike)."""
        if self._idle:
            return self._idle.pop()
        from .core import Exchange
        key = next(_next_exchange)
        with _registry_lock:
            _exchanges[key] = Exchange(self._core)
        return key

    def _recv(self, op, key, *tensors):
        op(self.handle, key, *tensors)
        return _chain(self).tail

    def _check_events(self, previous_event):
        if previous_event is None:
            return
        if self.device.type != "cuda":
            raise ValueError("moeflow: events are CUDA's: the CPU backend runs each half to "
                             "completion (pass previous_event=None)")
        torch.cuda.current_stream(self.device).wait_event(previous_event)

    def _stream(self):
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).cuda_stream
        return None

    def _new(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _check_tokens(self, x, topk_ids, topk_weights=None):
        _check("x", x, torch.bfloat16, (None, self.hidden), self.device, row=True)
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"moeflow: x has {T} tokens, the layer at most {self.max_tokens}")
        _check("topk_ids", topk_ids, torch.int32, (T, self.topk), self.device)
        if topk_weights is not None:
            _check("topk_weights", topk_weights, torch.float32, (T, self.topk), self.device)

    def _rows_shape(self):
        """The leading dims of dispatch outputs: [rows] or [L, C]."""
        if self.layout == "masked":
            return (self.info.num_local_slots, self.info.expert_capacity)
        return (self.info.max_recv_rows,)

    def _dispatch_used(self):
        """Which of the five dispatch outputs this dtype and layout use."""
        return (True, self.dtype == torch.float8_e4m3fn, True, True, self.layout != "masked")

    def _dispatch_outputs(self, empty):
        lead, L, H = self._rows_shape(), self.info.num_local_slots, self.hidden
        used = self._dispatch_used()
        scales = (*lead, H // _lib.QUANT_BLOCK) if used[1] else (0,)
        shapes = (((*lead, H), self.dtype), (scales, torch.float32), ((*lead, 3), torch.int32),
                  ((L,), torch.int32), (((L + 1,) if used[4] else (0,)), torch.int32))
        return tuple(empty(s, dtype=d, device=self.device) for s, d in shapes)

    def _check_combine(self, expert_out, topk_weights, recv_src):
        lead = self._rows_shape()
        _check("expert_out", expert_out, torch.bfloat16, (*lead, self.hidden), self.device,
               row=True)
        _check("topk_weights", topk_weights, torch.float32, (None, self.topk), self.device)
        _check("recv_src", recv_src, torch.int32, (*lead, 3), self.device)


def _tensors(**args):
    """TypeError for an argument that is no tensor (the op's schema would say less)."""
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moeflow: {name} must be a torch.Tensor, not {type(t).__name__}")


def _ids(topk_ids):
    """int64 ids (torch.topk's dtype) as int32; anything else goes to the op's check."""
    if topk_ids.dtype == torch.int64:
        return topk_ids.to(torch.int32)
    return topk_ids
