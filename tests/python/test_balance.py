"""Balanced EP from Python (docs/API.md section 13): an expert map with replicas and per-step spare
slots give y bit-identical to the plain layer; the stats show the busiest rank lighter; bad maps
raise MoeflowError before anything changes."""
import pytest
import torch

from conftest import device_of, drain, run_layer_ranks, to_host
from moeflow import reference as ref
from moeflow._lib import MoeflowError
from moeflow.torch import MoELayer, virtual_comms

R, E, K, H, I = 2, 8, 3, 256, 128
# P = 12 slots, 6 per rank: experts 0, 1, 2 and 5 have two replicas.
MAP = [0, 1, 2, 3, 0, 5, 4, 5, 6, 7, 1, 2]


def skewed(p):
    """Routes most tokens to experts 0..3 (rank 0's home experts) so that rank 0 is the busiest."""
    g = torch.Generator().manual_seed(5)
    for r in range(R):
        T = p.topk_ids[r].shape[0]
        p.topk_ids[r] = torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(T)]).int()
    return p


def run(p, comms, dtype, expert_map=None, spare_slots=0, calls=1):
    """Every rank's [y of each call] and its layer's balance stats after the last call."""
    dev = device_of(comms[0].backend)
    P = len(expert_map) if expert_map else 0

    def weights(r):
        if not expert_map:
            return [w if w is None else w.to(dev) for w in p.local_weights(r)]
        slots = torch.tensor(expert_map[r * P // R:(r + 1) * P // R])
        ws = (p.w13, p.w2, p.w13_scale, p.w2_scale)
        return [w if w is None else w[slots].contiguous().to(dev) for w in ws]

    def rank(r, comm, ready):
        x, ids, wts = (t.to(dev) for t in (p.x[r], p.topk_ids[r], p.topk_weights[r]))
        layer = MoELayer(comm, E, K, H, I, 32, dtype=dtype, num_physical_experts=P,
                         spare_slots=spare_slots)
        try:
            if expert_map:
                layer.set_expert_map(expert_map)
            layer.set_weights(*weights(r))
            torch.empty_like(x)
            ready()
            ys = []
            for _ in range(calls):
                ys.append(to_host(layer(x, ids, wts)))
                if spare_slots:
                    layer.prefetch()
            return ys, layer.balance_stats()
        finally:
            layer.close()

    return run_layer_ranks(comms, rank)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_replicas_and_spare_slots_are_bit_identical(backend, dtype):
    p = skewed(ref.make_problem(R, E, K, H, I, [24, 17], dtype=dtype, seed=11))
    comms = virtual_comms(R, backend)
    try:
        plain = run(p, comms, dtype)
        mapped = run(p, comms, dtype, expert_map=MAP)
        spare = run(p, comms, dtype, spare_slots=2, calls=3)
    finally:
        comms[0].group.close()
    for r in range(R):
        (y_plain,), _ = plain[r]
        (y_map,), _ = mapped[r]
        assert torch.equal(y_plain, y_map), f"rank {r}: the map changed y"
        for c, y in enumerate(spare[r][0]):
            assert torch.equal(y_plain, y), f"rank {r} call {c}: spare slots changed y"
        ref.assert_close(y_plain, p.reference(r), dtype, oracle=backend == "cpu")
    stats = spare[0][1]
    assert max(stats["home_rows"]) > max(stats["recv_rows"]), stats
    assert stats["spare_resident"] > 0 and stats["prefetch_bytes_all"] == 0, stats  # copied once


def test_bad_maps_raise(backend):
    comms = virtual_comms(1, backend)
    try:
        layer = MoELayer(comms[0], 4, 2, H, I, 8, dtype=torch.bfloat16, num_physical_experts=6)
        try:
            for bad, what in [([0, 1, 2, 3, 0], "wrong length"), ([0, 1, 2, 2, 1, 0], "no slot"),
                              ([0, 1, 2, 3, 4, 0], "out of range")]:
                with pytest.raises(MoeflowError) as e:
                    layer.set_expert_map(bad)
                assert e.value.name == "MF_ERR_INVALID_ARGUMENT", what
            layer.set_expert_map([0, 1, 2, 3, 3, 0])
        finally:
            layer.close()
    finally:
        comms[0].group.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_staged_map_moves_weights_without_a_stall(backend, dtype):
    """A staged map (one expert per rank per step): every call's y equals the plain layer's, while
    staging and after the switch; the moved weights equal the new map's experts bit for bit."""
    p = skewed(ref.make_problem(R, E, K, H, I, [24, 17], dtype=dtype, seed=13))
    new_map = [5, 4, 7, 6, 1, 0, 3, 2, 1, 5, 0, 2]
    P, calls = len(MAP), 8
    comms = virtual_comms(R, backend)
    try:
        plain = run(p, comms, dtype)
        dev = device_of(comms[0].backend)

        def slots(m, r):
            idx = torch.tensor(m[r * P // R:(r + 1) * P // R])
            return [w if w is None else w[idx].contiguous().to(dev) for w in (p.w13, p.w2, p.w13_scale, p.w2_scale)]

        def rank(r, comm, ready):
            x, ids, wts = (t.to(dev) for t in (p.x[r], p.topk_ids[r], p.topk_weights[r]))
            layer = MoELayer(comm, E, K, H, I, 32, dtype=dtype, num_physical_experts=P, spare_slots=1)
            try:
                layer.set_expert_map(MAP)
                layer.set_weights(*slots(MAP, r))
                nxt = [w if w is None else torch.zeros_like(w) for w in slots(new_map, r)]
                ready()
                ys, left = [], []
                for c in range(calls):
                    if c == 1:
                        layer.stage_expert_map(new_map, *nxt, experts_per_step=1)
                    if c > 0:
                        layer.prefetch()
                    left.append(layer.balance_stats()["stage_steps_left"])
                    ys.append(to_host(layer(x, ids, wts)))
                drain(dev)
                return ys, left, [w if w is None else w.cpu() for w in nxt], layer.balance_stats()
            finally:
                layer.close()

        staged = run_layer_ranks(comms, rank)
    finally:
        comms[0].group.close()
    for r in range(R):
        (y_plain,), _ = plain[r]
        ys, left, nxt, stats = staged[r]
        assert any(left) and left[-1] == 0 and stats["map_switches"] == 1, (left, stats)
        for c, y in enumerate(ys):
            assert torch.equal(y_plain, y), f"rank {r} call {c} (steps left {left[c]}): y changed"
        idx = torch.tensor(new_map[r * P // R:(r + 1) * P // R])
        for got, w in zip(nxt, (p.w13, p.w2, p.w13_scale, p.w2_scale)):
            if w is not None:
                assert torch.equal(got.view(torch.uint8), w[idx].contiguous().view(torch.uint8)), f"rank {r}"
