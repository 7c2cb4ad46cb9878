"""Overlap in Python (docs/API.md section 16): the split halves as custom ops, DeepEP-style receive
hooks on MoELayer.dispatch / combine, two micro-batches of one layer in flight, the vLLM classes'
prepare_async / finalize_async through vLLM's own modular kernel, against the one-call forms bit
for bit. Virtual ranks (threads); CPU everywhere, CUDA where present."""
import pytest
import torch

from conftest import device_of, drain, run_virtual
from moeflow import MoeflowError
from moeflow import reference as ref
from moeflow.torch import MoELayer, virtual_comms

E, K, H, I = 8, 3, 256, 128


def _expert_rows(d):
    """A stand-in for the experts: every received row scaled by 1/2 (bf16, recv_x's layout)."""
    if d.recv_x.dtype == torch.float8_e4m3fn:
        return (d.recv_x.float() * 0.5).to(torch.bfloat16)
    return (d.recv_x.float() * 0.5).to(torch.bfloat16)


def _inputs(p, r, dev):
    return p.x[r].to(dev), p.topk_ids[r].to(dev), p.topk_weights[r].to(dev)


@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, "expert_major"),
                                          (torch.float8_e4m3fn, "masked")], ids=["bf16", "fp8"])
def test_two_micro_batches_with_hooks_match_one_call(backend, dtype, layout):
    R = 2
    pa = ref.make_problem(R, E, K, H, I, [9, 4], dtype=dtype, seed=1, drop=0.1)
    pb = ref.make_problem(R, E, K, H, I, [5, 0], dtype=dtype, seed=2, drop=0.1)
    dev = device_of(backend)

    def rank(r, comm, ready):
        layer = MoELayer(comm, E, K, H, I, 9, dtype=dtype, layout=layout, max_in_flight=2)
        try:
            a, b = _inputs(pa, r, dev), _inputs(pb, r, dev)
            ready()
            want = []
            for x, ids, w in (a, b):  # the reference: one call at a time
                d = layer.dispatch(x, ids)
                want.append((d, layer.combine(_expert_rows(d), w, d)))
            # the overlapped schedule: send A, send B, receive A, combine-send A, receive B, ...
            da, hook_a = layer.dispatch(a[0], a[1], return_recv_hook=True)
            db, hook_b = layer.dispatch(b[0], b[1], return_recv_hook=True)
            hook_a()
            ya, chook_a = layer.combine(_expert_rows(da), a[2], da, return_recv_hook=True)
            hook_b()
            yb, chook_b = layer.combine(_expert_rows(db), b[2], db, return_recv_hook=True)
            chook_a()
            chook_b()
            with pytest.raises(RuntimeError, match="already called"):
                chook_b()
            got = [(da, ya), (db, yb)]
            drain(dev)
            out = []
            for (dw, yw), (dg, yg) in zip(want, got):
                counts = dw.expert_counts.cpu()
                out.append((torch.equal(counts, dg.expert_counts.cpu()), torch.equal(yw.cpu(), yg.cpu()),
                            torch.equal(dw.recv_src[:int(dw.expert_offsets[-1])].cpu(),
                                        dg.recv_src[:int(dg.expert_offsets[-1])].cpu())
                            if layout == "expert_major"
                            else all(torch.equal(dw.recv_src[e, :c].cpu(), dg.recv_src[e, :c].cpu())
                                     for e, c in enumerate(counts.tolist()))))
            return out
        finally:
            layer.close()

    results = run_virtual(R, backend, rank)
    for r, per_mb in enumerate(results):
        for mb, (counts, y, src) in enumerate(per_mb):
            assert counts and src, f"rank {r} micro-batch {mb}: dispatch differs from the one-call form"
            assert y, f"rank {r} micro-batch {mb}: y differs from the one-call form"


def test_more_in_flight_than_the_heap_holds_is_refused():
    R = 2
    p = ref.make_problem(R, E, K, H, I, 4, dtype=torch.bfloat16, seed=3)

    def rank(r, comm, ready):
        layer = MoELayer(comm, E, K, H, I, 4, dtype=torch.bfloat16, layout="masked")  # max_in_flight 1
        try:
            x, ids, w = _inputs(p, r, "cpu")
            ready()
            d, hook = layer.dispatch(x, ids, return_recv_hook=True)
            with pytest.raises(MoeflowError, match="no free heap slot"):
                layer.dispatch(x, ids, return_recv_hook=True)
            hook()
            y, chook = layer.combine(_expert_rows(d), w, d, return_recv_hook=True)
            chook()
            with pytest.raises(ValueError, match="events are CUDA"):
                layer.dispatch(x, ids, previous_event=object())
            # the exchange is idle again: a new one runs
            d2, hook2 = layer.dispatch(x, ids, return_recv_hook=True)
            hook2()
            y2 = layer.combine(_expert_rows(d2), w, d2)
            return torch.equal(y, y2)
        finally:
            layer.close()

    assert all(run_virtual(R, "cpu", rank))


def test_split_ops_are_registered():
    for name in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
        assert hasattr(torch.ops.moeflow, name), name


def test_comm_num_sms():
    comms = virtual_comms(1, "cpu")
    try:
        c = comms[0]
        default = c.num_sms
        c.set_num_sms(5)
        assert c.num_sms == 5
        with pytest.raises(MoeflowError):
            c.set_num_sms(-1)
        c.set_num_sms(0)
        assert c.num_sms == default
    finally:
        comms[0].group.close()
