"""moeflow.core — the thin Pythonic layer over moeflow._lib: groups, comms and layers.

Objects own their C handles and free them in close() (also as context managers); nothing is freed
by the garbage collector, because mf_comm_destroy is collective and must be called by every rank
in the same order. Collective calls (Comm.init, Layer(...), Layer.forward/dispatch/combine) on
virtual ranks must come from one thread per rank, as in C (docs/API.md section 9).

Tensors cross as _lib.Tensor descriptors built by the caller (moeflow.torch builds them from torch
tensors); this module does no shape checking of its own: the library checks and MoeflowError says
what was wrong.
"""
import ctypes
import threading
from dataclasses import dataclass

from . import _lib
from ._lib import check

_BACKEND_NAMES = {v: k for k, v in _lib.BACKEND.items()}
_TRANSPORT_NAMES = {v: k for k, v in _lib.TRANSPORT.items()}


def _enum(table, what, value):
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"moeflow: {what} must be one of {sorted(table)}, not {value!r}") from None


def backend_available(name):
    """True if backend `name` ("cpu", "cuda", "auto") can be used by this build on this machine."""
    return bool(_lib.mf_backend_available(_enum(_lib.BACKEND, "backend", name)))


def resolve_backend(name):
    """"auto" -> "cuda" when the build has it and a device is present, else "cpu"."""
    _enum(_lib.BACKEND, "backend", name)
    if name == "auto":
        return "cuda" if backend_available("cuda") else "cpu"
    return name


def _version():
    code = _lib.mf_get_version()
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


version = _version()


