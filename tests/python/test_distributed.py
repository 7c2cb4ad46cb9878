"""Ranks from a real torch.distributed process group: 2 and 4 processes (torch.multiprocessing,
gloo), each making its comm with comm_from_process_group(transport="ipc") and running the layer
in both dtypes; y must match the fp64 reference and, bit for bit, the same problem on virtual
ranks of this process."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeflow import reference as ref
from moeflow.torch import MoELayer, comm_from_process_group, virtual_comms

E, K, H, I = 8, 3, 256, 128
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def problems(num_ranks):
    tokens = [5 + 7 * r for r in range(num_ranks)]
    tokens[-1] = 0  # an idle rank
    return {name: ref.make_problem(num_ranks, E, K, H, I, tokens, dtype=dtype, seed=num_ranks,
                                   drop=0.1) for name, dtype in DTYPES.items()}


def rank_main(rank, num_ranks, backend, init_file, out_dir):
    """One process: rank `rank` of a gloo group; writes y of each dtype to out_dir."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=num_ranks)
    dev = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    out = {}
    for name, p in problems(num_ranks).items():
        comm = comm_from_process_group(backend=backend, transport="ipc",
                                       device=0 if backend == "cuda" else None)
        assert (comm.rank, comm.size, comm.transport) == (rank, num_ranks, "ipc")
        layer = MoELayer(comm, E, K, H, I, max(p.x[r].shape[0] for r in range(num_ranks)),
                         dtype=DTYPES[name])
        layer.set_weights(*[w if w is None else w.to(dev) for w in p.local_weights(rank)])
        out[name] = layer(p.x[rank].to(dev), p.topk_ids[rank].to(dev),
                          p.topk_weights[rank].to(dev)).cpu()
        layer.close()
        comm.close()
    torch.save(out, os.path.join(out_dir, f"y{rank}.pt"))
    dist.destroy_process_group()
    os._exit(0)  # skips torch's exit-time destructors, which can abort (examples/distributed.py)


def virtual_ys(p, num_ranks, dtype, backend):
    from test_torch import run_forward
    comms = virtual_comms(num_ranks, backend)
    try:
        return run_forward(p, comms, dtype)
    finally:
        comms[0].group.close()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_process_group_ranks(backend, num_ranks, tmp_path):
    mp.spawn(rank_main, args=(num_ranks, backend, str(tmp_path / "init"), str(tmp_path)),
             nprocs=num_ranks, join=True)
    for name, p in problems(num_ranks).items():
        virtual = virtual_ys(p, num_ranks, DTYPES[name], backend)
        for r in range(num_ranks):
            y = torch.load(tmp_path / f"y{r}.pt")[name]
            ref.assert_close(y, p.reference(r), DTYPES[name], oracle=backend == "cpu")
            assert torch.equal(y, virtual[r]), f"{name} rank {r}: process group != virtual ranks"

