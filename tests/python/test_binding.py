"""moeflow (the ctypes binding): struct sizes, errors as MoeflowError, Comm.init over a Python
allgather, the reference's quantisation against the library's, and bad tensors rejected before
any C call."""
import ctypes
import threading

import pytest
import torch

import moeflow
from moeflow import _lib
from moeflow import reference as ref
from moeflow.torch import MoELayer, virtual_comms

E, K, H, I = 4, 2, 128, 128


def test_struct_sizes_and_version():
    for which, struct in enumerate(_lib.STRUCTS):
        assert _lib.mf_get_struct_size(which) == ctypes.sizeof(struct), struct.__name__
    assert moeflow.version.count(".") == 2
    assert moeflow.backend_available("cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        moeflow.backend_available("tpu")


def test_failed_call_raises_moeflow_error():
    with moeflow.Group(1, backend="cpu") as group:
        with pytest.raises(moeflow.MoeflowError) as err:
            moeflow.Layer(group.comm(0), E, K, 100, I, 8, dtype="fp8")  # H % 128 != 0
        assert err.value.code == 1 and err.value.name == "MF_ERR_INVALID_ARGUMENT"
        assert "128" in str(err.value)
        with moeflow.Layer(group.comm(0), E, K, H, I, 8, dtype="bf16") as layer:
            x = torch.zeros(1, H, dtype=torch.bfloat16)
            t = [_lib.tensor(a.data_ptr(), d, a.shape) for a, d in
                 ((x, 0), (torch.zeros(1, K, dtype=torch.int32), 3),
                  (torch.zeros(1, K), 2), (x.clone(), 0))]
            with pytest.raises(moeflow.MoeflowError) as err:
                layer.forward(*t)  # weights not set
            assert err.value.name == "MF_ERR_INVALID_USAGE"


def test_out_of_range_ids_fail_in_the_library():
    p = ref.make_problem(1, E, K, H, I, 3, dtype=torch.bfloat16)
    comms = virtual_comms(1, "cpu")
    layer = MoELayer(comms[0], E, K, H, I, 8, dtype=torch.bfloat16)
    try:
        layer.set_weights(*p.local_weights(0))
        ids = p.topk_ids[0].clone()
        ids[1, 0] = E
        with pytest.raises(moeflow.MoeflowError, match="MF_ERR_INVALID_ARGUMENT") as err:
            layer(p.x[0], ids, p.topk_weights[0])
        assert err.value.code == 1
    finally:
        layer.close()
        comms[0].group.close()


def test_comm_init_over_a_python_allgather():
    """Two ranks of this process made by Comm.init whose bootstrap is a Python allgather (threads
    meeting at a barrier); then a layer on them, against the reference."""
    R = 2
    slots, barrier = [None] * R, threading.Barrier(R)
    p = ref.make_problem(R, E, K, H, I, [4, 6], dtype=torch.float8_e4m3fn, seed=5)

    def rank(r):
        def allgather(data):
            slots[r] = data
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        comm = moeflow.Comm.init(r, R, allgather, backend="cpu")
        assert (comm.rank, comm.size, comm.backend, comm.transport) == (r, R, "cpu", "local")
        layer = MoELayer(comm, E, K, H, I, 8)
        layer.set_weights(*p.local_weights(r))
        y = layer(p.x[r], p.topk_ids[r], p.topk_weights[r])
        layer.close()
        comm.close()
        return y

    for r, y in enumerate(moeflow.run_ranks(rank, R)):
        ref.assert_close(y, p.reference(r), torch.float8_e4m3fn)


def test_comm_init_reports_a_failing_allgather():
    def allgather(data):
        raise ConnectionError("the group is gone")

    with pytest.raises(moeflow.MoeflowError) as err:
        moeflow.Comm.init(0, 2, allgather, backend="cpu")
    assert isinstance(err.value.__cause__, ConnectionError)


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_reference_quantisation_is_the_library_s(block_rows, ue8m0):
    x = (torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(block_rows)) *
         torch.logspace(-6, 3, 384)).to(torch.bfloat16)
    x[0, 0, :128] = 0  # a block below the amax clamp
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(2, 256 // block_rows, 3)
    desc = [_lib.tensor(t.data_ptr(), d, t.shape) for t, d in ((x, 0), (q, 1), (s, 2))]
    _lib.check(_lib.mf_quantize_fp8(*(ctypes.byref(d) for d in desc), block_rows, int(ue8m0)))
    q_ref, s_ref = ref.quantize_fp8(x, block_rows, ue8m0)
    assert torch.equal(s_ref, s)
    assert torch.equal(q_ref.view(torch.uint8), q.view(torch.uint8))


@pytest.fixture(scope="module")
def layer():
    """A one-rank BF16 CPU layer with weights, and a good set of inputs."""
    p = ref.make_problem(1, E, K, H, I, 4, dtype=torch.bfloat16)
    comms = virtual_comms(1, "cpu")
    lay = MoELayer(comms[0], E, K, H, I, 8, dtype=torch.bfloat16)
    lay.set_weights(*p.local_weights(0))
    yield lay, (p.x[0], p.topk_ids[0], p.topk_weights[0])
    lay.close()
    comms[0].group.close()


def _misaligned(t):
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


BAD = [  # (argument index, how to spoil it, exception, message)
    (0, lambda x: x.float(), TypeError, "x must be torch.bfloat16, not torch.float32"),
    (0, lambda x: x.to("meta"), ValueError, "x is on meta"),
    (0, lambda x: x[:, :64], ValueError, r"x must have shape \[\*, 128\]"),
    (0, lambda x: x.repeat(3, 1), ValueError, "x has 12 tokens, the layer at most 8"),
    (0, lambda x: x.t().contiguous().t(), ValueError, "x must be contiguous"),
    (0, _misaligned, ValueError, "x must be 16-byte aligned"),
    (1, lambda i: i.float(), TypeError, "topk_ids must be torch.int32"),
    (1, lambda i: i[:2], ValueError, r"topk_ids must have shape \[4, 2\]"),
    (1, lambda i: i.t().contiguous().t(), ValueError, "topk_ids must be contiguous"),
    (2, lambda w: w.double(), TypeError, "topk_weights must be torch.float32"),
    (2, lambda w: [0.5, 0.5], TypeError, "topk_weights must be a torch.Tensor, not list"),
]


@pytest.mark.parametrize("index,spoil,exc,message", BAD)
def test_bad_inputs_are_rejected_before_the_call(layer, index, spoil, exc, message, monkeypatch):
    lay, args = layer
    args = list(args)
    args[index] = spoil(args[index])
    calls = []
    monkeypatch.setattr(lay._core, "forward", lambda *a, **k: calls.append(a))
    with pytest.raises(exc, match=message):
        lay(*args)
    assert not calls


def test_bad_weights_and_combine_inputs(layer):
    lay, (x, ids, wts) = layer
    w13, w2 = lay._weights[:2]
    with pytest.raises(TypeError, match="w13 must be torch.bfloat16"):
        lay.set_weights(w13.float(), w2)
    with pytest.raises(ValueError, match=r"w2 must have shape \[4, 128, 128\]"):
        lay.set_weights(w13, w2[:, :64])
    with pytest.raises(ValueError, match="takes no weight scales"):
        lay.set_weights(w13, w2, torch.ones(1), torch.ones(1))
    d = lay.dispatch(x, ids)
    with pytest.raises(ValueError, match="expert_out must have shape"):
        lay.combine(d.recv_x[:1], wts, d)
    y = lay.combine(torch.zeros_like(d.recv_x), wts, d)  # the dispatch is still pending
    assert torch.equal(y, torch.zeros_like(x))


def test_lifetimes_refuse_instead_of_crashing():
    """A group or comm with an open layer refuses to close (RuntimeError, nothing destroyed, the
    layer still works); a closed layer and a layer on a closed comm raise RuntimeError instead
    of touching freed memory; close() is idempotent."""
    comms = virtual_comms(1, "cpu")
    group = comms[0].group
    layer = MoELayer(comms[0], E, K, H, I, 4, dtype=torch.bfloat16)
    p = ref.make_problem(1, E, K, H, I, 3, dtype=torch.bfloat16, seed=2)
    layer.set_weights(*p.local_weights(0))
    with pytest.raises(RuntimeError, match="open layer"):
        group.close()
    y = layer(p.x[0], p.topk_ids[0], p.topk_weights[0])  # still alive and usable
    ref.assert_close(y, p.reference(0), torch.bfloat16)
    layer.close()
    layer.close()
    with pytest.raises(RuntimeError, match="layer is closed"):
        layer(p.x[0], p.topk_ids[0], p.topk_weights[0])
    with pytest.raises(ValueError, match="no open MoELayer"):
        layer.dispatch(p.x[0], p.topk_ids[0])
    group.close()
    group.close()
    with pytest.raises(RuntimeError, match="comm is closed"):
        MoELayer(comms[0], E, K, H, I, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="comm is closed"):
        comms[0].abort()
