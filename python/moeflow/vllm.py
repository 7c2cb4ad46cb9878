"""moeflow.vllm — moeflow inside vLLM 0.33's modular fused-MoE kernel (vllm.model_executor.layers.
fused_moe.modular_kernel), as real subclasses of vLLM's base classes.

vLLM runs an MoE layer as a `FusedMoEKernel(prepare_finalize, fused_experts)`: prepare quantises
and dispatches, the experts run the GEMMs, finalize combines. moeflow fits in two ways:

  dispatch + combine    MoeflowPrepareAndFinalize (BatchedExperts format: moeflow's MASKED layout,
                        [L, R * S, H] rows per local expert with expert_num_tokens) paired with
                        MoeflowExperts (moeflow's grouped GEMMs, mf_moe_experts) or with vLLM's
                        own batched experts (BatchedTritonExperts, NaiveBatchedExperts, ...).
                        Combine weights and sums over k (TopKWeightAndReduceDelegate / NoOP).
  the whole layer       MoeflowLayerExperts (mf_moe_forward: dispatch, W13 -> SwiGLU -> W2 and
                        combine in one collective; Standard format, unquantised input,
                        TopKWeightAndReduceNoOP) with MoeflowPassThroughPrepareAndFinalize, in the
                        shape of vLLM's Mega-MoE experts.

`make_kernel` builds either kernel for one vLLM MoE layer; `install` makes it for a loaded vLLM
layer (RoutedExperts) and sets it as the layer's quant method's `moe_kernel`, which vLLM's forward
calls (no patch of vLLM is needed). `comm_from_ep_group` makes the moeflow comm from vLLM's EP
group. One moeflow MoELayer per vLLM MoE layer; every call through these objects is collective
over the EP group, as vLLM's own all2all backends are.

What moeflow accepts from vLLM (and refuses, with a clear error at construction or call):
  - quantisation: unquantised BF16, or FP8 E4M3 weights in 128 x 128 blocks with dynamic 1 x 128
    activation scales (`fp8_w8a8_moe_quant_config(..., block_shape=[128, 128])`); anything else
    (per-tensor / per-channel FP8, INT8/INT4, MX/NV FP4, static activation scales) is refused;
  - the activation SiLU with gate-and-up (SwiGLU), no bias, TP = 1 inside the MoE (EP);
  - expert ids: vLLM's global ids, physical ids under EPLB (`global_num_experts` = physical
    slots: the layer is made with E = num_physical), int32 or int64, -1 skipping;
  - placement: vLLM's "linear" (the first E % R ranks one more expert) and "round_robin"; the
    `expert_map` vLLM passes must be the one that placement gives.
Importing this module needs vLLM 0.33 (`pip install ./python[vllm]`).
"""
import collections
import warnings

import torch

try:
    import vllm
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough import (
        PassThroughPrepareAndFinalize,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Dynamic128Sym,
        kFp8Static128BlockSym,
    )
    from vllm.platforms import current_platform
except ImportError as e:  # vLLM absent, or a release without 0.33's class names
    raise ImportError(f"moeflow.vllm needs vLLM 0.33 (pip install './python[vllm]'): {e}") from e

from . import _lib
from .torch import MoELayer, comm_from_process_group
from .weights import local_expert_ids

FP8 = torch.float8_e4m3fn
BLOCK = _lib.QUANT_BLOCK
SUPPORTED_VLLM = "0.33"  # the release these classes are tested against (CI: vllm==0.33.0)
PLACEMENTS = ("linear", "round_robin")
if not vllm.__version__.startswith(SUPPORTED_VLLM):
    warnings.warn(f"moeflow.vllm is tested against vLLM {SUPPORTED_VLLM}; this is vLLM "
                  f"{vllm.__version__}", stacklevel=2)

__all__ = ["MoeflowPrepareAndFinalize", "MoeflowExperts", "MoeflowLayerExperts",
           "MoeflowPassThroughPrepareAndFinalize", "layer_dtype", "make_layer", "make_kernel",
           "comm_from_ep_group", "install", "placement_expert_map"]


