"""The examples run and pass on the CPU: exit 0 and print PASS (examples/vllm_layer.py only where
vLLM is installed; CI installs it)."""
import importlib.util
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
HAS_VLLM = importlib.util.find_spec("vllm") is not None or os.environ.get("MOEFLOW_REQUIRE_VLLM") == "1"


@pytest.mark.parametrize("script,args", [
    ("layer.py", ["-T", "8"]),
    ("dispatch_combine.py", ["-T", "5"]),
    ("distributed.py", ["-T", "3"]),
    pytest.param("vllm_layer.py", ["-T", "4"],
                 marks=pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM 0.33")),
])
def test_examples_run_and_pass(script, args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--backend", "cpu", *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
