"""moeflow.adapter — moeflow in the shape of vLLM's modular fused-MoE kernels, without vLLM.

vLLM splits an EP MoE layer into a prepare/finalize object (quantise + dispatch; combine) and an
experts object (the grouped GEMMs on what prepare delivered), composed by FusedMoEModularKernel:

    a = prepare_finalize.prepare(x, topk_weights, topk_ids, E, expert_map, apply_on_input, qcfg)
    experts.apply(expert_out, a.a1q, w1, w2, ..., a1q_scale=a.a1q_scale,
                  expert_tokens_meta=a.expert_tokens_meta)
    prepare_finalize.finalize(out, expert_out, topk_weights, topk_ids, apply_on_input, NoOP)

Here the same three objects run on one moeflow MoELayer (moeflow.torch):
  MoeflowPrepareAndFinalize  prepare = mf_dispatch: quantise (FP8 layers, 1 x 128) and send every
                             (token, k) to its expert's rank, delivering rows grouped by local
                             expert, EXPERT_MAJOR ([rows, H], segments at expert_offsets, a
                             cu_seqlens of L + 1 entries with block_m padding) or MASKED
                             ([L, C, H]); expert_num_tokens = expert_counts [L]. finalize =
                             mf_combine: returns each row to its token's rank, applies
                             topk_weights and sums over k there (output_is_reduced: the experts
                             must not weight or reduce: TopKWeightAndReduceNoOP).
  MoeflowExperts             mode "torch": the engine's own GEMMs on the dispatched rows (per
                             expert torch matmuls: W13 -> SwiGLU -> W2, FP8 dequantised, the
                             intermediate requantised 1 x 128 as the layer does); mode "layer":
                             moeflow's fused whole layer (dispatch, grouped GEMMs and combine in
                             one collective, mf_moe_forward), which owns the prepare and finalize.
  MoeflowFusedMoE            FusedMoEModularKernel's forward over the two.

As in the MoonEP integration (a prepare/finalize pair for vLLM whose dispatch also returns
expert-grouped rows plus a segment table and no per-token ids): prepare keeps the dispatch's state
(here the DispatchResult) for finalize, refuses a second prepare before finalize, takes int32 ids
(int64 converted), and there are no post-dispatch per-token topk ids or weights (None). Unlike
MoonEP, invalid ids (-1) need no rewriting (moeflow skips them), T may vary per call up to the
layer's max_tokens (no padding to a capacity), and FP8 dispatch is supported.

Ids are global (rank r owns experts r * L .. r * L + L - 1): an `expert_map` is accepted only
when it is that linear placement. Every call here is collective over the layer's ranks (virtual
ranks: one thread each, moeflow.run_ranks).
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import reference
from .torch import MoELayer

BLOCK = reference.BLOCK
FP8 = torch.float8_e4m3fn


# ---- what prepare returns (vLLM's ExpertTokensMetadata / PrepareResultType) -----------------------
@dataclass
class ExpertTokensMetadata:
    """Per local expert row counts of a dispatch. expert_num_tokens [L] int32 (device);
    expert_num_tokens_cpu the same on the host when known; expert_offsets [L + 1] int32 segment
    starts of EXPERT_MAJOR (a cu_seqlens with block_m padding; None for MASKED); recv_src
    [rows, 3] / [L, C, 3] int32 (source rank, token, k) of every row (-1 on padding)."""
    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: Optional[torch.Tensor] = None
    expert_offsets: Optional[torch.Tensor] = None
    recv_src: Optional[torch.Tensor] = None


class PrepareResult(NamedTuple):
    """vLLM's PrepareResultType: (a1q, a1q_scale, expert_tokens_meta, topk_ids, topk_weights).
    a1q is the dispatched rows in the layer's dtype ([rows, H] or [L, C, H]); a1q_scale their
    1 x 128 fp32 scales (FP8) or None; no per-token ids / weights exist after dispatch (None)."""
    a1q: torch.Tensor
    a1q_scale: Optional[torch.Tensor]
    expert_tokens_meta: ExpertTokensMetadata
    topk_ids: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None


class TopKWeightAndReduceNoOP:
    """The experts' output is per row, unweighted: finalize (combine) weights and reduces."""


