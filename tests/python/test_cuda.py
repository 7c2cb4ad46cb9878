"""CUDA only (skipped elsewhere): CUDA-graph capture and replay with changing routing, and
torch.compile (inductor, and reduce-overhead's CUDA graphs) of the custom ops, on one rank.
The tests of test_torch.py and test_distributed.py also run on CUDA where it is present."""
import pytest
import torch

from conftest import requires_cuda
from moeflow import reference as ref
from moeflow.torch import MoELayer, virtual_comms

pytestmark = requires_cuda
E, K, H, I, T = 8, 3, 256, 128, 24
FP8 = torch.float8_e4m3fn


@pytest.fixture
def setup(request):
    """(layer, weights problem, three problems of new x and routing on the same weights)."""
    layout = getattr(request, "param", "masked")
    dev = torch.device("cuda", torch.cuda.current_device())
    problems = [ref.make_problem(1, E, K, H, I, T, dtype=FP8, seed=s, drop=0.1) for s in range(4)]
    comms = virtual_comms(1, "cuda")
    layer = MoELayer(comms[0], E, K, H, I, T, dtype=FP8, layout=layout)
    layer.set_weights(*[w.to(dev) for w in problems[0].local_weights(0)])
    yield layer, problems[0], problems[1:]
    torch.cuda.synchronize()
    layer.close()
    comms[0].group.close()


def inputs(p, dev):
    return [t.to(dev) for t in (p.x[0], p.topk_ids[0], p.topk_weights[0])]


def expected(w, p):
    return ref.reference_moe(p.x[0], p.topk_ids[0], p.topk_weights[0], w.w13, w.w13_scale, w.w2,
                             w.w2_scale)


def eager_warmup(fn, *args):
    """Runs fn once on a side stream, as torch.cuda.graph capture wants."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*args)
    torch.cuda.current_stream().wait_stream(s)


@pytest.mark.parametrize("setup", ["masked", "expert_major"], indirect=True)
def test_graph_replay_with_changing_routing(setup):
    layer, w, problems = setup
    static = inputs(w, layer.device)
    eager_warmup(layer, *static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(*static)
    for p in problems:
        for dst, src in zip(static, inputs(p, layer.device)):
            dst.copy_(src)
        graph.replay()
        eager = layer(*(t.clone() for t in static))
        torch.cuda.synchronize()
        assert torch.equal(y, eager), "replay != eager forward"
        ref.assert_close(y, expected(w, p), FP8, oracle=False)


def test_graph_replay_of_dispatch_and_combine(setup):
    layer, w, problems = setup

    def step(x, ids, wts):
        d = layer.dispatch(x, ids)
        scales = d.recv_scales.unsqueeze(-1).expand(*d.recv_scales.shape, ref.BLOCK)
        x_deq = d.recv_x.float() * scales.flatten(-2)  # no host sync: capturable
        return layer.combine((2 * x_deq).to(torch.bfloat16), wts, d)

    static = inputs(w, layer.device)
    eager_warmup(step, *static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step(*static)
    for p in problems:
        for dst, src in zip(static, inputs(p, layer.device)):
            dst.copy_(src)
        graph.replay()
        eager = step(*(t.clone() for t in static))
        torch.cuda.synchronize()
        assert torch.equal(y, eager)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile(setup, mode):
    layer, w, problems = setup

    def model(x, ids, wts):
        return layer(x * 1.0, ids, wts) + 0.0  # ops for inductor around the custom op

    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for p in problems:
        args = inputs(p, layer.device)
        y = compiled(*args).clone()
        eager = layer(*args)
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
        ref.assert_close(y, expected(w, p), FP8, oracle=False)
