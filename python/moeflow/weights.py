"""moeflow.weights — a rank's expert weights from a Hugging Face-style state dict, in moeflow's layout.

    ids = local_expert_ids(rank, num_ranks, num_experts)            # this rank's, linear placement
    w = load_experts(state_dict, "model.layers.3.mlp", ids)         # {"w13", "w13_scale", "w2", "w2_scale"}
    layer.set_weights(w["w13"], w["w2"], w["w13_scale"], w["w2_scale"])

Checkpoint layouts read (the first that matches `{layer_prefix}.experts.`):
  per-expert   `{p}.experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H],
               `.down_proj.weight` [H, I] (DeepSeek-V3, Kimi-K2, Qwen3-MoE; Mixtral's `w1`, `w3`,
               `w2` = gate, up, down), FP8 ones with `.weight_scale_inv` [ceil(I/128), ceil(H/128)]
               and [ceil(H/128), ceil(I/128)] fp32 beside each weight;
  fused        `{p}.experts.w13_weight` [E, 2I, H] (gate rows, then up rows) and `w2_weight`
               [E, H, I] (vLLM's FusedMoE parameters), FP8 ones with `w13_weight_scale_inv` /
               `w2_weight_scale_inv` (or `..._scale`) [E, 2I/128, H/128], [E, H/128, I/128].
moeflow's layout (docs/LAYOUTS.md section 2): w13 [L, 2I, H] with rows [0, I) the gate projection
and [I, 2I) the up projection, w2 [L, H, I], and for FP8 fp32 scales [L, 2I/128, H/128],
[L, H/128, I/128] of 128 x 128 blocks. Stacking gate then up along rows is exact block for block
when I is a multiple of 128 (FP8 layers require it), so the scales stack the same way.

Scale convention: DeepSeek's `weight_scale_inv` is the multiplier that dequantises
(w = fp8_to_float(q) * scale_inv, blocks of 128 x 128), and so is moeflow's scale (LAYOUTS.md:
"dequantises as fp8_to_float(w) * scales"; src/core/quant.c stores amax / 448). The two are the
same number: the values are copied unchanged, no reciprocal is taken.

dtype: None keeps the checkpoint's (FP8 stays FP8 with its scales; BF16, FP16 and FP32 weights
become BF16); torch.bfloat16 from an FP8 checkpoint dequantises; torch.float8_e4m3fn from a BF16
one quantises 128 x 128 exactly as mf_quantize_fp8 does (moeflow.reference.quantize_fp8).

Also: `SafetensorsStateDict` (a lazy mapping over *.safetensors files, optional `safetensors`
package) and `make_state_dict` (a seeded random checkpoint in either layout, for examples and
tests). Everything runs on the host unless `device` is given.
"""
import json
import os
import re
from collections.abc import Mapping

import torch

from . import reference

BLOCK = 128
FP8 = torch.float8_e4m3fn
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
# per-expert projection names: (gate, up, down)
_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


class WeightsError(ValueError):
    """A state dict that does not hold the experts asked for in a layout this module reads."""


def local_expert_ids(rank, num_ranks, num_experts, placement="linear"):
    """Global ids of `rank`'s experts in its local order, under `placement` (mf_placement_t,
    include/moeflow.h): "linear", contiguous ranges with the first E % R ranks holding one more
    (rank * L .. rank * L + L - 1 when R | E); "round_robin", expert e on rank e % R as local
    expert e // R. These are vLLM's placements too."""
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise WeightsError(f"rank {rank} is outside [0, {num_ranks})")
    if num_experts < num_ranks:
        raise WeightsError(f"{num_experts} experts over {num_ranks} ranks: every rank holds one at least")
    if placement == "linear":
        base, extra = divmod(num_experts, num_ranks)
        first = rank * base + min(rank, extra)
        return range(first, first + base + (rank < extra))
    if placement == "round_robin":
        return range(rank, num_experts, num_ranks)
    raise WeightsError(f"placement must be 'linear' or 'round_robin', not {placement!r}")


