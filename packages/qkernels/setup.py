"""Build of the C++ extension: needs a C++17 compiler and jaxlib's FFI headers."""

from pathlib import Path

import jaxlib
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "qkernels._native",
            sources=["src/qkernels/_native.cc", "src/qkernels/_int8_gemm.cc"],
            depends=["src/qkernels/_runtime.h"],
            include_dirs=[str(Path(jaxlib.__file__).parent / "include")],
            language="c++",
            # No -march: the AVX2 code is chosen at run time, so the build runs anywhere.
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off"],
        )
    ]
)
