"""moeflow.vllm's classes on CUDA tensors (skipped without a GPU): vLLM's FusedMoEKernel data path
over moeflow's prepare/finalize and experts, both modes, BF16 and FP8, R = 1 and 2 virtual ranks on
one GPU, against the fp64 reference, and CUDA-graph capture of kernel.apply replayed on new
routing. vLLM itself where it is installed; elsewhere (the H200 machine, which cannot install it)
tests/python/vllm_double.py, a test double of the vLLM calls moeflow.vllm needs, which CI checks
against the real vLLM (test_vllm.py::test_double_matches_vllm)."""
import pytest
import torch

from conftest import requires_cuda, run_layer_ranks, to_host
import vllm_double

pytestmark = requires_cuda
vllm = vllm_double.install()
DOUBLE = vllm.__version__.endswith("(moeflow test double)")

from moeflow import reference as ref  # noqa: E402
from moeflow import vllm as mv  # noqa: E402
from moeflow import weights as W  # noqa: E402
from moeflow.torch import virtual_comms  # noqa: E402
from vllm.model_executor.layers.fused_moe import config as vcfg  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
E, K, H, I = 8, 3, 256, 128
PREFIX = "model.layers.0.mlp"


def moe_config(R, r, S):
    if DOUBLE:
        return vcfg.FusedMoEConfig(E, K, H, I, S, vcfg.FusedMoEParallelConfig(1, R, r))
    from test_vllm import moe_config as real  # vLLM installed on a GPU machine
    return real(E, R, r, S)


def quant_config(dtype, w):
    if dtype == BF16:
        return vcfg.FusedMoEQuantConfig.make()
    return vcfg.fp8_w8a8_moe_quant_config(w["w13_scale"], w["w2_scale"], block_shape=[128, 128])


def expert_map(R, r):
    return None if R == 1 else mv.placement_expert_map("linear", E, R, r).cuda()


def run(R, fn):
    comms = virtual_comms(R, "cuda")
    try:
        return run_layer_ranks(comms, fn)
    finally:
        comms[0].group.close()


@pytest.mark.parametrize("mode", ["layer", "dispatch"])
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("R,tokens", [(1, [9]), (2, [7, 0])])
def test_kernel_on_cuda_matches_reference(mode, dtype, R, tokens):
    sd = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=PREFIX, seed=5)
    p = ref.make_problem(R, E, K, H, I, tokens, dtype=dtype, seed=6, drop=0.1)
    full = W.load_experts(sd, PREFIX, range(E))
    S = max(tokens)
    dev = torch.device("cuda", torch.cuda.current_device())

    def rank(r, comm, ready):
        w = W.load_experts(sd, PREFIX, W.local_expert_ids(r, R, E), device=dev)
        kernel = mv.make_kernel(moe_config(R, r, S), quant_config(dtype, w), comm, mode=mode)
        x, ids, wts = (t.to(dev) for t in (p.x[r], p.topk_ids[r].long(), p.topk_weights[r]))
        # the experts' workspace is allocated between dispatch and combine: cache the allocator's
        # blocks first (virtual ranks share the GPU with a peer's waiting kernel)
        warm = [torch.empty(n, dtype=torch.uint8, device=dev) for n in (1 << 20, 64 << 20)]
        del warm
        ready()
        try:
            return [to_host(kernel.apply(x, w["w13"], w["w2"], wts, ids, MoEActivation.SILU, E,
                                         expert_map(R, r), False)) for _ in range(2)]
        finally:
            torch.cuda.synchronize()
            kernel.moeflow_layer.close()

    ys = run(R, rank)
    for r in range(R):
        want = ref.reference_moe(p.x[r], p.topk_ids[r], p.topk_weights[r], full["w13"],
                                 full["w13_scale"], full["w2"], full["w2_scale"])
        ref.assert_close(ys[r][0], want, dtype, oracle=False)
        assert torch.equal(ys[r][0], ys[r][1])


@pytest.mark.parametrize("mode", ["layer", "dispatch"])
def test_kernel_apply_under_cuda_graph_capture(mode):
    """kernel.apply captured once (after an eager call on a side stream, as torch wants), then
    replayed with new x and routing copied into the static inputs: the replay equals an eager
    call bit for bit and meets the reference."""
    dev = torch.device("cuda", torch.cuda.current_device())
    S = 16
    sd = W.make_state_dict(E, H, I, dtype=FP8, layer_prefix=PREFIX, seed=7)
    full = W.load_experts(sd, PREFIX, range(E))
    w = W.load_experts(sd, PREFIX, range(E), device=dev)
    problems = [ref.make_problem(1, E, K, H, I, [S], dtype=FP8, seed=s, drop=0.1) for s in range(8, 11)]
    comms = virtual_comms(1, "cuda")
    kernel = mv.make_kernel(moe_config(1, 0, S), quant_config(FP8, w), comms[0], mode=mode)
    try:
        def inputs(p):
            return [t.to(dev) for t in (p.x[0], p.topk_ids[0].long(), p.topk_weights[0])]

        def step(x, ids, wts):
            return kernel.apply(x, w["w13"], w["w2"], wts, ids, MoEActivation.SILU, E, None, False)

        static = inputs(problems[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step(*static)
        for p in problems[1:]:
            for dst, src in zip(static, inputs(p)):
                dst.copy_(src)
            graph.replay()
            eager = step(*(t.clone() for t in static))
            torch.cuda.synchronize()
            assert torch.equal(y, eager), "replay != eager"
            want = ref.reference_moe(p.x[0], p.topk_ids[0], p.topk_weights[0], full["w13"],
                                     full["w13_scale"], full["w2"], full["w2_scale"])
            ref.assert_close(y, want, FP8, oracle=False)
    finally:
        torch.cuda.synchronize()
        kernel.moeflow_layer.close()
        comms[0].group.close()