# ---- what vLLM hands over, checked once --------------------------------------------------------
def layer_dtype(quant_config):
    """The moeflow layer dtype a vLLM FusedMoEQuantConfig asks for: torch.bfloat16 (unquantised)
    or torch.float8_e4m3fn (FP8 E4M3 weights in 128 x 128 blocks, dynamic 1 x 128 activations).
    ValueError naming what differs for anything else."""
    if quant_config is None or (quant_config.quant_dtype is None
                                and quant_config.weight_quant_dtype is None):
        return torch.bfloat16
    qc = quant_config
    why = []
    if qc.quant_dtype != FP8 or qc.weight_quant_dtype != FP8:
        why.append(f"activation/weight dtype {qc.quant_dtype}/{qc.weight_quant_dtype} (want "
                   f"float8_e4m3fn)")
    if list(qc.block_shape or []) != [BLOCK, BLOCK]:
        why.append(f"block_shape {qc.block_shape} (want [{BLOCK}, {BLOCK}] weight blocks, 1 x "
                   f"{BLOCK} activations)")
    if qc.per_act_token_quant or qc.per_out_ch_quant:
        why.append("per-token / per-channel scales")
    if qc.a1_scale is not None or qc.a2_scale is not None:
        why.append("static activation scales (moeflow quantises activations dynamically)")
    if any(t is not None for t in (qc.w1_zp, qc.w2_zp, qc.w1_bias, qc.w2_bias, qc.g1_alphas,
                                   qc.g2_alphas, qc.a1_gscale, qc.a2_gscale)):
        why.append("zero points, biases or global scales")
    if why:
        raise ValueError("moeflow supports unquantised BF16 or FP8 E4M3 with 128 x 128 weight "
                         "blocks and dynamic 1 x 128 activation scales; this quant config has "
                         + "; ".join(why))
    return FP8


def _check_quant_matches(layer, quant_config, who):
    want = layer_dtype(quant_config)
    if want != layer.dtype:
        raise ValueError(f"{who}: the quant config asks for {want} experts, the moeflow layer is "
                         f"{layer.dtype} (make the layer with make_layer(moe_config, quant_config))")


def _check_activation(activation):
    if activation != MoEActivation.SILU:
        raise NotImplementedError(f"moeflow's experts are SwiGLU (MoEActivation.SILU with gate "
                                  f"and up), not {activation}")


def placement_expert_map(placement, num_experts, num_ranks, rank):
    """vLLM's expert_map [E] int32 (global id -> local index, -1 elsewhere) of `placement`
    ("linear": the first E % R ranks hold one more expert; "round_robin": expert e on rank
    e % R) on `rank`, as vLLM's determine_expert_map computes it."""
    if placement not in PLACEMENTS:
        raise ValueError(f"moeflow: placement must be one of {PLACEMENTS}, not {placement!r}")
    mine = torch.tensor(list(local_expert_ids(rank, num_ranks, num_experts, placement)))
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[mine] = torch.arange(len(mine), dtype=torch.int32)
    return m


def make_layer(moe_config: FusedMoEConfig, quant_config, comm, placement="linear",
               layout="masked", **layer_kwargs):
    """The moeflow MoELayer (collective over the comm's ranks) for one vLLM MoE layer:
    E = moe_config.num_experts (the physical slots under EPLB), K, H, I per partition,
    S = moe_config.max_num_tokens, the dtype layer_dtype(quant_config) gives, `placement`
    (vLLM's parallel_config.expert_placement_strategy). Checks what moeflow cannot serve."""
    if moe_config.moe_parallel_config.tp_size != 1:
        raise ValueError(f"moeflow runs the experts whole on their rank (EP); the MoE's TP size "
                         f"is {moe_config.moe_parallel_config.tp_size}")
    _check_activation(moe_config.activation)
    if moe_config.has_bias:
        raise ValueError("moeflow's experts take no bias")
    if moe_config.in_dtype != torch.bfloat16:
        raise ValueError(f"moeflow takes bf16 hidden states, the layer's are {moe_config.in_dtype}")
    if comm.size != moe_config.moe_parallel_config.ep_size:
        raise ValueError(f"the moeflow comm has {comm.size} ranks, vLLM's EP group "
                         f"{moe_config.moe_parallel_config.ep_size}")
    kwargs = dict(layout=layout, **layer_kwargs)
    if placement != "linear":
        kwargs["placement"] = placement
    return MoELayer(comm, moe_config.num_experts, moe_config.experts_per_token,
                    moe_config.hidden_dim, moe_config.intermediate_size_per_partition,
                    moe_config.max_num_tokens, dtype=layer_dtype(quant_config), **kwargs)