@dataclass
class QuantConfig:
    """The fields of vLLM's FusedMoEQuantConfig that these objects read: the expert weights'
    128 x 128 fp32 block scales (FP8; None for BF16). vLLM's own config object works as well."""
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    block_shape: tuple = (BLOCK, BLOCK)


_NOOP_NAMES = ("TopKWeightAndReduceNoOP", "TopKWeightAndReduceDelegate")


# ---- the engine's own GEMMs on dispatched rows ---------------------------------------------------
def expert_segments(expert_counts, expert_offsets=None):
    """[(local expert e, first row, count)] of a dispatch: EXPERT_MAJOR rows
    [offsets[e], offsets[e] + counts[e]) of recv_x; MASKED (offsets None) rows [0, counts[e]) of
    recv_x[e]. Reads the counts on the host (a device sync on CUDA)."""
    counts = expert_counts.tolist()
    starts = expert_offsets.tolist()[:-1] if expert_offsets is not None else [0] * len(counts)
    return [(e, s, c) for e, (s, c) in enumerate(zip(starts, counts))]


def _dequant_weight(w, scale):
    if w.dtype != FP8:
        return w.to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return w.to(torch.float32) * s[..., : w.shape[-2], : w.shape[-1]]


def torch_expert(rows, row_scales, w13, w2, w13_scale=None, w2_scale=None):
    """One expert on its dispatched rows with plain torch matmuls, as an engine's GEMM would:
    rows [M, H] (bf16, or FP8 with row_scales [M, H/128]), w13 [2I, H], w2 [H, I] (FP8 with their
    128 x 128 scales) -> [M, H] bf16 = W2 (silu(gate) * up), fp32 accumulation, the intermediate
    requantised 1 x 128 (FP8) or rounded to BF16 (BF16) before W2: the layer's rounding points."""
    if rows.dtype == FP8:
        xa = rows.to(torch.float32) * row_scales.repeat_interleave(BLOCK, -1)
    else:
        xa = rows.to(torch.float32)
    gu = xa @ _dequant_weight(w13, w13_scale).T
    inter = gu.shape[-1] // 2
    g, u = gu[:, :inter], gu[:, inter:]
    h = torch.nn.functional.silu(g) * u
    if w2.dtype == FP8:
        q, s = reference.quantize_fp8(h, 1)
        h = q.to(torch.float32) * s.repeat_interleave(BLOCK, -1)
    else:
        h = h.to(torch.bfloat16).to(torch.float32)
    return (h @ _dequant_weight(w2, w2_scale).T).to(torch.bfloat16)


def torch_experts(recv_x, recv_scales, expert_counts, expert_offsets, w13, w2, w13_scale=None,
                  w2_scale=None, out=None):
    """expert_out (bf16, recv_x's layout and rows) of a dispatch, by torch_expert per local
    expert: recv_x [rows, H] with expert_offsets [L + 1] (EXPERT_MAJOR) or [L, C, H] with
    expert_offsets None (MASKED); w13 [L, 2I, H], w2 [L, H, I] this rank's experts. Rows that are
    not real (padding, past a count) are left as `out` held them (zeros when out is None):
    combine ignores them."""
    H = recv_x.shape[-1]
    if out is None:
        out = torch.zeros(*recv_x.shape[:-1], H, dtype=torch.bfloat16, device=recv_x.device)
    masked = expert_offsets is None
    for e, start, count in expert_segments(expert_counts, expert_offsets):
        if count == 0:
            continue
        sl = slice(start, start + count)
        rows = recv_x[e, sl] if masked else recv_x[sl]
        rs = None
        if recv_scales is not None:
            rs = recv_scales[e, sl] if masked else recv_scales[sl]
        y = torch_expert(rows, rs, w13[e], w2[e], None if w13_scale is None else w13_scale[e],
                         None if w2_scale is None else w2_scale[e])
        if masked:
            out[e, sl] = y
        else:
            out[sl] = y
    return out


