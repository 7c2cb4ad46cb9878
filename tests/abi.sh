#!/usr/bin/env bash
# tests/abi.sh LIB HEADER — the dynamic symbols LIB defines are exactly the functions HEADER
# declares with MF_API (hidden visibility and src/moeflow.map keep everything else local).
set -euo pipefail
lib=${1:?usage: tests/abi.sh LIB HEADER}
header=${2:?usage: tests/abi.sh LIB HEADER}
declared=$(grep -oE '^MF_API [^(]*\bmf_[a-z0-9_]+\(' "$header" | grep -oE 'mf_[a-z0-9_]+\($' | tr -d '(' | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//' | grep -v '^MOEFLOW_' | sort -u)
if [ "$declared" != "$exported" ]; then
    echo "abi: $lib exports differ from $header's MF_API functions:"
    diff <(echo "$declared") <(echo "$exported") | sed 's/^/abi:   /'
    exit 1
fi
echo "abi: $lib exports the $(echo "$declared" | wc -l) MF_API functions of $header, nothing else"
# No process-wide side effects (issue 13): the library sets no environment variable and never
# synchronises the whole device.
bad=$(nm -D --undefined-only "$lib" | awk '{print $2}' | sed 's/@.*//' | grep -xE 'setenv|putenv|unsetenv|cudaDeviceSynchronize|cudaDeviceReset' || true)
if [ -n "$bad" ]; then
    echo "abi: $lib calls what a library must not: $bad"
    exit 1
fi
echo "abi: $lib imports no setenv / putenv / cudaDeviceSynchronize / cudaDeviceReset"
# And its kernels never trap (a trap kills every rank's context), where cuobjdump can tell.
if command -v cuobjdump >/dev/null 2>&1 && cuobjdump -sass "$lib" >/dev/null 2>&1; then
    if cuobjdump -sass "$lib" | grep -qE '\bBPT\.TRAP\b'; then
        echo "abi: $lib has a trap in its device code"
        exit 1
    fi
    echo "abi: $lib's device code has no trap"
fi
