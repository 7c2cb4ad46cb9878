#!/usr/bin/env bash
# tests/gpu/sanitize.sh TOOL LOG CMD... — runs CMD under `compute-sanitizer --tool TOOL` (make test-gpu).
# Passes when the sanitizer reports no error and CMD succeeds; any sanitizer error fails at once.
#
# Under the sanitizer a kernel launch may block until earlier kernels finish, so a virtual rank's
# spinning wait can sit in front of a peer's arrival until the library's timeout fires
# (MF_ERR_TIMEOUT; docs/API.md, "Virtual ranks"). Such an attempt, with an error-free sanitizer
# report, is printed and retried, up to 3 attempts: it says nothing about memory safety, which is
# what this step checks.
set -u
tool=$1 log=$2
shift 2
for attempt in 1 2 3; do
    if compute-sanitizer --tool "$tool" --error-exitcode 1 "$@" > "$log" 2>&1; then
        tail -1 "$log"
        exit 0
    fi
    if grep -q "ERROR SUMMARY: 0 errors" "$log" && grep -q "MF_ERR_TIMEOUT" "$log"; then
        echo "sanitize.sh: $tool attempt $attempt: a virtual-rank wait timed out under the sanitizer, no memory error; retrying"
        grep -m1 "MF_ERR_TIMEOUT" "$log"
        continue
    fi
    tail -30 "$log"
    exit 1
done
echo "sanitize.sh: $tool: every attempt timed out (log: $log)"
exit 1