# ---- prepare / finalize --------------------------------------------------------------------------
class MoeflowPrepareAndFinalize:
    """vLLM's FusedMoEPrepareAndFinalize(Modular) over mf_dispatch / mf_combine of `layer` (a
    moeflow.torch.MoELayer). One per rank; prepare and finalize alternate and are collective."""

    def __init__(self, layer: MoELayer):
        self.layer = layer
        self._pending = None       # the DispatchResult finalize combines
        self._num_tokens = 0
        self._on_input = False
        self._ones = None          # combine's weights when the router weights went in with x

    # -- what vLLM asks of a prepare/finalize --------------------------------------------------------
    @property
    def activation_format(self):
        """"standard" (EXPERT_MAJOR rows [rows, H]) or "batched" (MASKED [L, C, H]), as vLLM's
        FusedMoEActivationFormat.Standard / BatchedExperts."""
        return "batched" if self.layer.layout == "masked" else "standard"

    def num_dispatchers(self):
        return self.layer.info.num_ranks

    def output_is_reduced(self):
        return True  # combine returns the weighted K-sum, token-major

    def max_num_tokens_per_rank(self):
        return self.layer.max_tokens

    def topk_indices_dtype(self):
        return torch.int32

    def supports_async(self):
        return False

    def post_init_setup(self, fused_experts):
        pass

    # -- the calls -----------------------------------------------------------------------------------
    def _check_expert_map(self, expert_map):
        if expert_map is None:
            return
        info, E = self.layer.info, self.layer.num_experts
        want = torch.full((E,), -1, dtype=torch.int32)
        L, first = info.num_local_experts, info.first_expert
        want[first:first + L] = torch.arange(L, dtype=torch.int32)
        if not torch.equal(expert_map.to("cpu", torch.int32), want):
            raise NotImplementedError("moeflow places experts linearly (rank r owns r * L .. "
                                      "r * L + L - 1); this expert_map differs")

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map=None,
                apply_router_weight_on_input=False, quant_config=None, defer_input_quant=False):
        """Dispatch this rank's tokens a1 [T, H] bf16 routed by topk_ids [T, K] (global ids, -1
        skips; int32 or int64): a PrepareResult of the rows delivered to this rank's experts.
        The layer's dtype decides the payload (FP8 layers quantise 1 x 128 here; quant_config is
        not consulted). Collective."""
        if self._pending is not None:
            raise RuntimeError("MoeflowPrepareAndFinalize.prepare() called again before finalize()")
        if num_experts != self.layer.num_experts:
            raise ValueError(f"num_experts {num_experts} != the layer's {self.layer.num_experts}")
        if defer_input_quant:
            raise NotImplementedError("moeflow quantises in dispatch; defer_input_quant is not supported")
        self._check_expert_map(expert_map)
        if a1.dtype != torch.bfloat16:
            raise TypeError(f"moeflow dispatches bf16 hidden states, not {a1.dtype}")
        self._ones = None
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input requires top-1 routing")
            a1 = (a1.to(torch.float32) * topk_weights.to(torch.float32)).to(torch.bfloat16)
            self._ones = torch.ones(topk_weights.shape, dtype=torch.float32, device=a1.device)
        d = self.layer.dispatch(a1.contiguous(), topk_ids.contiguous())
        self._pending, self._num_tokens = d, a1.shape[0]
        self._on_input = apply_router_weight_on_input
        meta = ExpertTokensMetadata(d.expert_counts, None, d.expert_offsets, d.recv_src)
        return PrepareResult(d.recv_x, d.recv_scales, meta, None, None)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input=False, weight_and_reduce_impl=None):
        """Combine: output [T, H] (bf16, written in place) = sum over k ascending of
        topk_weights[t, k] * fused_expert_output[row of (t, k)], for the T tokens of the prepare
        before. fused_expert_output is bf16 in a1q's layout, unweighted (weight_and_reduce_impl
        must be None or a NoOP / Delegate: combine weights and reduces). Collective."""
        if self._pending is None:
            raise RuntimeError("MoeflowPrepareAndFinalize.finalize() without a prepare()")
        if weight_and_reduce_impl is not None and type(weight_and_reduce_impl).__name__ not in _NOOP_NAMES:
            raise TypeError("moeflow's combine weights and reduces: pair it with "
                            f"TopKWeightAndReduceNoOP, not {type(weight_and_reduce_impl).__name__}")
        d, self._pending = self._pending, None
        if self._on_input:  # the router weights went in with x: combine applies 1
            topk_weights = self._ones
        y = self.layer.combine(fused_expert_output.contiguous(),
                               topk_weights.to(torch.float32).contiguous(), d)
        output.copy_(y[: self._num_tokens])


