"""moeflow.sglang against SGLang 0.5.23's own token-dispatcher classes (BaseDispatcher,
DeepEPLLDispatchOutput / DeepEPLLCombineInput, StandardTopKOutput): dispatch / combine and the
a / b halves, two dispatchers on one layer in SGLang's two-batch-overlap order, bit for bit equal
to the one-call forms, SGLang's dispatcher hooks, the stage order and the MASKED-only refusal.
SGLang's full dependency set pins a CUDA torch, so the wheel is unpacked without its dependencies:
`pip install --no-deps --target DIR sglang==0.5.23 ipython traitlets gguf` (~20 s, 231 MB), and
MOEFLOW_SGLANG_PATH=DIR puts DIR on sys.path here (CI does this and sets MOEFLOW_REQUIRE_SGLANG=1,
which turns the skip where SGLang is not importable into a failure)."""
import os
import sys

import pytest
import torch

if os.environ.get("MOEFLOW_SGLANG_PATH"):
    sys.path.append(os.environ["MOEFLOW_SGLANG_PATH"])  # after the venv's packages: nothing shadowed
if os.environ.get("MOEFLOW_REQUIRE_SGLANG") == "1":
    import sglang.srt.layers.moe.token_dispatcher  # noqa: F401  (CI: the tests must run)
else:
    pytest.importorskip("sglang.srt.layers.moe.token_dispatcher")
from sglang.srt.layers.moe.token_dispatcher import DeepEPLLCombineInput  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher, DispatchOutputFormat  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402

from conftest import device_of, drain, run_virtual  # noqa: E402
from moeflow import reference as ref  # noqa: E402
from moeflow.sglang import MoeflowDispatcher  # noqa: E402
from moeflow.torch import MoELayer, virtual_comms  # noqa: E402

E, K, H, I = 8, 3, 256, 128


def _experts(out):  # a stand-in for the experts on DeepEP's low-latency layout: bf16 [L, C, H]
    return (out.hidden_states.float() * 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_two_batch_overlap_matches_one_call(backend, dtype):
    R = 2
    pa = ref.make_problem(R, E, K, H, I, [7, 3], dtype=dtype, seed=11, drop=0.1)
    pb = ref.make_problem(R, E, K, H, I, [2, 7], dtype=dtype, seed=12, drop=0.1)
    dev = device_of(backend)

    def rank(r, comm, ready):
        layer = MoELayer(comm, E, K, H, I, 7, dtype=dtype, layout="masked", max_in_flight=2)
        try:
            d0, d1 = MoeflowDispatcher(layer), MoeflowDispatcher(layer)
            assert isinstance(d0, BaseDispatcher)
            seen = []
            d0.register_post_dispatch_hook(lambda disp, out: seen.append(out.format))
            mbs = []
            for p in (pa, pb):
                x, ids, w = p.x[r].to(dev), p.topk_ids[r].to(dev), p.topk_weights[r].to(dev)
                mbs.append((x, StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=None)))
            ready()
            want = []
            for x, topk in mbs:  # one call at a time, through moeflow's own forms
                d = layer.dispatch(x, topk.topk_ids)
                e = (d.recv_x.float() * 0.5).to(torch.bfloat16)
                want.append((d.expert_counts.clone(), layer.combine(e, topk.topk_weights, d)))
            # SGLang's two-batch overlap: both sends, then each receive, combine sends, receives
            d0.dispatch_a(*mbs[0])
            d1.dispatch_a(*mbs[1])
            o0 = d0.dispatch_b()
            d0.combine_a(DeepEPLLCombineInput(_experts(o0), o0.topk_ids, o0.topk_weights))
            o1 = d1.dispatch_b()
            d1.combine_a(DeepEPLLCombineInput(_experts(o1), o1.topk_ids, o1.topk_weights))
            y0, y1 = d0.combine_b(), d1.combine_b()
            # and the one-call dispatcher forms, which SGLang's runners use without TBO
            o2 = d0.dispatch(*mbs[0])
            y2 = d0.combine(DeepEPLLCombineInput(_experts(o2), o2.topk_ids, o2.topk_weights))
            with pytest.raises(RuntimeError, match="stage"):
                d0.dispatch_b()
            drain(dev)
            checks = [isinstance(o0, DeepEPLLDispatchOutput), o0.format == DispatchOutputFormat.DEEPEP_LL,
                      seen == [DispatchOutputFormat.DEEPEP_LL],  # SGLang hooks wrap dispatch(), not the halves
                      (o0.hidden_states_scale is not None) == (dtype == torch.float8_e4m3fn),
                      torch.equal(o0.masked_m.cpu(), want[0][0].cpu()),
                      torch.equal(o1.masked_m.cpu(), want[1][0].cpu()),
                      torch.equal(y0.cpu(), want[0][1].cpu()), torch.equal(y1.cpu(), want[1][1].cpu()),
                      torch.equal(y2.cpu(), want[0][1].cpu()), o0.expected_m >= 1]
            return checks
        finally:
            layer.close()

    results = run_virtual(R, backend, rank)
    for r, checks in enumerate(results):
        assert all(checks), f"rank {r}: {checks}"


def test_expert_major_is_refused():
    comms = virtual_comms(1, "cpu")
    try:
        layer = MoELayer(comms[0], E, K, H, I, 4, dtype=torch.bfloat16, layout="expert_major")
        try:
            with pytest.raises(ValueError, match="layout='masked'"):
                MoeflowDispatcher(layer)
        finally:
            layer.close()
    finally:
        comms[0].group.close()
