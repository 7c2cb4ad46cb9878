#!/usr/bin/env python3
"""cubin_diff.py — compares the kernels (.text.<mangled name> sections: the SASS) of one cubin with
those of one or more others, kernel by kernel, without cuobjdump or nvdisasm (not installed on
every build host). Used to show that a refactor is a pure move (docs: bench/NOTES.md "Issue 14").

    nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Iinclude -Isrc -DMF_WITH_CUDA=1 \\
         -cubin -o before/gemm_tma.cubin src/cuda/gemm_tma.cu     # no -g / -lineinfo
    ... change, build after/ the same way ...
    python3 dev/cubin_diff.py before/gemm_tma.cubin after/gemm_tma.cubin [more.cubin ...]

Prints `same|DIFF <where found> <kernel> <bytes>` per kernel of the first cubin, MISSING when no
later cubin has it; exits 1 on any DIFF or MISSING.

    python3 dev/cubin_diff.py --rename 'OLD=NEW' [--rename ...] before.cubin after.cubin

A kernel whose template parameters were removed has a new mangled name: --rename rewrites the
demangled name of every kernel of the first cubin (plain text substitution, OLD -> NEW) before it is
looked up among the later cubins' demangled names, and the line says `renamed` after the verdict.
E.g. --rename ', true, false, 0>=>' compares sm90_tma_kernel<true, 1, true, false, 0> with
sm90_tma_kernel<true, 1> (the issue 27 move of the lab's parameters out of the TMA kernel).
"""
import struct
import subprocess
import sys


def sections(path):
    d = open(path, 'rb').read()
    shoff = struct.unpack_from('<Q', d, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3A)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shentsize) for i in range(shnum)]
    stro = hdrs[shstrndx][4]
    out = {}
    for h in hdrs:
        name = d[stro + h[0]:d.index(b'\0', stro + h[0])].decode()
        out[name] = d[h[4]:h[4] + h[5]] if h[1] != 8 else b''  # 8: SHT_NOBITS
    return out


def demangle(name):
    try:
        return subprocess.run(['c++filt', name], capture_output=True, text=True).stdout.strip().split('(')[0]
    except OSError:
        return name


def main():
    args, renames = sys.argv[1:], []
    while len(args) >= 2 and args[0] == '--rename':
        renames.append(args[1].split('=', 1))
        args = args[2:]
    if len(args) < 2 or any(len(r) != 2 for r in renames):
        sys.exit(__doc__)
    first, rest = sections(args[0]), [(p, sections(p)) for p in args[1:]]
    # demangled name -> .text section, per later cubin (only needed with --rename)
    by_name = [(p, {demangle(n[6:]): n for n in s if n.startswith('.text.')} if renames else {}) for p, s in rest]
    bad = 0
    for n in sorted(first):
        if not n.startswith('.text.'):
            continue
        name, tag = demangle(n[6:]), ''
        hit = next(((p, s[n]) for p, s in rest if n in s), None)
        if hit is None and renames:
            new = name
            for old, to in renames:
                new = new.replace(old, to)
            hit = next(((p, s[m[new]]) for (p, s), (_, m) in zip(rest, by_name) if new in m), None)
            tag = ' renamed ' + new if hit else ''
        if hit is None:
            print('MISSING', name)
            bad = 1
            continue
        same = hit[1] == first[n]
        bad |= not same
        print('same' if same else 'DIFF', hit[0], name, len(first[n]), 'bytes' + tag)
    sys.exit(bad)


if __name__ == '__main__':
    main()