# ---- experts ---------------------------------------------------------------------------------------
class MoeflowExperts:
    """vLLM's FusedMoEPermuteExpertsUnpermute (modular experts) for moeflow's dispatch layout.

    mode "torch": apply() runs this rank's experts on the dispatched rows with torch matmuls
      (torch_experts): the engine brings its own GEMMs.
    mode "layer": moeflow's fused whole layer (mf_moe_forward: dispatch, W13 -> SwiGLU -> W2,
      combine) on `layer`; MoeflowFusedMoE calls forward_layer() instead of prepare / apply /
      finalize, since the layer fuses them (W13 may read rows in place at their owners).
    Weight scales come from quant_config.w1_scale / w2_scale (FP8)."""

    def __init__(self, mode="torch", quant_config=None, layer: Optional[MoELayer] = None):
        if mode not in ("torch", "layer"):
            raise ValueError(f"mode must be 'torch' or 'layer', not {mode!r}")
        if mode == "layer" and layer is None:
            raise ValueError("mode 'layer' needs the MoELayer")
        self.mode, self.layer = mode, layer
        self.quant_config = quant_config or QuantConfig()
        self._weights_key = None

    def activation_formats(self):
        return ("standard", "batched")

    def supports_expert_map(self):
        return False  # ids reach the experts already local (dispatch's segments)

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def apply(self, output, hidden_states, w1, w2, topk_weights=None, topk_ids=None,
              activation="silu", global_num_experts=-1, expert_map=None, a1q_scale=None,
              a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
              apply_router_weight_on_input=False):
        """output (bf16, hidden_states' layout) = this rank's experts on the dispatched rows
        hidden_states (PrepareResult.a1q, scales a1q_scale), w1 [L, 2I, H] (gate rows then up),
        w2 [L, H, I]; segments from expert_tokens_meta. Unweighted (finalize weights)."""
        if self.mode != "torch":
            raise RuntimeError("MoeflowExperts(mode='layer') runs the whole layer: use "
                               "MoeflowFusedMoE.forward (it fuses prepare, experts and finalize)")
        if activation != "silu":
            raise NotImplementedError(f"moeflow's experts are SwiGLU (silu), not {activation!r}")
        if expert_tokens_meta is None:
            raise ValueError("apply needs the expert_tokens_meta of prepare")
        qc = self.quant_config
        torch_experts(hidden_states, a1q_scale, expert_tokens_meta.expert_num_tokens,
                      expert_tokens_meta.expert_offsets, w1, w2, qc.w1_scale, qc.w2_scale,
                      out=output)

    def forward_layer(self, x, w1, w2, topk_weights, topk_ids):
        """mode "layer": y [T, H] = the fused layer (mf_moe_forward). Sets w1 / w2 (+ the quant
        config's scales) on the layer when they are not the ones it holds (the layer borrows
        them: keep them alive and unchanged). Collective."""
        qc = self.quant_config
        key = tuple(None if t is None else (t.data_ptr(), tuple(t.shape))
                    for t in (w1, w2, qc.w1_scale, qc.w2_scale))
        if key != self._weights_key:
            self.layer.set_weights(w1, w2, qc.w1_scale, qc.w2_scale)
            self._weights_key = key
        return self.layer(x, topk_ids, topk_weights.to(torch.float32).contiguous())


