"""moeflow.weights: Hugging Face-style checkpoints (per-expert and fused, FP8 with
weight_scale_inv and BF16) into moeflow's [L, 2I, H] / [L, H, I] layout, bit for bit; the errors;
safetensors; and a loaded checkpoint through the layer against the fp64 reference."""
import json

import pytest
import torch

from conftest import device_of, run_layer_ranks, to_host
from moeflow import reference as ref
from moeflow import weights as W
from moeflow.torch import MoELayer, virtual_comms

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
E, H, I = 4, 256, 128
P = "model.layers.7.mlp"


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def fused_from_per_expert(sd, prefix=P, n=E):
    ep = prefix + ".experts."
    out = {}
    w13 = torch.stack([torch.cat([sd[f"{ep}{e}.gate_proj.weight"], sd[f"{ep}{e}.up_proj.weight"]])
                       for e in range(n)])
    w2 = torch.stack([sd[f"{ep}{e}.down_proj.weight"] for e in range(n)])
    out[ep + "w13_weight"], out[ep + "w2_weight"] = w13, w2
    if w13.dtype == FP8:
        out[ep + "w13_weight_scale_inv"] = torch.stack(
            [torch.cat([sd[f"{ep}{e}.gate_proj.weight_scale_inv"], sd[f"{ep}{e}.up_proj.weight_scale_inv"]])
             for e in range(n)])
        out[ep + "w2_weight_scale_inv"] = torch.stack(
            [sd[f"{ep}{e}.down_proj.weight_scale_inv"] for e in range(n)])
    return out


def test_local_expert_ids():
    assert list(W.local_expert_ids(1, 2, 8)) == [4, 5, 6, 7]
    assert list(W.local_expert_ids(0, 1, 3)) == [0, 1, 2]
    # uneven: the first E % R ranks one more (Qwen3's 128 experts on 6 ranks: 22, 22, 21, ...)
    assert [len(W.local_expert_ids(r, 6, 128)) for r in range(6)] == [22, 22, 21, 21, 21, 21]
    assert [list(W.local_expert_ids(r, 3, 8)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [list(W.local_expert_ids(r, 3, 8, "round_robin")) for r in range(3)] == [
        [0, 3, 6], [1, 4, 7], [2, 5]]
    with pytest.raises(W.WeightsError, match="one at least"):
        W.local_expert_ids(0, 3, 2)
    with pytest.raises(W.WeightsError, match="placement"):
        W.local_expert_ids(0, 2, 8, "random")
    with pytest.raises(W.WeightsError, match="outside"):
        W.local_expert_ids(2, 2, 8)


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_per_expert_layout_bit_for_bit(dtype):
    sd = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=P, seed=3)
    ep = P + ".experts."
    w = W.load_experts(sd, P, W.local_expert_ids(1, 2, E))
    assert w["w13"].shape == (2, 2 * I, H) and w["w2"].shape == (2, H, I)
    for l, e in enumerate((2, 3)):
        assert same(w["w13"][l, :I], sd[f"{ep}{e}.gate_proj.weight"])      # gate rows first
        assert same(w["w13"][l, I:], sd[f"{ep}{e}.up_proj.weight"])        # then up rows
        assert same(w["w2"][l], sd[f"{ep}{e}.down_proj.weight"])
        if dtype == FP8:
            # weight_scale_inv is moeflow's dequantising scale: copied unchanged
            assert w["w13_scale"].dtype == torch.float32 and w["w13_scale"].shape == (2, 2, 2)
            assert torch.equal(w["w13_scale"][l, :1], sd[f"{ep}{e}.gate_proj.weight_scale_inv"])
            assert torch.equal(w["w13_scale"][l, 1:], sd[f"{ep}{e}.up_proj.weight_scale_inv"])
            assert torch.equal(w["w2_scale"][l], sd[f"{ep}{e}.down_proj.weight_scale_inv"])
    if dtype == BF16:
        assert w["w13_scale"] is None and w["w2_scale"] is None
    assert all(t is None or t.is_contiguous() for t in w.values())
    assert W.num_experts_in(sd, P) == E


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_fused_layout_equals_per_expert(dtype):
    sd = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=P, seed=4)
    fused = fused_from_per_expert(sd)
    ids = [3, 1]  # any order: local order is the caller's
    a, b = W.load_experts(sd, P, ids), W.load_experts(fused, P, ids)
    for k in a:
        assert (a[k] is None and b[k] is None) or same(a[k], b[k]), k
    assert W.num_experts_in(fused, P) == E
    # make_state_dict's own fused layout reads too
    f2 = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=P, layout="fused", seed=4)
    w = W.load_experts(f2, P + ".", range(E))
    assert same(w["w13"], f2[P + ".experts.w13_weight"])


def test_mixtral_names_and_float_dtypes():
    sd = W.make_state_dict(E, H, I, dtype=BF16, layer_prefix="m.block_sparse_moe", seed=5,
                           names=("w1", "w3", "w2"))
    sd32 = {k: v.float() for k, v in sd.items()}  # an fp32 checkpoint becomes BF16
    a = W.load_experts(sd, "m.block_sparse_moe", [0, 1])
    b = W.load_experts(sd32, "m.block_sparse_moe", [0, 1])
    assert same(a["w13"], b["w13"]) and a["w13"].dtype == BF16
    assert same(a["w13"][1, I:], sd["m.block_sparse_moe.experts.1.w3.weight"])