class _Weights:
    """The weights last set on a moeflow layer, so that each call sets them only when vLLM hands
    over other tensors (a weight reload, EPLB's rearrangement in place keeps them)."""

    def __init__(self, layer):
        self.layer, self.key = layer, None

    def use(self, w1, w2, w1_scale, w2_scale):
        key = tuple(None if t is None else (t.data_ptr(), tuple(t.shape))
                    for t in (w1, w2, w1_scale, w2_scale))
        if key != self.key:
            if self.layer.dtype == FP8 and (w1_scale is None or w2_scale is None):
                raise ValueError("moeflow: an FP8 layer needs the quant config's w1_scale and "
                                 "w2_scale (128 x 128 block scales)")
            self.layer.set_weights(w1.contiguous(), w2.contiguous(),
                                   None if self.layer.dtype != FP8 else w1_scale.contiguous(),
                                   None if self.layer.dtype != FP8 else w2_scale.contiguous())
            self.key = key


# ---- dispatch + combine -------------------------------------------------------------------------
class MoeflowPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize over mf_dispatch / mf_combine of one moeflow MoELayer (MASKED).

    prepare: quantises (FP8 layers: 1 x 128, fp32 scales) and sends every (token, k) to its
    expert's rank; returns (a1q [L, R*S, H], a1q_scale [L, R*S, H/128] fp32 or None,
    ExpertTokensMetadata(expert_num_tokens [L] int32, its host copy on the CPU backend), None,
    None): rows of local expert e are a1q[e, :expert_num_tokens[e]], rank-major then token then
    k. finalize: returns every expert output row to its token's rank and writes
    bf16(sum over k ascending of w * row) into vLLM's `output` in place.

    Like vLLM's DeepEP low-latency prepare/finalize: BatchedExperts format, output reduced,
    max_num_tokens_per_rank = S, num_dispatchers = R (the experts' batch is S * R rows), the
    experts must leave weighting and the k-sum to finalize (TopKWeightAndReduceDelegate or
    NoOP), apply_router_weight_on_input only with top-1. topk ids reach moeflow as int32
    (int64 converted here). prepare and finalize alternate; both are collective over the EP
    group."""

    def __init__(self, layer: MoELayer, quant_config=None):
        super().__init__()
        if layer.layout != "masked":
            raise ValueError("MoeflowPrepareAndFinalize delivers vLLM's BatchedExperts format: "
                             "make the MoELayer with layout='masked'")
        info = layer.info
        if info.expert_capacity != info.num_ranks * layer.max_tokens:
            raise ValueError(f"vLLM's batched experts hold S * R = "
                             f"{info.num_ranks * layer.max_tokens} rows per expert; the layer's "
                             f"expert_capacity is {info.expert_capacity} (leave it 0)")
        if quant_config is not None:
            _check_quant_matches(layer, quant_config, "MoeflowPrepareAndFinalize")
        self.layer = layer
        # (DispatchResult, T, router weights on input) of each prepare awaiting its finalize, in
        # order: two under vLLM's dual-batch overlap (a layer made with max_in_flight = 2)
        self._pending = collections.deque()
        self._placement = _PlacementCheck(layer)
        self._host_counts = layer.device.type == "cpu"

    # -- what vLLM asks of a prepare/finalize -------------------------------------------------------
    @property
    def activation_format(self):
        return mk.FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self):
        return torch.int32

    def max_num_tokens_per_rank(self):
        return self.layer.max_tokens

    def num_dispatchers(self):
        return self.layer.info.num_ranks

    def output_is_reduced(self):
        return True

    def supports_async(self):
        """prepare_async / finalize_async: moeflow's split halves (vLLM's dual-batch overlap needs
        a layer made with max_in_flight = 2)."""
        return True

    # -- the calls ---------------------------------------------------------------------------------
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant=False):
        if self._pending:
            raise RuntimeError("MoeflowPrepareAndFinalize.prepare() called again before finalize()")
        a1, on_input = self._input(a1, topk_weights, topk_ids, num_experts, expert_map,
                                   apply_router_weight_on_input, quant_config, defer_input_quant)
        d = self.layer.dispatch(a1, topk_ids.contiguous())
        self._pending.append((d, a1.shape[0], on_input))
        return self._prepared(d)

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                      apply_router_weight_on_input, quant_config, defer_input_quant=False):
        """The send half now (quantise, publish, signal; no wait on a peer); returns (hook,
        receiver): hook() runs the receive half (waits and lands the rows; on the stream current
        then, which under DBO is the other micro-batch's), receiver() returns prepare's tuple."""
        if len(self._pending) >= self.layer.max_in_flight:
            raise RuntimeError(f"MoeflowPrepareAndFinalize: {len(self._pending)} prepares await their "
                               f"finalize and the layer holds max_in_flight = {self.layer.max_in_flight}")
        a1, on_input = self._input(a1, topk_weights, topk_ids, num_experts, expert_map,
                                   apply_router_weight_on_input, quant_config, defer_input_quant)
        d, hook = self.layer.dispatch(a1, topk_ids.contiguous(), return_recv_hook=True)
        self._pending.append((d, a1.shape[0], on_input))

        def receiver():
            if not hook.called:
                hook()
            hook.wait()  # the rows landed on the hook's stream (CUDA)
            return self._prepared(d)

        return hook, receiver

    def _prepared(self, d):
        counts = d.expert_counts
        meta = mk.ExpertTokensMetadata(expert_num_tokens=counts,
                                       expert_num_tokens_cpu=counts if self._host_counts else None)
        return d.recv_x, d.recv_scales, meta, None, None

    def _input(self, a1, topk_weights, topk_ids, num_experts, expert_map,
               apply_router_weight_on_input, quant_config, defer_input_quant):
        """prepare's checks; the bf16 input to dispatch (scaled by the router weights when they
        apply on the input) and whether they did."""
        if defer_input_quant:
            raise NotImplementedError("moeflow quantises in dispatch: pair it with experts that "
                                      "take quantised input (defer_input_quant=False)")
        if num_experts != self.layer.num_experts:
            raise ValueError(f"global_num_experts {num_experts} != the moeflow layer's "
                             f"{self.layer.num_experts} (under EPLB: the physical slots)")
        _check_quant_matches(self.layer, quant_config, "MoeflowPrepareAndFinalize.prepare")
        self._placement.check(expert_map)
        if a1.dtype != torch.bfloat16:
            raise TypeError(f"moeflow dispatches bf16 hidden states, not {a1.dtype}")
        on_input = bool(apply_router_weight_on_input)
        if on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs top-1 routing")
            a1 = (a1.float() * topk_weights.float()).to(torch.bfloat16)
        return a1.contiguous(), on_input

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        d, T, weights = self._finalize_input(topk_weights, weight_and_reduce_impl)
        self.layer.combine(fused_expert_output.contiguous(), weights, d, out=output[:T])

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, weight_and_reduce_impl):
        """The combine's send half now (the rows go to their owners; no wait); returns (hook,
        receiver): hook() runs the receive half (waits, sums), receiver() leaves `output`
        valid (on the current stream)."""
        d, T, weights = self._finalize_input(topk_weights, weight_and_reduce_impl)
        y, hook = self.layer.combine(fused_expert_output.contiguous(), weights, d,
                                     return_recv_hook=True)

        def receiver():
            if not hook.called:
                hook()
            hook.wait()
            output[:T].copy_(y)

        return hook, receiver

    def _finalize_input(self, topk_weights, weight_and_reduce_impl):
        """The oldest prepare's dispatch, its T, and the combine weights (1 when the router
        weights applied on the input)."""
        if not self._pending:
            raise RuntimeError("MoeflowPrepareAndFinalize.finalize() without a prepare()")
        if not isinstance(weight_and_reduce_impl, (TopKWeightAndReduceDelegate,
                                                   TopKWeightAndReduceNoOP)):
            raise TypeError("moeflow's combine weights and reduces: the experts must return "
                            "TopKWeightAndReduceDelegate or TopKWeightAndReduceNoOP, not "
                            f"{type(weight_and_reduce_impl).__name__}")
        d, T, on_input = self._pending.popleft()
        weights = torch.ones_like(topk_weights, dtype=torch.float32) if on_input else topk_weights
        return d, T, weights.float().contiguous()


class _MoeflowSupport:
    """What both experts classes tell vLLM's kernel oracle (is_supported_config): the CPU or CUDA
    sm_90, SiLU gate-and-up, unquantised or FP8 128 x 128 blocks with 1 x 128 dynamic
    activations, TP = 1 inside the MoE."""

    _SCHEMES = ((None, None), (kFp8Static128BlockSym, kFp8Dynamic128Sym))

    @staticmethod
    def _supports_current_device():
        if current_platform.is_cpu():
            return True
        return current_platform.is_cuda() and current_platform.is_device_capability(90)

    @staticmethod
    def _supports_no_act_and_mul():
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key):
        return (weight_key, activation_key) in _MoeflowSupport._SCHEMES

    @staticmethod
    def _supports_activation(activation):
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config):
        return moe_parallel_config.tp_size == 1


class MoeflowExperts(_MoeflowSupport, mk.FusedMoEExpertsModular):
    """vLLM's experts for what MoeflowPrepareAndFinalize delivers: moeflow's grouped GEMMs
    (W13 -> SwiGLU -> W2, mf_moe_experts) on a1q [L, R*S, H] with expert_num_tokens, the
    weights vLLM passes (w1 [L, 2I, H], w2 [L, H, I]; FP8 scales from the quant config), into
    the unweighted output [L, R*S, H] (rows past a count untouched). The rounding is the fused
    layer's: the intermediate requantised 1 x 128 (FP8) or rounded to BF16 before W2, W2 rounded
    to BF16, so prepare -> these experts -> finalize gives the fused layer's y bit for bit on
    the CPU backend."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 layer: MoELayer):
        super().__init__(moe_config, quant_config, max_num_tokens=layer.max_tokens,
                         num_dispatchers=layer.info.num_ranks)
        _check_quant_matches(layer, quant_config, "MoeflowExperts")
        _check_activation(moe_config.activation)
        self.layer = layer
        self._weights = _Weights(layer)

    @staticmethod
    def activation_format():
        return mk.FusedMoEActivationFormat.BatchedExperts

    def supports_expert_map(self):
        return False  # rows arrive per local expert

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()  # the prepare/finalize's combine weights and sums

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        out = (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)
        return (0,), (0,), out  # moeflow keeps its own scratch

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        _check_activation(activation)
        if expert_tokens_meta is None or expert_tokens_meta.expert_num_tokens is None:
            raise ValueError("MoeflowExperts needs the expert_num_tokens of prepare")
        self._weights.use(w1, w2, self.w1_scale, self.w2_scale)
        self.layer.experts(hidden_states, a1q_scale, expert_tokens_meta.expert_num_tokens,
                           out=output)


