"""moeflow.reference — the torch fp64 reference of the layer's numerics, and random problems.

It re-implements docs/DESIGN.md "Numerics" from the contract, as workload/ref.c does in C (and as
vLLM's reference experts do), sharing no code with the library:
  x [T, H] bf16 -> (FP8: quantised 1x128 along H, dequantised q * scale) -> xa       fp64
  for k ascending, id != -1, expert e = id:
    g, u = W13[e] xa            (FP8 weights dequantised q * scale per 128x128 block)  fp64
    h = fp32(silu(g) * u)
    h -> FP8 1x128 along I, dequantised (FP8) or rounded to bf16 (BF16) -> ha
    partial = bf16(fp32(W2[e] ha))
    acc += w[t, k] * partial    (fp32 multiply, fp32 add, k ascending)
  y = bf16(acc)
Block quantisation, exactly as src/core/numerics.h: amax in fp32 over the block, clamped below at
1e-4; scale = amax / 448 and q = e4m3(fp32(v * fp32(448 / amax))) (round to nearest even,
saturating at 448); UE8M0 rounds the scale up to a power of two and q = e4m3(v * (1 / scale)).

Tolerances are workload/ref.h's: ORACLE_* is what the CPU backend meets, ATOL/RTOL/DIFF_MAX what
any backend (CUDA) must meet.
"""
from dataclasses import dataclass

import torch

BLOCK = 128
FP8_MAX = 448.0
AMAX_MIN = 1e-4

# workload/ref.h
DIFF_MAX = {torch.bfloat16: 1e-5, torch.float8_e4m3fn: 1e-3}
ATOL = {torch.bfloat16: 2.0**-6, torch.float8_e4m3fn: 2.0**-4}
RTOL = 2.0**-7
ORACLE_ATOL = 2.0**-6
ORACLE_RTOL = 2.0**-7


def _block_scale(amax, ue8m0):
    """fp32 (scale, multiplier) of blocks whose max |v| is `amax` (fp32)."""
    amax = torch.where(amax >= AMAX_MIN, amax, torch.where(amax.isnan(), amax, AMAX_MIN))
    # torch computes `number / tensor` as reciprocal(tensor) * number (two roundings): divide
    # tensors instead, one IEEE division as the library does.
    fp8_max = torch.full_like(amax, FP8_MAX)
    if not ue8m0:
        return amax / fp8_max, fp8_max / amax
    scale = amax / fp8_max
    bits = scale.view(torch.int32)
    up = torch.where(bits & 0x7FFFFF != 0, (bits & ~0x7FFFFF) + 0x800000, bits)
    scale = torch.where(scale.isnan(), scale, up.view(torch.float32))
    return scale, torch.ones_like(scale) / scale


def quantize_fp8(v, block_rows=1, ue8m0=False):
    """Block-quantises v [..., M, N] (N a multiple of 128; M of 128 when block_rows = 128) to
    (q [..., M, N] float8_e4m3fn, scales [..., M / block_rows, N / 128] fp32), bit for bit as
    mf_quantize_fp8 does."""
    v = v.to(torch.float32)
    *batch, m, n = v.shape
    if n % BLOCK or m % block_rows:
        raise ValueError(f"quantize_fp8: shape {tuple(v.shape)} is not a multiple of "
                         f"{block_rows}x{BLOCK}")
    blocks = v.reshape(*batch, m // block_rows, block_rows, n // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # NaN propagates
    scale, mult = _block_scale(amax, ue8m0)
    prod = blocks * mult[..., :, None, :, None]  # rounded to fp32 before the conversion
    q = prod.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # saturate (NaN stays NaN)
    return q.reshape(*batch, m, n), scale


def dequantize_fp8(q, scales, block_rows=1):
    """q * scale per block, in fp64: q [..., M, N], scales [..., M / block_rows, N / 128]."""
    s = scales.to(torch.float64).repeat_interleave(block_rows, -2).repeat_interleave(BLOCK, -1)
    return q.to(torch.float64) * s


def fake_quantize_fp8(v, ue8m0=False):
    """v [..., N] quantised 1x128 and dequantised, in fp64 (what an FP8 GEMM sees)."""
    q, s = quantize_fp8(v, 1, ue8m0)
    return dequantize_fp8(q, s, 1)


def reference_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, ue8m0=False):
    """y [T, H] bf16 of tokens x [T, H] bf16 routed by topk_ids [T, K] (global ids, -1 skips) with
    topk_weights [T, K] fp32, through all E experts: w13 [E, 2I, H], w2 [E, H, I] in bf16 or
    float8_e4m3fn, with fp32 block scales [E, 2I/128, H/128], [E, H/128, I/128] for FP8 (None for
    BF16). Computed in fp64 with the layer's rounding points (module docstring)."""
    fp8 = w13.dtype == torch.float8_e4m3fn
    T, H = x.shape
    inter = w2.shape[2]
    xa = fake_quantize_fp8(x, ue8m0) if fp8 else x.to(torch.float64)
    acc = torch.zeros(T, H, dtype=torch.float32)
    ids = topk_ids.cpu().long()
    for k in range(ids.shape[1]):
        for e in ids[:, k].unique().tolist():
            if e < 0:
                continue
            rows = (ids[:, k] == e).nonzero().squeeze(1)
            if fp8:
                w13_e = dequantize_fp8(w13[e].cpu(), w13_scale[e].cpu(), BLOCK)
                w2_e = dequantize_fp8(w2[e].cpu(), w2_scale[e].cpu(), BLOCK)
            else:
                w13_e, w2_e = w13[e].cpu().to(torch.float64), w2[e].cpu().to(torch.float64)
            gu = xa[rows].cpu() @ w13_e.T
            g, u = gu[:, :inter], gu[:, inter:]
            h = (g / (1.0 + torch.exp(-g)) * u).to(torch.float32)
            ha = fake_quantize_fp8(h, ue8m0) if fp8 else h.to(torch.bfloat16).to(torch.float64)
            partial = (ha @ w2_e.T).to(torch.float32).to(torch.bfloat16).to(torch.float32)
            acc[rows] = acc[rows] + topk_weights[rows, k].cpu()[:, None] * partial
    return acc.to(torch.bfloat16)


