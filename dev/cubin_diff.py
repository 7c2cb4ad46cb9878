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

A kernel in an anonymous namespace (gemm_bench.cu's) is mangled with a hash that differs between two
builds of the same source; it is matched by its demangled name, "(anonymous namespace)::...".
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


def demangle(names):
    """Mangled name -> demangled name with its parameter list (c++filt, one call for all; the name
    itself where c++filt is missing). Kernels in an anonymous namespace are mangled with a hash of
    the translation unit (_GLOBAL__N__<hash>_...), which differs between two builds of the same
    source: their demangled names, "(anonymous namespace)::...", are what matches them."""
    names = list(names)
    try:
        out = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True).stdout.split('\n')
    except OSError:
        out = names
    return {n: (d.strip() or n) for n, d in zip(names, out)}


def short(name):
    """A demangled name without its parameter list (the trailing balanced parentheses)."""
    if not name.endswith(')'):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {')': 1, '(': -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def main():
    args, renames = sys.argv[1:], []
    while len(args) >= 2 and args[0] == '--rename':
        renames.append(args[1].split('=', 1))
        args = args[2:]
    if len(args) < 2 or any(len(r) != 2 for r in renames):
        sys.exit(__doc__)
    first, rest = sections(args[0]), [(p, sections(p)) for p in args[1:]]
    texts = {n for s in [first] + [s for _, s in rest] for n in s if n.startswith('.text.')}
    dm = demangle(sorted(n[6:] for n in texts))
    # demangled name -> .text section, per later cubin: the lookup when the mangled name is not found
    by_name = [(p, {dm[n[6:]]: n for n in s if n.startswith('.text.')}) for p, s in rest]
    bad = 0
    for n in sorted(first):
        if not n.startswith('.text.'):
            continue
        name, tag = dm[n[6:]], ''
        hit = next(((p, s[n]) for p, s in rest if n in s), None)
        if hit is None:  # renamed, or an anonymous namespace's hash
            new = name
            for old, to in renames:
                new = new.replace(old, to)
            hit = next(((p, s[m[new]]) for (p, s), (_, m) in zip(rest, by_name) if new in m), None)
            tag = ' renamed ' + short(new) if hit and new != name else ''
        if hit is None:
            print('MISSING', short(name))
            bad = 1
            continue
        same = hit[1] == first[n]
        bad |= not same
        print('same' if same else 'DIFF', hit[0], short(name), len(first[n]), 'bytes' + tag)
    sys.exit(bad)


if __name__ == '__main__':
    main()