# ---- the whole layer ------------------------------------------------------------------------------
class MoeflowLayerExperts(_MoeflowSupport, mk.FusedMoEExpertsModular):
    """The whole EP layer as one experts object that owns its communication (mf_moe_forward:
    dispatch, W13 -> SwiGLU -> W2, combine), in the shape of vLLM's Mega-MoE experts: Standard
    format, unquantised input (expects_unquantized_inputs; an FP8 layer quantises in its own
    dispatch), the output weighted and reduced (TopKWeightAndReduceNoOP). Pair it with
    MoeflowPassThroughPrepareAndFinalize. Collective: every EP rank runs apply, also with no
    tokens (moe_problem_size reports at least one row so that vLLM does not skip it)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 layer: MoELayer):
        super().__init__(moe_config, quant_config)
        _check_quant_matches(layer, quant_config, "MoeflowLayerExperts")
        _check_activation(moe_config.activation)
        self.layer = layer
        self._weights = _Weights(layer)
        self._placement = _PlacementCheck(layer)

    @staticmethod
    def activation_format():
        return mk.FusedMoEActivationFormat.Standard

    @property
    def expects_unquantized_inputs(self):
        return True

    def supports_expert_map(self):
        return True  # global ids, placed by the layer

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        E, M, N, K, topk = super().moe_problem_size(a1, w1, w2, topk_ids)
        return E, max(M, 1), N, K, topk  # M = 0 would make vLLM skip this rank's collective

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (0,), (0,), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        _check_activation(activation)
        if apply_router_weight_on_input:
            raise NotImplementedError("moeflow's fused layer applies the router weights in its "
                                      "combine (apply_router_weight_on_input is not supported)")
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(f"MoeflowLayerExperts takes unquantised bf16 input, not "
                            f"{hidden_states.dtype} (pair it with "
                            f"MoeflowPassThroughPrepareAndFinalize)")
        if global_num_experts != self.layer.num_experts:
            raise ValueError(f"global_num_experts {global_num_experts} != the moeflow layer's "
                             f"{self.layer.num_experts} (under EPLB: the physical slots)")
        self._placement.check(expert_map)
        self._weights.use(w1, w2, self.w1_scale, self.w2_scale)
        T = hidden_states.shape[0]
        y = output[:T]  # output has max(T, 1) rows (moe_problem_size)
        self.layer.forward(hidden_states.contiguous(), topk_ids.contiguous(),
                           topk_weights.float().contiguous(), out=y)


class MoeflowPassThroughPrepareAndFinalize(PassThroughPrepareAndFinalize):
    """vLLM's pass-through prepare/finalize (the experts dispatch and combine themselves) for
    MoeflowLayerExperts: prepare hands a1 over unquantised; finalize copies the experts' y into
    `output` unless vLLM already aliased them, including a rank with no tokens (whose experts'
    output has one row, see MoeflowLayerExperts.moe_problem_size)."""

    def max_num_tokens_per_rank(self):
        return None

    def topk_indices_dtype(self):
        return torch.int32

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
            raise TypeError("MoeflowPassThroughPrepareAndFinalize pairs with experts that weight "
                            "and reduce (TopKWeightAndReduceNoOP)")
        if fused_expert_output is not output:
            output.copy_(fused_expert_output[:output.shape[0]])


class _PlacementCheck:
    """vLLM's expert_map must be the moeflow layer's placement: compared once per map tensor
    (on CUDA the comparison reads it back, a host sync), not on every call."""

    def __init__(self, layer):
        self.layer, self.key = layer, None

    def check(self, expert_map):
        info = self.layer.info
        if expert_map is None:
            if info.num_ranks != 1:
                raise ValueError("moeflow: vLLM passed no expert_map for an EP layer")
            return
        key = (expert_map.data_ptr(), expert_map._version)
        if key == self.key:
            return
        placement = getattr(self.layer, "placement", "linear")
        want = placement_expert_map(placement, self.layer.num_experts, info.num_ranks, info.rank)
        if not torch.equal(expert_map.to("cpu", torch.int32), want):
            raise NotImplementedError(f"moeflow: vLLM's expert_map is not the layer's "
                                      f"{placement!r} placement (rank {info.rank})")
        self.key = key


# ---- the glue an engine needs -----------------------------------------------------------------
def comm_from_ep_group(ep_group=None, backend="auto", transport="auto", num_sms=0,
                       heap_bytes=0, timeout_ms=0):
    """This process's moeflow comm over vLLM's EP group (vllm.distributed.get_ep_group() when
    None): the bootstrap allgather runs on the group's CPU (gloo) process group, setup only.
    num_sms bounds the SMs moeflow's peer-waiting kernels take (0: all of a GPU per rank).
    Collective over the EP group; close() it, collectively, after its layers."""
    if ep_group is None:
        from vllm.distributed import get_ep_group
        ep_group = get_ep_group()
    return comm_from_process_group(ep_group.cpu_group, backend=backend, transport=transport,
                                   num_sms=num_sms, heap_bytes=heap_bytes, timeout_ms=timeout_ms)


def _num_ubatches():
    """The micro-batches vLLM's current config runs at once (2 under dual-batch overlap; 1
    without a config): the exchanges a dispatch-mode layer holds in flight."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    pc = getattr(config, "parallel_config", None)
    if pc is None or not pc.use_ubatching:
        return 1
    return min(max(int(pc.num_ubatches), 1), _lib.MAX_IN_FLIGHT)


