"""A test double of the part of vLLM 0.33 that moeflow.vllm uses, for machines where vLLM cannot be
installed (the H200 machine: no network, torch 2.11). install() registers it as the `vllm` modules
moeflow.vllm imports, so that moeflow's classes run there with CUDA tensors, unchanged.

It stands in for two things vLLM does and nothing more:
  1. the modular-kernel base classes and configs moeflow.vllm subclasses and reads (their names,
     constructor arguments and the attributes moeflow reads: FusedMoEQuantConfig's quant_dtype,
     block_shape, scales ...; the experts' w1_scale / w2_scale; the default moe_problem_size);
  2. FusedMoEKernel.apply's modular path: prepare -> experts.apply on the workspace it sizes with
     workspace_shapes (a rank with M = 0 rows skips the experts) -> finalize into `output`.
test_vllm.py::test_double_matches_vllm checks these names and signatures against the real vLLM
0.33 in CI, so that the double cannot drift from what it stands for.
"""
import enum
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


# ---- modular_kernel ---------------------------------------------------------------------------
class FusedMoEActivationFormat(enum.Enum):
    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


@dataclass
class ExpertTokensMetadata:
    expert_num_tokens: Optional[torch.Tensor]
    expert_num_tokens_cpu: Optional[torch.Tensor]


class TopKWeightAndReduce:
    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        raise NotImplementedError


class FusedMoEPrepareAndFinalizeModular:
    def post_init_setup(self, fused_experts):
        return

    def supports_async(self):
        return False


class FusedMoEExpertsModular:
    def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None):
        self.moe_config, self.quant_config = moe_config, quant_config
        self.max_num_tokens, self.num_dispatchers = max_num_tokens, num_dispatchers

    @property
    def expects_unquantized_inputs(self):
        return False

    @property
    def w1_scale(self):
        return self.quant_config.w1_scale

    @property
    def w2_scale(self):
        return self.quant_config.w2_scale

    @property
    def a2_scale(self):
        return self.quant_config.a2_scale

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        E, N, _ = w1.shape
        K = a1.size(-1)
        if a1.dim() == 2:
            assert topk_ids.size(0) == a1.size(0)
            M = a1.size(0)
        else:
            assert a1.dim() == 3 and a1.size(0) == E
            M = a1.size(1)
        return E, M, N, K, topk_ids.size(1)


class FusedMoEKernel:
    """vLLM's FusedMoEKernel with a modular prepare/finalize and experts: apply's data path."""

    def __init__(self, prepare_finalize, fused_experts):
        self.prepare_finalize, self.fused_experts = prepare_finalize, fused_experts
        prepare_finalize.post_init_setup(fused_experts)
        assert prepare_finalize.activation_format == fused_experts.activation_format()

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, apply_router_weight_on_input, shared_experts=None,
              shared_experts_input=None):
        pf, ex = self.prepare_finalize, self.fused_experts
        output = hidden_states.new_empty(hidden_states.shape)
        local = w1.shape[0]
        a1q, a1q_scale, meta, ids, wts = pf.prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map,
            apply_router_weight_on_input, ex.quant_config,
            defer_input_quant=ex.expects_unquantized_inputs)
        topk_ids = topk_ids if ids is None else ids
        topk_weights = topk_weights if wts is None else wts
        _, M, N, K, topk = ex.moe_problem_size(a1q, w1, w2, topk_ids)
        if M == 0:
            fused_out = a1q.new_empty((*a1q.shape[:-1], a1q.size(-1)), dtype=hidden_states.dtype)
        else:
            ws13, ws2, out_shape = ex.workspace_shapes(M, N, K, topk, global_num_experts, local,
                                                       meta, activation)
            new = lambda shape: torch.empty(shape, dtype=hidden_states.dtype,  # noqa: E731
                                            device=hidden_states.device)
            fused_out = output if tuple(out_shape) == tuple(output.shape) else new(out_shape)
            ex.apply(fused_out, a1q, w1, w2, topk_weights, topk_ids, activation,
                     global_num_experts, expert_map, a1q_scale, ex.a2_scale, new(ws13), new(ws2),
                     meta, apply_router_weight_on_input)
        pf.finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                    ex.finalize_weight_and_reduce_impl())
        return output


# ---- activation, configs, quant keys, reduce, platform ----------------------------------------------
class MoEActivation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"


class QuantKey:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


kFp8Static128BlockSym = QuantKey("kFp8Static128BlockSym")
kFp8Dynamic128Sym = QuantKey("kFp8Dynamic128Sym")


