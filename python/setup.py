"""setup.py — the one build step of the Python package that pyproject.toml cannot declare: put
libmoeflow.so inside the package.

build_py runs `make lib` in the checkout this file sits in (the Makefile builds the CUDA backend
when nvcc is found) and copies build/libmoeflow.so next to moeflow/_lib.py. With MOEFLOW_LIB set
to a library built elsewhere, that file is copied instead and make does not run. The wheel is
tagged for this platform, since it carries a shared library.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

CHECKOUT = Path(__file__).resolve().parent.parent


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        lib = os.environ.get("MOEFLOW_LIB")
        if not lib:
            if not (CHECKOUT / "Makefile").is_file():
                raise RuntimeError(f"moeflow: no Makefile in {CHECKOUT}: install from a checkout "
                                   f"(pip install ./python) or set MOEFLOW_LIB")
            subprocess.run(["make", "-C", str(CHECKOUT), f"-j{os.cpu_count() or 1}", "lib"],
                           check=True)
            lib = CHECKOUT / "build" / "libmoeflow.so"
        target = Path(self.build_lib) / "moeflow"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, target / "libmoeflow.so")


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