def test_dtype_conversions():
    sd8 = W.make_state_dict(E, H, I, dtype=FP8, layer_prefix=P, seed=6)
    w8 = W.load_experts(sd8, P, range(E))
    wb = W.load_experts(sd8, P, range(E), dtype=BF16)      # dequantised: q * scale_inv
    assert wb["w13_scale"] is None
    want = ref.dequantize_fp8(w8["w13"], w8["w13_scale"], 128).to(torch.float32).to(BF16)
    assert same(wb["w13"], want)
    sdb = W.make_state_dict(E, H, I, dtype=BF16, layer_prefix=P, seed=6)
    wq = W.load_experts(sdb, P, range(E), dtype=FP8)       # quantised as mf_quantize_fp8
    q, s = ref.quantize_fp8(W.load_experts(sdb, P, range(E))["w2"], 128)
    assert same(wq["w2"], q) and torch.equal(wq["w2_scale"], s)


def test_errors_name_the_problem():
    sd = W.make_state_dict(E, H, I, dtype=FP8, layer_prefix=P, seed=7)
    ep = P + ".experts."
    with pytest.raises(W.WeightsError, match="no expert weights under 'other.experts.'"):
        W.load_experts(sd, "other", [0])
    with pytest.raises(W.WeightsError, match=r"experts\.9\.gate_proj\.weight' is not in"):
        W.load_experts(sd, P, [0, 9])
    bad = dict(sd)
    bad[ep + "1.up_proj.weight"] = bad[ep + "1.up_proj.weight"][:, :128]
    with pytest.raises(W.WeightsError, match=r"up_proj\.weight' has shape \[128, 128\], expected \[128, 256\]"):
        W.load_experts(bad, P, [1])
    bad = dict(sd)
    del bad[ep + "0.down_proj.weight_scale_inv"]
    with pytest.raises(W.WeightsError, match="no weight_scale_inv"):
        W.load_experts(bad, P, [0])
    bad = dict(sd)
    bad[ep + "0.gate_proj.weight_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(W.WeightsError, match=r"gate_proj\.weight_scale_inv' has shape \[2, 2\], expected \[1, 2\]"):
        W.load_experts(bad, P, [0])
    bad = dict(sd)
    bad[ep + "0.gate_proj.weight"] = torch.zeros(I, H, dtype=torch.int8)
    with pytest.raises(W.WeightsError, match="torch.int8"):
        W.load_experts(bad, P, [0])
    with pytest.raises(W.WeightsError, match="distinct"):
        W.load_experts(sd, P, [1, 1])
    with pytest.raises(W.WeightsError, match="outside"):
        W.load_experts(fused_from_per_expert(sd), P, [0, E])
    with pytest.raises(W.WeightsError, match="dtype"):
        W.load_experts(sd, P, [0], dtype=torch.float16)
    with pytest.raises(ValueError):  # WeightsError is a ValueError
        W.load_experts({}, P, [0])


def test_safetensors_sharded_checkpoint(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    sd = W.make_state_dict(E, H, I, dtype=FP8, layer_prefix=P, seed=8)
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    wmap = {}
    for name, ks in shards.items():
        st.save_file({k: sd[k].contiguous() for k in ks}, str(tmp_path / name))
        wmap.update({k: name for k in ks})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    a = W.load_experts_from_safetensors(str(tmp_path), P, [2, 3])
    b = W.load_experts(sd, P, [2, 3])
    for k in a:
        assert same(a[k], b[k]), k
    one = W.SafetensorsStateDict(str(tmp_path / "model-00001-of-00002.safetensors"))
    assert set(one.keys()) == set(keys[::2])


@pytest.mark.parametrize("dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_loaded_checkpoint_through_the_layer(backend, dtype):
    """R = 2: each rank loads its own experts from the checkpoint; y matches the fp64 reference
    over the whole checkpoint."""
    R, K, T = 2, 2, 5
    sd = W.make_state_dict(E, H, I, dtype=dtype, layer_prefix=P, seed=9)
    full = W.load_experts(sd, P, range(E))
    p = ref.make_problem(R, E, K, H, I, T, dtype=dtype, seed=9)
    dev = device_of(backend)
    comms = virtual_comms(R, backend)

    def rank(r, comm, ready):
        w = W.load_experts(sd, P, W.local_expert_ids(r, R, E), device=dev)
        layer = MoELayer(comm, E, K, H, I, T, dtype=dtype)
        layer.set_weights(w["w13"], w["w2"], w["w13_scale"], w["w2_scale"])
        x, ids, wts = p.x[r].to(dev), p.topk_ids[r].to(dev), p.topk_weights[r].to(dev)
        ready()
        try:
            return to_host(layer(x, ids, wts))
        finally:
            layer.close()

    try:
        ys = run_layer_ranks(comms, rank)
    finally:
        comms[0].group.close()
    for r in range(R):
        want = ref.reference_moe(p.x[r], p.topk_ids[r], p.topk_weights[r], full["w13"],
                                 full["w13_scale"], full["w2"], full["w2_scale"])
        ref.assert_close(ys[r], want, dtype, oracle=backend == "cpu")