@dataclass
class FusedMoEQuantConfig:
    quant_dtype: Any = None
    weight_quant_dtype: Any = None
    block_shape: Optional[list] = None
    per_act_token_quant: bool = False
    per_out_ch_quant: bool = False
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    a1_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None
    w1_zp: Any = None
    w2_zp: Any = None
    w1_bias: Any = None
    w2_bias: Any = None
    g1_alphas: Any = None
    g2_alphas: Any = None
    a1_gscale: Any = None
    a2_gscale: Any = None

    @staticmethod
    def make(quant_dtype=None, block_shape=None, w1_scale=None, w2_scale=None, **kwargs):
        return FusedMoEQuantConfig(quant_dtype, quant_dtype, block_shape, w1_scale=w1_scale,
                                   w2_scale=w2_scale, **kwargs)


def fp8_w8a8_moe_quant_config(w1_scale, w2_scale, a1_scale=None, a2_scale=None,
                              per_act_token_quant=False, block_shape=None, **kwargs):
    return FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape, w1_scale, w2_scale,
                                    a1_scale=a1_scale, a2_scale=a2_scale,
                                    per_act_token_quant=per_act_token_quant)


@dataclass
class FusedMoEParallelConfig:
    tp_size: int = 1
    ep_size: int = 1
    ep_rank: int = 0


@dataclass
class FusedMoEConfig:
    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size_per_partition: int
    max_num_tokens: int
    moe_parallel_config: FusedMoEParallelConfig = field(default_factory=FusedMoEParallelConfig)
    activation: MoEActivation = MoEActivation.SILU
    in_dtype: torch.dtype = torch.bfloat16
    has_bias: bool = False


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    pass


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    pass


class PassThroughPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    @property
    def activation_format(self):
        return FusedMoEActivationFormat.Standard

    def num_dispatchers(self):
        return 1

    def output_is_reduced(self):
        return True

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, defer_input_quant=False):
        return a1, None, None, None, None


class _Platform:
    def is_cpu(self):
        return False

    def is_cuda(self):
        return torch.cuda.is_available()

    def is_device_capability(self, capability):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor == capability


current_platform = _Platform()


def get_current_vllm_config_or_none():
    """No vLLM config is current outside vLLM's engine (moeflow.vllm then holds one exchange)."""
    return None


# ---- the modules moeflow.vllm imports ----------------------------------------------------------
_FM = "vllm.model_executor.layers.fused_moe"
MODULES = {
    "vllm": {"__version__": "0.33.0 (moeflow test double)"},
    "vllm.model_executor": {},
    "vllm.model_executor.layers": {},
    _FM: {},
    f"{_FM}.modular_kernel": dict(
        FusedMoEActivationFormat=FusedMoEActivationFormat, ExpertTokensMetadata=ExpertTokensMetadata,
        TopKWeightAndReduce=TopKWeightAndReduce, FusedMoEKernel=FusedMoEKernel,
        FusedMoEPrepareAndFinalizeModular=FusedMoEPrepareAndFinalizeModular,
        FusedMoEExpertsModular=FusedMoEExpertsModular),
    f"{_FM}.activation": dict(MoEActivation=MoEActivation),
    f"{_FM}.config": dict(FusedMoEConfig=FusedMoEConfig, FusedMoEQuantConfig=FusedMoEQuantConfig,
                          FusedMoEParallelConfig=FusedMoEParallelConfig,
                          fp8_w8a8_moe_quant_config=fp8_w8a8_moe_quant_config),
    f"{_FM}.prepare_finalize": {},
    f"{_FM}.prepare_finalize.passthrough": dict(
        PassThroughPrepareAndFinalize=PassThroughPrepareAndFinalize),
    f"{_FM}.topk_weight_and_reduce": dict(TopKWeightAndReduceDelegate=TopKWeightAndReduceDelegate,
                                          TopKWeightAndReduceNoOP=TopKWeightAndReduceNoOP),
    "vllm.model_executor.layers.quantization": {},
    "vllm.model_executor.layers.quantization.utils": {},
    "vllm.model_executor.layers.quantization.utils.quant_utils": dict(
        kFp8Static128BlockSym=kFp8Static128BlockSym, kFp8Dynamic128Sym=kFp8Dynamic128Sym),
    "vllm.platforms": dict(current_platform=current_platform),
    "vllm.config": dict(get_current_vllm_config_or_none=get_current_vllm_config_or_none),
}


def install():
    """Registers the double as `vllm` (nothing if a real vLLM is importable: it is returned)."""
    try:
        import vllm  # noqa: F401
        return sys.modules["vllm"]
    except ImportError:
        pass
    for name, attrs in MODULES.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so that submodules import
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    return sys.modules["vllm"]