class Comm:
    """One rank of a group: from Group.comm(rank) (virtual ranks; owned by the group) or from
    Comm.init (one rank per process; the caller closes it, collectively)."""

    def __init__(self, handle, backend, device, group=None, keepalive=None):
        self.handle = handle
        self.backend = backend          # "cpu" or "cuda"
        self.device = device            # CUDA ordinal (CUDA backend), else None
        self.group = group              # the Group of a virtual rank, else None
        self._keepalive = keepalive     # the bootstrap callback of Comm.init
        self._layers = set()            # open Layers: the comm refuses to close under them
        rank, size, transport = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        check(_lib.mf_comm_get_rank(handle, ctypes.byref(rank)))
        check(_lib.mf_comm_get_size(handle, ctypes.byref(size)))
        check(_lib.mf_comm_get_transport(handle, ctypes.byref(transport)))
        self.rank, self.size = rank.value, size.value
        self.transport = _TRANSPORT_NAMES[transport.value]

    @classmethod
    def init(cls, rank, size, allgather, backend="auto", transport="auto", device=0,
             heap_bytes=0, timeout_ms=0, num_sms=0):
        """This process's rank `rank` of `size` (mf_comm_init). Collective and blocking.
        `allgather(data: bytes) -> list[bytes]` returns every rank's `data`, in rank order; it is
        called during setup only (here, Layer(...) and close()). "auto" backend resolves here, the
        same way on every rank of one machine."""
        backend = resolve_backend(backend)
        cfg = _lib.config(_lib.CommConfig, _lib.COMM_CONFIG_MAGIC,
                          backend=_lib.BACKEND[backend],
                          transport=_enum(_lib.TRANSPORT, "transport", transport),
                          device=device, num_sms=num_sms, timeout_ms=timeout_ms,
                          heap_bytes=heap_bytes)

        failures = []  # a C callback cannot raise: keep the exception, chain it below

        def gather(_ctx, send, recv, nbytes):
            try:
                blocks = allgather(ctypes.string_at(send, nbytes))
                if len(blocks) != size or any(len(b) != nbytes for b in blocks):
                    raise ValueError(f"allgather returned {[len(b) for b in blocks]} bytes, "
                                     f"wanted {size} x {nbytes}")
                ctypes.memmove(recv, b"".join(blocks), nbytes * size)
                return 0
            except Exception as e:
                failures.append(e)
                return 1

        callback = _lib.ALLGATHER_FN(gather)
        bootstrap = _lib.Bootstrap(callback, None, _lib.DESTROY_FN())
        handle = ctypes.c_void_p()
        try:
            check(_lib.mf_comm_init(ctypes.byref(cfg), rank, size, ctypes.byref(bootstrap),
                                    ctypes.byref(handle)))
        except _lib.MoeflowError as e:
            raise e from (failures[0] if failures else None)
        return cls(handle.value, backend, device if backend == "cuda" else None,
                   keepalive=callback)

    def live(self, what):
        """The C handle; RuntimeError naming `what` once the comm (or its group) is closed."""
        if not self.handle:
            raise RuntimeError(f"moeflow: {what}: the comm is closed")
        return self.handle

    def abort(self):
        """mf_comm_abort: every wait of this rank (and of peers waiting for it) ends with
        MF_ERR_ABORTED. Any thread, not collective."""
        check(_lib.mf_comm_abort(self.live("abort")))

    def async_error(self):
        """mf_comm_get_async_error: raises the first device fault since the last report."""
        check(_lib.mf_comm_get_async_error(self.live("async_error")))

    @property
    def num_sms(self):
        """The SMs this rank's communication kernels may use (mf_comm_get_num_sms)."""
        n = ctypes.c_int32()
        check(_lib.mf_comm_get_num_sms(self.live("num_sms"), ctypes.byref(n)))
        return n.value

    def set_num_sms(self, num_sms):
        """mf_comm_set_num_sms (DeepEP's Buffer.set_num_sms): the SMs of the gather / return moves
        from the next call on; 0 restores the comm's default. Not collective."""
        check(_lib.mf_comm_set_num_sms(self.live("set_num_sms"), int(num_sms)))

    def _check_no_layers(self, what):
        if self._layers:
            raise RuntimeError(f"moeflow: {what}: rank {self.rank} still has {len(self._layers)} "
                               f"open layer(s); close them first (layer.close())")

    def close(self):
        """Destroys a comm made by Comm.init (collective when healthy), after its layers (a
        RuntimeError, with nothing destroyed, while one is open); a no-op for a group's comm
        (Group.close frees it)."""
        if self.group is None and self.handle:
            self._check_no_layers("Comm.close")
            handle, self.handle = self.handle, None
            check(_lib.mf_comm_destroy(handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Comm(rank={self.rank}, size={self.size}, backend={self.backend!r}, "
                f"transport={self.transport!r})")


class Group:
    """`num_ranks` virtual ranks of this process (mf_group_create), one comm each."""

    def __init__(self, num_ranks, backend="auto", device=0, timeout_ms=0, heap_bytes=0,
                 num_sms=0):
        cfg = _lib.config(_lib.GroupConfig, _lib.GROUP_CONFIG_MAGIC,
                          backend=_enum(_lib.BACKEND, "backend", backend),
                          transport=_lib.TRANSPORT["local"], num_ranks=num_ranks, device=device,
                          num_sms=num_sms, timeout_ms=timeout_ms, heap_bytes=heap_bytes)
        handle = ctypes.c_void_p()
        check(_lib.mf_group_create(ctypes.byref(cfg), ctypes.byref(handle)))
        self.handle = handle.value
        resolved = ctypes.c_int32()
        check(_lib.mf_group_get_backend(self.handle, ctypes.byref(resolved)))
        self.backend = _BACKEND_NAMES[resolved.value]
        self.num_ranks = num_ranks
        self._comms = []
        for r in range(num_ranks):
            comm = ctypes.c_void_p()
            check(_lib.mf_group_get_comm(self.handle, r, ctypes.byref(comm)))
            self._comms.append(Comm(comm.value, self.backend,
                                    device if self.backend == "cuda" else None, group=self))

    def comm(self, rank):
        return self._comms[rank]

    @property
    def comms(self):
        return list(self._comms)

    def close(self):
        """mf_group_destroy, after every rank's layers are closed (a RuntimeError, with nothing
        destroyed, while one is open)."""
        if self.handle:
            for c in self._comms:
                c._check_no_layers("Group.close")
            handle, self.handle = self.handle, None
            for c in self._comms:
                c.handle = None
            check(_lib.mf_group_destroy(handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class LayerInfo:
    """mf_moe_info_t: what a layer resolved its defaults to."""
    num_ranks: int
    rank: int
    num_local_experts: int
    first_expert: int
    block_m: int
    expert_capacity: int
    max_recv_rows: int
    heap_bytes: int
    placement: int        # mf_placement_t: 0 linear, 1 round robin
    num_local_slots: int  # leading dim of this rank's weights and dispatch segments


class Layer:
    """One MoE layer on one comm (mf_moe_create: collective over the group)."""

    def __init__(self, comm, num_experts, topk, hidden, intermediate, max_tokens, dtype="fp8",
                 layout="expert_major", block_m=0, expert_capacity=0, max_recv_rows=0,
                 dataflow="auto", ue8m0=False, profile=False, num_physical_experts=0,
                 spare_slots=0, placement="linear", max_in_flight=0):
        if dtype not in ("fp8", "bf16"):
            raise ValueError(f"moeflow: dtype must be 'fp8' or 'bf16', not {dtype!r}")
        self.comm = comm
        self.num_experts, self.topk = num_experts, topk
        self.hidden, self.intermediate, self.max_tokens = hidden, intermediate, max_tokens
        self.dtype, self.layout = dtype, layout
        cfg = _lib.config(_lib.MoeConfig, _lib.MOE_CONFIG_MAGIC, num_experts=num_experts,
                          num_topk=topk, hidden=hidden, intermediate=intermediate,
                          max_tokens_per_rank=max_tokens, dtype=_lib.DTYPE[dtype],
                          layout=_enum(_lib.LAYOUT, "layout", layout), block_m=block_m,
                          expert_capacity=expert_capacity, max_recv_rows=max_recv_rows,
                          ue8m0_scales=int(ue8m0), profile=int(profile),
                          dataflow=_enum(_lib.DATAFLOW, "dataflow", dataflow),
                          num_physical_experts=num_physical_experts, spare_slots=spare_slots,
                          placement=_enum(_lib.PLACEMENT, "placement", placement),
                          max_in_flight=max_in_flight)
        handle = ctypes.c_void_p()
        check(_lib.mf_moe_create(comm.live("Layer"), ctypes.byref(cfg), ctypes.byref(handle)))
        self.handle = handle.value
        self._exchanges = []  # Exchange handles made for this layer (freed after it)
        comm._layers.add(self)
        raw = _lib.MoeInfo()
        check(_lib.mf_moe_get_info(self.handle, ctypes.byref(raw)))
        self.info = LayerInfo(*(getattr(raw, f) for f, _ in _lib.MoeInfo._fields_))

    def set_weights(self, w13, w13_scales, w2, w2_scales):
        """mf_moe_set_weights with _lib.Tensor descriptors; the layer borrows the memory."""
        w = _lib.MoeWeights(w13, w13_scales, w2, w2_scales)
        check(_lib.mf_moe_set_weights(self._live(), ctypes.byref(w)))

    def forward(self, x, topk_ids, topk_weights, y, stream=None):
        """mf_moe_forward with descriptors (collective); `stream` a cudaStream_t address."""
        check(_lib.mf_moe_forward(self._live(), ctypes.byref(_lib.ForwardIn(x, topk_ids, topk_weights)),
                                  ctypes.byref(_lib.ForwardOut(y)), stream))

    def dispatch(self, x, topk_ids, recv_x, recv_scales, recv_src, expert_counts, expert_offsets,
                 stream=None):
        """mf_dispatch with descriptors (collective)."""
        out = _lib.DispatchOut(recv_x, recv_scales, recv_src, expert_counts, expert_offsets)
        check(_lib.mf_dispatch(self._live(), ctypes.byref(_lib.DispatchIn(x, topk_ids)),
                               ctypes.byref(out), stream))

    def combine(self, expert_out, topk_weights, y, stream=None):
        """mf_combine with descriptors (collective)."""
        check(_lib.mf_combine(self._live(), ctypes.byref(_lib.CombineIn(expert_out, topk_weights)),
                              ctypes.byref(_lib.CombineOut(y)), stream))

    def experts(self, recv_x, recv_scales, expert_counts, expert_out, stream=None):
        """mf_moe_experts with descriptors (not collective): this rank's experts on MASKED rows."""
        check(_lib.mf_moe_experts(self._live(), ctypes.byref(_lib.ExpertsIn(recv_x, recv_scales, expert_counts)),
                                  ctypes.byref(_lib.ExpertsOut(expert_out)), stream))

    def set_expert_map(self, phys_to_logical):
        """mf_moe_set_expert_map: the logical expert of every physical slot (a sequence of P ints,
        vLLM EPLB's physical_to_logical_map for this layer); every rank sets the same map."""
        ids = [int(e) for e in phys_to_logical]
        arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
        check(_lib.mf_moe_set_expert_map(self._live(), arr, len(ids)))

    def stage_expert_map(self, phys_to_logical, w13, w13_scales, w2, w2_scales, experts_per_step=0):
        """mf_moe_stage_expert_map (collective, blocking): stages a new map whose weights moeflow
        moves into the given next-weights descriptors (borrowed and written) over the following
        prefetch calls, the old map serving until the switch (balance_stats()["stage_steps_left"]
        reads 0 once switched)."""
        ids = [int(e) for e in phys_to_logical]
        arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
        w = _lib.MoeWeights(w13, w13_scales, w2, w2_scales)
        check(_lib.mf_moe_stage_expert_map(self._live(), arr, len(ids), ctypes.byref(w), int(experts_per_step)))

    def prefetch(self, stream=None):
        """mf_moe_prefetch (collective between two forwards): fills the spare slots for the next
        forward from the last forward's counts; `stream` a cudaStream_t address."""
        check(_lib.mf_moe_prefetch(self._live(), stream))

    def balance_stats(self):
        """mf_moe_get_balance_stats as a dict: recv_rows / home_rows per rank (lists of R),
        prefetch_bytes, prefetch_bytes_all, spare_resident, num_physical_experts, slots_per_rank,
        spare_slots."""
        st = _lib.BalanceStats(size=ctypes.sizeof(_lib.BalanceStats))
        check(_lib.mf_moe_get_balance_stats(self._live(), ctypes.byref(st)))
        R = self.info.num_ranks
        out = {f: getattr(st, f) for f, _ in _lib.BalanceStats._fields_ if f not in ("size", "pad")}
        out["recv_rows"], out["home_rows"] = list(st.recv_rows[:R]), list(st.home_rows[:R])
        return out

    def phase_times(self):
        """Microseconds per phase of the last forward ({"prepare": .., "total": ..}); needs
        profile=True."""
        t = _lib.PhaseTimes()
        check(_lib.mf_moe_get_phase_times(self._live(), ctypes.byref(t)))
        return dict(zip(_lib.PHASES, t.us), total=t.total_us)

    def _live(self):
        if not self.handle:
            raise RuntimeError("moeflow: the layer is closed")
        return self.handle

    def close(self):
        """mf_moe_destroy (not collective; no call on the layer may be in flight; its exchanges in
        flight end), then its exchange handles. Idempotent."""
        if self.handle:
            handle, self.handle = self.handle, None
            self.comm._layers.discard(self)
            check(_lib.mf_moe_destroy(handle))
            for x in self._exchanges:
                x._free()
            self._exchanges = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Exchange:
    """One dispatch + combine of a layer in halves (mf_exchange_t; docs/API.md section 16): a send
    that returns without waiting on a peer, a receive that waits and lands the rows. Reusable: one
    exchange after another. Up to the layer's max_in_flight exchanges are in flight at once; the
    receives of each phase come in the order of its sends. `events` is (previous, finished), raw
    cudaEvent_t pointers or None (CUDA only)."""

    def __init__(self, layer):
        handle = ctypes.c_void_p()
        check(_lib.mf_exchange_create(layer._live(), ctypes.byref(handle)))
        self.handle, self.layer = handle.value, layer
        layer._exchanges.append(self)

    @staticmethod
    def _events(events):
        if events is None:
            return None
        return ctypes.byref(_lib.ExchangeEvents(*events))

    def _live(self):
        self.layer._live()
        return self.handle

    def dispatch_send(self, x, topk_ids, recv_x, recv_scales, recv_src, expert_counts,
                      expert_offsets, events=None, stream=None):
        """mf_dispatch_send: the outputs are where dispatch_recv lands the rows (collective)."""
        out = _lib.DispatchOut(recv_x, recv_scales, recv_src, expert_counts, expert_offsets)
        check(_lib.mf_dispatch_send(self._live(), ctypes.byref(_lib.DispatchIn(x, topk_ids)),
                                    ctypes.byref(out), self._events(events), stream))

    def dispatch_recv(self, events=None, stream=None):
        """mf_dispatch_recv: waits (bounded) and lands the rows."""
        check(_lib.mf_dispatch_recv(self._live(), self._events(events), stream))

    def combine_send(self, expert_out, topk_weights, y, events=None, stream=None):
        """mf_combine_send: returns the rows to their owners; y is written by combine_recv."""
        check(_lib.mf_combine_send(self._live(), ctypes.byref(_lib.CombineIn(expert_out, topk_weights)),
                                   ctypes.byref(_lib.CombineOut(y)), self._events(events), stream))

    def combine_recv(self, events=None, stream=None):
        """mf_combine_recv: waits (bounded) and sums into y; the exchange ends."""
        check(_lib.mf_combine_recv(self._live(), self._events(events), stream))

    def _free(self):
        if self.handle:
            handle, self.handle = self.handle, None
            check(_lib.mf_exchange_destroy(handle))


def run_ranks(fn, num_ranks):
    """[fn(0), .., fn(num_ranks - 1)], each on its own thread: how a process drives its virtual
    ranks' collective calls. Re-raises the first exception after every thread has ended."""
    results, errors = [None] * num_ranks, [None] * num_ranks

    def main(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: B036 - handed to the caller below
            errors[r] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results