def _cdiv(a, b):
    return -(-a // b)


def _get(sd, key, what):
    try:
        return sd[key]
    except KeyError:
        raise WeightsError(f"{what}: '{key}' is not in the state dict") from None


def _expert_prefix(layer_prefix):
    p = layer_prefix.rstrip(".")
    return p + ".experts." if p else "experts."


def num_experts_in(state_dict, layer_prefix):
    """E of the layer under `layer_prefix`, from its keys (per-expert: 1 + the largest index;
    fused: w13_weight's first dim)."""
    ep = _expert_prefix(layer_prefix)
    fused = state_dict.get(ep + "w13_weight") if hasattr(state_dict, "get") else None
    if fused is not None:
        return int(fused.shape[0])
    pat = re.compile(re.escape(ep) + r"(\d+)\.")
    ids = [int(m.group(1)) for k in state_dict.keys() for m in [pat.match(k)] if m]
    if not ids:
        raise WeightsError(f"no expert weights under '{ep}' (looked for '{ep}<e>.gate_proj.weight' "
                           f"and '{ep}w13_weight')")
    return max(ids) + 1


def _detect_layout(sd, ep):
    keys = sd.keys()
    if ep + "w13_weight" in keys:
        return "fused", None
    for names in _PROJ_NAMES:
        if any(k.startswith(ep) and k.endswith(f".{names[0]}.weight") for k in keys):
            return "per_expert", names
    some = [k for k in keys if k.startswith(ep)][:3]
    raise WeightsError(f"no expert weights under '{ep}': expected '{ep}<e>.gate_proj.weight' "
                       f"(or w1/w3/w2) or '{ep}w13_weight'" +
                       (f"; found e.g. {some}" if some else ""))


def _scale_of(sd, base):
    """The block scale beside weight `base` ('...weight' -> '...weight_scale_inv'), or None."""
    stem = base[: -len("weight")]
    for suf in _SCALE_SUFFIXES:
        if stem + suf in sd.keys():
            return sd[stem + suf], stem + suf
    return None, None


def _check_weight(name, w, shape, scale, scale_name):
    if not isinstance(w, torch.Tensor):
        raise WeightsError(f"'{name}' is a {type(w).__name__}, not a torch.Tensor")
    if tuple(w.shape) != tuple(shape):
        raise WeightsError(f"'{name}' has shape {list(w.shape)}, expected {list(shape)}")
    if w.dtype == FP8:
        if scale is None:
            raise WeightsError(f"'{name}' is float8_e4m3fn but has no weight_scale_inv beside it")
        want = (*shape[:-2], _cdiv(shape[-2], BLOCK), _cdiv(shape[-1], BLOCK))
        if tuple(scale.shape) != want:
            raise WeightsError(f"'{scale_name}' has shape {list(scale.shape)}, expected {list(want)} "
                               f"(128 x 128 blocks of {list(shape)})")
        if scale.dtype not in _FLOAT:
            raise WeightsError(f"'{scale_name}' is {scale.dtype}, expected a float dtype (fp32)")
    elif w.dtype not in _FLOAT:
        raise WeightsError(f"'{name}' is {w.dtype}: expected float8_e4m3fn (with weight_scale_inv) "
                           f"or bfloat16 / float16 / float32")


def _gather_per_expert(sd, ep, names, ids):
    """(w13 [L, 2I, H], s13, w2 [L, H, I], s2) stacked from per-expert tensors; scales None for
    BF16 checkpoints."""
    gate_n, up_n, down_n = names
    first = _get(sd, f"{ep}{ids[0]}.{gate_n}.weight", f"expert {ids[0]}")
    if first.dim() != 2:
        raise WeightsError(f"'{ep}{ids[0]}.{gate_n}.weight' must be 2-D [I, H], "
                           f"has shape {list(first.shape)}")
    inter, hidden = first.shape
    dtype = first.dtype
    w13, s13, w2, s2 = [], [], [], []
    for e in ids:
        parts = []
        for n, shape in ((gate_n, (inter, hidden)), (up_n, (inter, hidden)), (down_n, (hidden, inter))):
            key = f"{ep}{e}.{n}.weight"
            w = _get(sd, key, f"expert {e}")
            s, skey = _scale_of(sd, key)
            _check_weight(key, w, shape, s, skey)
            if w.dtype != dtype and not (w.dtype in _FLOAT and dtype in _FLOAT):
                raise WeightsError(f"'{key}' is {w.dtype}, '{ep}{ids[0]}.{gate_n}.weight' {dtype}: "
                                   f"mixed FP8 and float experts")
            parts.append((w, s))
        (g, gs), (u, us), (d, ds) = parts
        w13.append(torch.cat([g, u], 0))
        w2.append(d)
        if dtype == FP8:
            if inter % BLOCK:
                raise WeightsError(f"FP8 experts need I (= {inter}) to be a multiple of {BLOCK}: "
                                   f"gate and up scales cannot be stacked otherwise")
            s13.append(torch.cat([gs, us], 0))
            s2.append(ds)
    stack = torch.stack
    if dtype == FP8:
        return stack(w13), stack(s13), stack(w2), stack(s2)
    return stack(w13), None, stack(w2), None


def _gather_fused(sd, ep, ids):
    w13_all, w2_all = sd[ep + "w13_weight"], _get(sd, ep + "w2_weight", "fused layout")
    if w13_all.dim() != 3 or w2_all.dim() != 3:
        raise WeightsError(f"'{ep}w13_weight' / 'w2_weight' must be 3-D [E, 2I, H] / [E, H, I], have "
                           f"{list(w13_all.shape)} / {list(w2_all.shape)}")
    E, two_i, hidden = w13_all.shape
    inter = two_i // 2
    s13_all, k13 = _scale_of(sd, ep + "w13_weight")
    s2_all, k2 = _scale_of(sd, ep + "w2_weight")
    _check_weight(ep + "w13_weight", w13_all, (E, 2 * inter, hidden), s13_all, k13)
    _check_weight(ep + "w2_weight", w2_all, (E, hidden, inter), s2_all, k2)
    if (w13_all.dtype == FP8) != (w2_all.dtype == FP8):
        raise WeightsError(f"'{ep}w13_weight' is {w13_all.dtype} but 'w2_weight' {w2_all.dtype}")
    bad = [e for e in ids if not 0 <= e < E]
    if bad:
        raise WeightsError(f"expert ids {bad[:4]} are outside [0, {E}) of '{ep}w13_weight'")
    idx = torch.tensor(list(ids), dtype=torch.long)
    if w13_all.dtype == FP8:
        return w13_all[idx], s13_all[idx], w2_all[idx], s2_all[idx]
    return w13_all[idx], None, w2_all[idx], None


def _convert(w, s, dtype):
    """(w, s) of one stacked projection in `dtype`: FP8 keeps its scales (fp32); FP8 -> BF16
    dequantises; float -> FP8 quantises 128 x 128 (mf_quantize_fp8's rule)."""
    if dtype == FP8:
        if w.dtype == FP8:
            return w, s.to(torch.float32)
        if w.shape[-2] % BLOCK or w.shape[-1] % BLOCK:
            raise WeightsError(f"quantising to FP8 needs both dims of {list(w.shape[-2:])} to be "
                               f"multiples of {BLOCK}")
        return reference.quantize_fp8(w.to(torch.bfloat16), BLOCK)
    if w.dtype == FP8:
        full = s.to(torch.float32).repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
        full = full[..., : w.shape[-2], : w.shape[-1]]
        return (w.to(torch.float32) * full).to(torch.bfloat16), None
    return w.to(torch.bfloat16), None


def load_experts(state_dict, layer_prefix, expert_ids, dtype=None, device=None):
    """This rank's experts of the MoE layer at `layer_prefix` (e.g. "model.layers.3.mlp") in
    moeflow's layout: {"w13": [L, 2I, H], "w13_scale": [L, 2I/128, H/128] fp32 or None,
    "w2": [L, H, I], "w2_scale": [L, H/128, I/128] fp32 or None}, contiguous, on `device` (default:
    where the checkpoint's tensors are). `expert_ids` are the L global ids in local order
    (normally local_expert_ids(rank, R, E)); `dtype` None keeps the checkpoint's (FP8 or BF16),
    else torch.bfloat16 or torch.float8_e4m3fn. Raises WeightsError (a ValueError) naming the key
    on a missing tensor, a wrong shape or dtype, or FP8 weights without scales."""
    ids = [int(e) for e in expert_ids]
    if not ids:
        raise WeightsError("expert_ids is empty")
    if any(e < 0 for e in ids) or len(set(ids)) != len(ids):
        raise WeightsError(f"expert_ids must be distinct and non-negative, got {ids[:8]}")
    if dtype not in (None, torch.bfloat16, FP8):
        raise WeightsError(f"dtype must be None, torch.bfloat16 or torch.float8_e4m3fn, not {dtype}")
    ep = _expert_prefix(layer_prefix)
    layout, names = _detect_layout(state_dict, ep)
    if layout == "fused":
        w13, s13, w2, s2 = _gather_fused(state_dict, ep, ids)
    else:
        w13, s13, w2, s2 = _gather_per_expert(state_dict, ep, names, ids)
    target = dtype or (FP8 if w13.dtype == FP8 else torch.bfloat16)
    w13, s13 = _convert(w13, s13, target)
    w2, s2 = _convert(w2, s2, target)

    def place(t):
        if t is None:
            return None
        return (t.to(device) if device is not None else t).contiguous()

    return {"w13": place(w13), "w13_scale": place(s13), "w2": place(w2), "w2_scale": place(s2)}


# ---- safetensors ---------------------------------------------------------------------------------
class SafetensorsStateDict(Mapping):
    """A read-only, lazy state dict over a checkpoint's *.safetensors files: a directory (its
    model.safetensors.index.json when present, else every *.safetensors in it), one file, or a
    list of files. A tensor is read from disk when it is looked up, so load_experts on a
    600 GB checkpoint reads only this rank's experts. Needs the `safetensors` package."""

    def __init__(self, path, device="cpu"):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("moeflow.weights: reading .safetensors needs `pip install safetensors`") from e
        self._open, self._device, self._handles = safe_open, str(device), {}
        files = []
        if isinstance(path, (list, tuple)):
            files = [str(p) for p in path]
        elif os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    wmap = json.load(f)["weight_map"]
                self._where = {k: os.path.join(path, v) for k, v in wmap.items()}
                return
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        else:
            files = [str(path)]
        if not files:
            raise WeightsError(f"no .safetensors files in {path}")
        self._where = {}
        for f in files:
            for k in self._handle(f).keys():
                self._where[k] = f

    def _handle(self, f):
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(f, framework="pt", device=self._device)
        return h

    def __getitem__(self, key):
        return self._handle(self._where[key]).get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def __contains__(self, key):
        return key in self._where

    def keys(self):
        return self._where.keys()


def load_experts_from_safetensors(path, layer_prefix, expert_ids, dtype=None, device=None):
    """load_experts over SafetensorsStateDict(path): reads only the tensors of `expert_ids`."""
    return load_experts(SafetensorsStateDict(path), layer_prefix, expert_ids, dtype, device)


# ---- synthetic checkpoints -----------------------------------------------------------------------
def make_state_dict(num_experts, hidden, intermediate, dtype=FP8, layer_prefix="model.layers.0.mlp",
                    layout="per_expert", seed=0, names=_PROJ_NAMES[0]):
    """A seeded random checkpoint of one MoE layer as a Hugging Face release ships it: weights
    U(-1, 1) sqrt(3 / fan_in) (outputs O(1)) in BF16, or FP8 quantised 128 x 128 with
    `weight_scale_inv` (dtype torch.float8_e4m3fn; hidden and intermediate multiples of 128).
    layout "per_expert" (gate_proj / up_proj / down_proj per expert; `names` may be ("w1", "w3",
    "w2")) or "fused" (w13_weight [E, 2I, H], w2_weight [E, H, I], *_weight_scale_inv)."""
    if dtype not in (torch.bfloat16, FP8):
        raise WeightsError(f"dtype must be torch.bfloat16 or torch.float8_e4m3fn, not {dtype}")
    gen = torch.Generator().manual_seed(seed)
    E, H, inter = num_experts, hidden, intermediate

    def uniform(*shape, fan_in):
        u = torch.rand(*shape, generator=gen, dtype=torch.float32) * 2 - 1
        return (u * (3.0 / fan_in) ** 0.5).to(torch.bfloat16)

    def maybe_quant(w):
        return reference.quantize_fp8(w, BLOCK) if dtype == FP8 else (w, None)

    ep = _expert_prefix(layer_prefix)
    sd = {}
    if layout == "fused":
        for name, w in (("w13_weight", uniform(E, 2 * inter, H, fan_in=H)),
                        ("w2_weight", uniform(E, H, inter, fan_in=inter))):
            q, s = maybe_quant(w)
            sd[ep + name] = q
            if s is not None:
                sd[ep + name + "_scale_inv"] = s
        return sd
    if layout != "per_expert":
        raise WeightsError(f"layout must be 'per_expert' or 'fused', not {layout!r}")
    for e in range(E):
        for n, shape, fan_in in ((names[0], (inter, H), H), (names[1], (inter, H), H),
                                 (names[2], (H, inter), inter)):
            q, s = maybe_quant(uniform(*shape, fan_in=fan_in))
            sd[f"{ep}{e}.{n}.weight"] = q
            if s is not None:
                sd[f"{ep}{e}.{n}.weight_scale_inv"] = s
    return sd