def make_kernel(moe_config: FusedMoEConfig, quant_config, comm, mode="layer",
                placement="linear", experts=None, **layer_kwargs):
    """A vLLM FusedMoEKernel on moeflow for one MoE layer (its moeflow MoELayer is made here:
    collective over the comm's ranks; kernel.moeflow_layer, close() it after use).

    mode "layer"     MoeflowPassThroughPrepareAndFinalize + MoeflowLayerExperts (the fused layer);
    mode "dispatch"  MoeflowPrepareAndFinalize + `experts` (default MoeflowExperts; or vLLM's own
                     batched experts object, made with max_num_tokens = S and num_dispatchers = R).

    vLLM calls kernel.apply(x, w13_weight, w2_weight, topk_weights, topk_ids, activation,
    global_num_experts, expert_map, apply_router_weight_on_input) in the layer's forward (see
    install); the weights are set on the moeflow layer at the first call and again whenever vLLM
    hands over other tensors (the layer borrows them)."""
    if mode not in ("layer", "dispatch"):
        raise ValueError(f"moeflow: mode must be 'layer' or 'dispatch', not {mode!r}")
    layout = "masked" if mode == "dispatch" else layer_kwargs.pop("layout", "expert_major")
    if mode == "dispatch":  # vLLM's micro-batches (dual-batch overlap) in flight at once
        layer_kwargs.setdefault("max_in_flight", _num_ubatches())
    layer = make_layer(moe_config, quant_config, comm, placement=placement, layout=layout,
                       **layer_kwargs)
    try:
        if quant_config is None:
            quant_config = FusedMoEQuantConfig.make()
        if mode == "layer":
            kernel = mk.FusedMoEKernel(MoeflowPassThroughPrepareAndFinalize(),
                                       MoeflowLayerExperts(moe_config, quant_config, layer))
        else:
            ex = experts if experts is not None else MoeflowExperts(moe_config, quant_config, layer)
            kernel = mk.FusedMoEKernel(MoeflowPrepareAndFinalize(layer, quant_config), ex)
    except BaseException:
        layer.close()
        raise
    kernel.moeflow_layer = layer
    return kernel


def install(routed_experts, comm, mode="layer", **layer_kwargs):
    """Makes the moeflow kernel for one loaded vLLM MoE layer (a RoutedExperts, as
    FusedMoEFactory builds it: its moe_config, its quant method's quant config, its expert
    placement strategy) and installs it as the quant method's moe_kernel, which vLLM's forward
    calls (RoutedExperts.forward_modular -> quant_method.apply -> moe_kernel.apply, with
    w13_weight / w2_weight and the layer's expert_map). Call it after the weights are loaded, on
    every EP rank (collective). Returns the kernel (kernel.moeflow_layer: close() it with the
    model)."""
    qm = routed_experts.quant_method
    qc = qm.moe_quant_config
    if qc is None:
        qc = qm.get_fused_moe_quant_config(routed_experts)
    kernel = make_kernel(routed_experts.moe_config, qc, comm, mode=mode,
                         placement=routed_experts.expert_placement_strategy, **layer_kwargs)
    qm.moe_quant_config, qm.moe_kernel = qc, kernel
    return kernel