def diff(a, b):
    """1 - 2 sum(a b) / sum(a^2 + b^2) in fp64 (0 when both are zero; 1e9 on NaN / inf)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    if not (a.isfinite().all() and b.isfinite().all()):
        return 1e9
    sq = (a * a + b * b).sum().item()
    return 0.0 if sq == 0.0 else 1.0 - 2.0 * (a * b).sum().item() / sq


def assert_close(y, ref, dtype, oracle=True):
    """Checks layer output y against reference_moe's ref with workload/ref.h's bounds: the diff
    measure below DIFF_MAX[dtype] and every element within atol + rtol |ref| (oracle=True: the CPU
    backend's tight bounds; False: the bounds any backend must meet). Raises AssertionError
    naming the first element outside."""
    y, ref = y.cpu().to(torch.float64), ref.cpu().to(torch.float64)
    assert y.shape == ref.shape, f"shape {tuple(y.shape)} != reference {tuple(ref.shape)}"
    d = diff(y, ref)
    assert d <= DIFF_MAX[dtype], f"diff {d:.3g} > {DIFF_MAX[dtype]:.0e}"
    atol = ORACLE_ATOL if oracle else ATOL[dtype]
    rtol = ORACLE_RTOL if oracle else RTOL
    bad = ~((y - ref).abs() <= atol + rtol * ref.abs())
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {y.numel()} values outside "
                             f"{atol:g} + {rtol:g} |ref|; first at {i}: {y[tuple(i)].item()} vs "
                             f"{ref[tuple(i)].item()}")


@dataclass
class Problem:
    """A random layer problem for R ranks. Global expert e lives on rank e // L as local expert
    e % L. x, topk_ids, topk_weights are per-rank lists; w13 [E, 2I, H], w2 [E, H, I] (bf16 or
    float8_e4m3fn) with scales (FP8) or None."""
    num_ranks: int
    x: list
    topk_ids: list
    topk_weights: list
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @property
    def num_experts(self):
        return self.w13.shape[0]

    def local_weights(self, rank):
        """(w13, w2, w13_scale, w2_scale) of rank's local experts (contiguous views)."""
        L = self.num_experts // self.num_ranks
        s = slice(rank * L, (rank + 1) * L)
        scales = (None, None) if self.w13_scale is None else (self.w13_scale[s], self.w2_scale[s])
        return self.w13[s], self.w2[s], *scales

    def reference(self, rank, ue8m0=False):
        """reference_moe of rank's tokens."""
        return reference_moe(self.x[rank], self.topk_ids[rank], self.topk_weights[rank], self.w13,
                             self.w13_scale, self.w2, self.w2_scale, ue8m0)


def make_problem(num_ranks, num_experts, topk, hidden, intermediate, tokens, dtype=torch.bfloat16,
                 seed=0, drop=0.0):
    """A seeded random problem: x ~ N(0, 1) bf16, weights U(-1, 1) sqrt(3 / fan_in) (so that every
    value is O(1)), FP8 weights quantised 128x128 by quantize_fp8; distinct uniform top-k ids per
    token, each replaced by -1 with probability `drop`; topk_weights uniform, normalised to sum 1.
    `tokens` is T for every rank, or a list of T per rank. On the CPU."""
    gen = torch.Generator().manual_seed(seed)
    E, K, H, inter = num_experts, topk, hidden, intermediate
    counts = tokens if isinstance(tokens, (list, tuple)) else [tokens] * num_ranks

    def uniform(*shape, fan_in):
        u = torch.rand(*shape, generator=gen, dtype=torch.float32) * 2 - 1
        return (u * (3.0 / fan_in) ** 0.5).to(torch.bfloat16)

    xs, ids, wts = [], [], []
    for t in counts:
        xs.append(torch.randn(t, H, generator=gen).to(torch.bfloat16))
        i = torch.rand(t, E, generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
        i[torch.rand(t, K, generator=gen) < drop] = -1
        ids.append(i.contiguous())
        w = torch.rand(t, K, generator=gen) + 0.05
        wts.append((w / w.sum(dim=1, keepdim=True)).contiguous())
    w13, w2 = uniform(E, 2 * inter, H, fan_in=H), uniform(E, H, inter, fan_in=inter)
    s13 = s2 = None
    if dtype == torch.float8_e4m3fn:
        (w13, s13), (w2, s2) = quantize_fp8(w13, BLOCK), quantize_fp8(w2, BLOCK)
    elif dtype != torch.bfloat16:
        raise TypeError(f"make_problem: dtype must be torch.bfloat16 or torch.float8_e4m3fn, "
                        f"not {dtype}")
    return Problem(num_ranks, xs, ids, wts, w13, s13, w2, s2)
