"""bench/py_overhead.py — what the Python binding adds to a call into libmoeflow.

Times, on the CPU backend with one rank, the same call four ways, median of 7 batches:
  C           a C loop calling mf_moe_forward / mf_moe_get_info (compiled here with cc)
  ctypes      the raw ctypes function (moeflow._lib) with structs built once
  moeflow     moeflow.Layer.forward / LayerInfo read, building the descriptors each call
  torch op    moeflow.torch.MoELayer.forward (torch.ops.moeflow.forward: checks + dispatcher)
The forward has T = 0 tokens (a full collective call on one rank that moves no data), so the
difference to the C loop is the binding's own cost. Run from a checkout after `make`:
    PYTHONPATH=python python3 bench/py_overhead.py
"""
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import moeflow
from moeflow import _lib
from moeflow.torch import MoELayer, virtual_comms

ROOT = Path(__file__).resolve().parent.parent
N = 20000
E, K, H, I, S = 8, 2, 256, 128, 16

C_LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "moeflow.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    mf_group_config_t gc = MF_GROUP_CONFIG_INIT; gc.backend = MF_BACKEND_CPU;
    mf_group_t g; mf_comm_t c; mf_moe_t m;
    mf_moe_config_t mc = MF_MOE_CONFIG_INIT;
    mc.num_experts = %d; mc.num_topk = %d; mc.hidden = %d; mc.intermediate = %d;
    mc.max_tokens_per_rank = %d; mc.dtype = MF_DTYPE_BF16;
    if (mf_group_create(&gc, &g) || mf_group_get_comm(g, 0, &c) || mf_moe_create(c, &mc, &m)) return 1;
    size_t L = mc.num_experts, H = mc.hidden, I = mc.intermediate;
    mf_moe_weights_t w = {{calloc(L * 2 * I * H, 2), MF_DTYPE_BF16, 3, {L, 2 * I, H}}, {0},
                          {calloc(L * H * I, 2), MF_DTYPE_BF16, 3, {L, H, I}}, {0}};
    if (mf_moe_set_weights(m, &w)) return 1;
    mf_moe_forward_in_t in = {{NULL, MF_DTYPE_BF16, 2, {0, H}}, {NULL, MF_DTYPE_INT32, 2, {0, mc.num_topk}},
                              {NULL, MF_DTYPE_FP32, 2, {0, mc.num_topk}}};
    mf_moe_forward_out_t out = {{NULL, MF_DTYPE_BF16, 2, {0, H}}};
    mf_moe_info_t info;
    for (int rep = 0; rep < 7; rep++) {
        double t0 = now();
        for (int i = 0; i < n; i++) if (mf_moe_forward(m, &in, &out, NULL)) return 1;
        double t1 = now();
        for (int i = 0; i < n; i++) if (mf_moe_get_info(m, &info)) return 1;
        printf("%%.1f %%.1f\n", (t1 - t0) / n, (now() - t1) / n);
    }
    mf_moe_destroy(m); mf_group_destroy(g);
    return 0;
}
""" % (E, K, H, I, S)


def c_loop():
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "loop.c", Path(tmp) / "loop"
        src.write_text(C_LOOP)
        libdir = Path(_lib.path).parent
        subprocess.run(["cc", "-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", f"-I{ROOT}/include",
                        str(src), "-o", str(exe), f"-L{libdir}", "-l:libmoeflow.so",
                        f"-Wl,-rpath,{libdir}"], check=True)
        lines = subprocess.run([str(exe), str(N)], check=True, capture_output=True,
                               text=True).stdout.split("\n")
    rows = [tuple(map(float, line.split())) for line in lines if line]
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def per_call_ns(fn):
    batches = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(N):
            fn()
        batches.append((time.perf_counter_ns() - t0) / N)
    return statistics.median(batches)


def main():
    comms = virtual_comms(1, "cpu")
    layer = MoELayer(comms[0], E, K, H, I, S, dtype=torch.bfloat16)
    L = layer.info.num_local_experts
    layer.set_weights(torch.zeros(L, 2 * I, H, dtype=torch.bfloat16),
                      torch.zeros(L, H, I, dtype=torch.bfloat16))
    x, y = torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, H, dtype=torch.bfloat16)
    ids, wts = torch.empty(0, K, dtype=torch.int32), torch.empty(0, K)
    desc = [_lib.tensor(0, d, t.shape) for t, d in ((x, 0), (ids, 3), (wts, 2), (y, 0))]
    fin, fout = _lib.ForwardIn(*desc[:3]), _lib.ForwardOut(desc[3])
    info = _lib.MoeInfo()
    handle = layer._core.handle

    c_fwd, c_info = c_loop()
    rows = [
        ("forward T=0", c_fwd,
         per_call_ns(lambda: _lib.mf_moe_forward(handle, ctypes.byref(fin), ctypes.byref(fout),
                                                 None)),
         per_call_ns(lambda: layer._core.forward(*desc)),
         per_call_ns(lambda: layer(x, ids, wts))),
        ("get_info", c_info,
         per_call_ns(lambda: _lib.mf_moe_get_info(handle, ctypes.byref(info))), None, None),
    ]
    print(f"# moeflow {moeflow.version}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{N} calls x 7, median ns per call")
    print(f"{'call':<12} {'C':>8} {'ctypes':>8} {'moeflow':>8} {'torch op':>9}")
    for name, *cols in rows:
        print(f"{name:<12} " + " ".join(f"{c:>8.0f}" if c is not None else f"{'-':>8}"
                                        for c in cols))
    layer.close()
    comms[0].group.close()


if __name__ == "__main__":
    main()
