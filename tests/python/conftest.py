"""pytest configuration of the Python binding's tests (tests/python).

Run from a checkout with `make test` (the checkout's python/ and build/libmoeflow.so), or after
`pip install ./python` with `python3 -m pytest tests/python`. Tests parametrised by `backend` run
on the CPU everywhere and on CUDA where torch and the library both see a GPU.
"""
import os
import threading
import warnings

# Virtual ranks on one GPU need both before the process first uses CUDA (docs/API.md section 10).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# torch warns at import when numpy is absent; nothing here uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import pytest  # noqa: E402
import torch  # noqa: E402

import moeflow  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and moeflow.backend_available("cuda")
BACKENDS = ["cpu"] + (["cuda"] if HAS_CUDA else [])
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def device_of(backend):
    return torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else "cpu"


def drain(device):
    """Virtual ranks on one GPU: waits for this rank's current stream, before the host reads a
    tensor (t.cpu(), .item(), .tolist()). A copy into pageable memory can hold the driver's staging
    buffer until its stream reaches it; a peer rank's thread then blocks in a copy of its own before
    it launches what this stream waits for, and the group stalls until the timeout (docs/API.md
    section 10). A stream synchronisation holds nothing."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_host(t):
    """t.cpu() after drain(t.device)."""
    drain(t.device)
    return t.cpu()


def run_layer_ranks(comms, fn):
    """[fn(rank, comm, ready) on one thread per virtual rank]. fn calls ready() after its setup
    (layer, weights, inputs, warm-up allocations) and before its first data-path collective: a
    barrier of the ranks. CUDA: each rank runs on a stream of its own, warmed by finished work
    (docs/API.md section 10)."""
    barrier = threading.Barrier(len(comms))
    cuda = comms[0].backend == "cuda"

    def main(r):
        if not cuda:
            return fn(r, comms[r], barrier.wait)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.zeros(1, device="cuda").add_(1)

            def ready():
                stream.synchronize()
                barrier.wait()

            out = fn(r, comms[r], ready)
            stream.synchronize()
            return out

    return moeflow.run_ranks(main, len(comms))


def run_virtual(num_ranks, backend, fn):
    """run_layer_ranks(comms, fn) on a new group of `num_ranks` virtual ranks, closed after."""
    from moeflow.torch import virtual_comms

    comms = virtual_comms(num_ranks, backend)
    try:
        return run_layer_ranks(comms, fn)
    finally:
        comms[0].group.close()