# ---- the composition -----------------------------------------------------------------------------
class MoeflowFusedMoE(torch.nn.Module):
    """vLLM's FusedMoEModularKernel: prepare -> experts.apply -> finalize, or (experts mode
    "layer") the fused whole layer in one call."""

    def __init__(self, prepare_finalize: MoeflowPrepareAndFinalize, experts: MoeflowExperts):
        super().__init__()
        self.prepare_finalize, self.fused_experts = prepare_finalize, experts
        prepare_finalize.post_init_setup(experts)

    @classmethod
    def create(cls, comm, num_experts, topk, hidden, intermediate, max_tokens,
               dtype=FP8, layout="expert_major", mode="layer", quant_config=None, **layer_kwargs):
        """A MoELayer on `comm` (collective) wrapped as prepare/finalize + experts of `mode`."""
        layer = MoELayer(comm, num_experts, topk, hidden, intermediate, max_tokens, dtype=dtype,
                         layout=layout, **layer_kwargs)
        experts = MoeflowExperts(mode, quant_config, layer if mode == "layer" else None)
        return cls(MoeflowPrepareAndFinalize(layer), experts)

    @property
    def layer(self):
        return self.prepare_finalize.layer

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                activation="silu", global_num_experts=-1, expert_map=None,
                apply_router_weight_on_input=False):
        """y [T, H] bf16 of this rank's tokens hidden_states [T, H] bf16 routed by topk_ids
        [T, K] (global ids) with topk_weights [T, K]; w1 / w2 this rank's experts [L, 2I, H] /
        [L, H, I] (scales in the experts' quant_config). inplace writes y into hidden_states.
        Collective over the layer's ranks."""
        pf, ex = self.prepare_finalize, self.fused_experts
        E = global_num_experts if global_num_experts > 0 else pf.layer.num_experts
        if ex.mode == "layer":
            if activation != "silu":
                raise NotImplementedError(f"moeflow's experts are SwiGLU (silu), not {activation!r}")
            if apply_router_weight_on_input:
                raise NotImplementedError("the fused layer applies router weights at combine")
            if E != pf.layer.num_experts:
                raise ValueError(f"global_num_experts {E} != the layer's {pf.layer.num_experts}")
            pf._check_expert_map(expert_map)
            y = ex.forward_layer(hidden_states, w1, w2, topk_weights, topk_ids)
        else:
            # every buffer before the first collective: on virtual ranks sharing a GPU an
            # allocation between dispatch and combine may wait behind a peer's spinning kernel
            expert_out = self._expert_out_buffer()
            y = torch.empty_like(hidden_states)
            topk_weights = topk_weights.to(torch.float32).contiguous()
            a = pf.prepare(hidden_states, topk_weights, topk_ids, E, expert_map,
                           apply_router_weight_on_input, ex.quant_config)
            try:
                ex.apply(expert_out, a.a1q, w1, w2, topk_weights, topk_ids, activation, E, None,
                         a.a1q_scale, None, None, None, a.expert_tokens_meta,
                         apply_router_weight_on_input)
            except BaseException:
                # the peers wait in combine: combine anyway (zeros) so that no rank hangs
                pf.finalize(torch.empty_like(hidden_states), expert_out, topk_weights, topk_ids,
                            apply_router_weight_on_input, ex.finalize_weight_and_reduce_impl())
                raise
            pf.finalize(y, expert_out, topk_weights, topk_ids, apply_router_weight_on_input,
                        ex.finalize_weight_and_reduce_impl())
        if inplace:
            hidden_states.copy_(y)
            return hidden_states
        return y

    def _expert_out_buffer(self):
        """The experts' output [max_recv_rows, H] (EXPERT_MAJOR) or [L, C, H] (MASKED) bf16,
        kept across calls (combine reads only the real rows, so stale rows are harmless)."""
        layer, info = self.layer, self.layer.info
        lead = ((info.num_local_experts, info.expert_capacity) if layer.layout == "masked"
                else (info.max_recv_rows,))
        buf = getattr(self, "_expert_out", None)
        if buf is None:
            buf = self._expert_out = torch.zeros(*lead, layer.hidden, dtype=torch.bfloat16,
                                                 device=layer.device)
        return buf

    def close(self):
        self._expert_out = None
        self.layer.close()
