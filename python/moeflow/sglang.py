"""moeflow.sglang — moeflow's dispatch and combine behind SGLang's token-dispatcher contract
(sglang.srt.layers.moe.token_dispatcher.base.BaseDispatcher, SGLang 0.5.23), so that SGLang's MoE
runners and its two-batch overlap drive moeflow the way they drive DeepEP's low-latency mode.

    layer = MoELayer(comm, E, K, H, I, S, dtype=..., layout="masked", max_in_flight=2)
    d0, d1 = MoeflowDispatcher(layer), MoeflowDispatcher(layer)   # one per micro-batch (TBO)
    out = d0.dispatch(hidden_states, topk_output)     # = dispatch_a (send) + dispatch_b (receive)
    y = d0.combine(DeepEPLLCombineInput(expert_out, topk_ids, topk_weights))

dispatch_a runs moeflow's send half (quantise, publish, signal: no wait on a peer) and
dispatch_b its receive half; combine_a / combine_b likewise. The layer must be MASKED: the output
is SGLang's own DeepEPLLDispatchOutput (hidden_states [L, C, H] in the layer's dtype,
hidden_states_scale [L, C, H/128] fp32 for FP8 else None, the caller's topk_ids and topk_weights,
masked_m = moeflow's expert_counts [L] int32, expected_m as SGLang computes it for DeepEP), and
combine takes the DeepEP low-latency combine input (expert outputs [L, C, H] bf16 in that layout,
topk_ids, topk_weights [T, K]) and returns [T, H] bf16 weighted and summed over k. An
EXPERT_MAJOR layer is refused: DeepEP's normal format carries one row per token and rank, with
ids remapped to local experts, which moeflow's per-(token, k) segments are not.

One dispatcher holds one exchange at a time (SGLang's stage order: dispatch_a, dispatch_b,
combine_a, combine_b); two micro-batches use two dispatchers on one layer made with
max_in_flight = 2, and every rank runs the stages in the same order (receives in the order of
their sends). Importing this module needs SGLang (it is imported only when SGLang is installed);
tested against SGLang 0.5.23's own classes (docs/API.md section 16).
"""
try:
    from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLDispatchOutput
except ImportError as e:  # SGLang absent, or a release without 0.5.23's names
    raise ImportError("moeflow.sglang needs SGLang (tested with 0.5.23): pip install sglang==0.5.23") from e

from .torch import MoELayer


class MoeflowDispatcher(BaseDispatcher):
    """SGLang's BaseDispatcher over one moeflow MoELayer (MASKED layout): dispatch / combine and
    their a (send) / b (receive) halves. Collective over the layer's ranks."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        if layer.layout != "masked":
            raise ValueError("MoeflowDispatcher delivers SGLang's DeepEP low-latency format "
                             "(masked_m): make the MoELayer with layout='masked'")
        self.layer = layer
        self._stage = "initial"
        self._pending = None

    def _advance(self, want, then):
        if self._stage != want:
            raise RuntimeError(f"MoeflowDispatcher: stage is {self._stage}, this call needs {want} "
                               f"(dispatch_a, dispatch_b, combine_a, combine_b in this order)")
        self._stage = then

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(self, hidden_states, topk_output):
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    def dispatch_a(self, hidden_states, topk_output):
        """The send half: returns once this rank's tokens are published (no wait on a peer)."""
        self._advance("initial", "after_dispatch_a")
        topk_ids, topk_weights = topk_output.topk_ids, topk_output.topk_weights
        try:
            d, hook = self.layer.dispatch(hidden_states.contiguous(), topk_ids.contiguous(), return_recv_hook=True)
        except BaseException:
            self._stage = "initial"
            raise
        self._pending = (d, hook, topk_ids, topk_weights)

    def dispatch_b(self):
        """The receive half: waits for every rank's send and returns DeepEPLLDispatchOutput."""
        self._advance("after_dispatch_a", "after_dispatch_b")
        d, hook, topk_ids, topk_weights = self._pending
        try:
            hook()
        except BaseException:
            self._stage, self._pending = "initial", None
            raise
        hook.wait()
        info = self.layer.info
        # SGLang's DeepEP low-latency dispatcher: the expected rows per local expert
        expected_m = ((topk_ids.shape[0] * info.num_ranks * topk_ids.shape[1] + self.layer.num_experts)
                      // self.layer.num_experts)
        return DeepEPLLDispatchOutput(hidden_states=d.recv_x, hidden_states_scale=d.recv_scales,
                                      topk_ids=topk_ids, topk_weights=topk_weights,
                                      masked_m=d.expert_counts, expected_m=expected_m)

    # -- combine -------------------------------------------------------------------------------------
    def combine(self, combine_input):
        self.combine_a(combine_input)
        return self.combine_b()

    def combine_a(self, combine_input):
        """The send half: returns the expert outputs ([L, C, H] bf16) to their tokens' ranks."""
        self._advance("after_dispatch_b", "after_combine_a")
        hidden_states, _topk_ids, topk_weights = combine_input
        d = self._pending[0]
        try:
            y, hook = self.layer.combine(hidden_states.contiguous(), topk_weights.float().contiguous(), d,
                                         return_recv_hook=True)
        except BaseException:
            self._stage, self._pending = "initial", None
            raise
        self._pending = (y, hook)

    def combine_b(self):
        """The receive half: waits and returns [T, H] bf16, weighted and summed over k."""
        self._advance("after_combine_a", "initial")
        y, hook = self._pending
        self._pending = None
        hook()
        hook.wait()
        return y
