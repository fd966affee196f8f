"""Build syncless._C: C11, the CPython headers and a C compiler; no CUDA toolkit, no torch headers."""
import os

from setuptools import Extension, setup

sources = ["module.c", "torch.c", "cuda.c", "metric.c", "ring.c", "events.c", "timer.c"]
flags = ["-std=c11", "-Wall", "-Wextra", "-O2", "-fvisibility=hidden"]
if os.environ.get("SYNCLESS_SANITIZE"):
    # The test suite runs once under ASan+UBSan in CI (see .ci/run).
    flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]

setup(
    ext_modules=[
        Extension(
            "syncless._C",
            sources=[os.path.join("csrc", s) for s in sources],
            depends=[os.path.join("csrc", "syncless.h"), os.path.join("csrc", "layout.h"),
                     os.path.join("csrc", "kernels", "gather_ptx.h")],
            extra_compile_args=flags,
            extra_link_args=["-ldl"] + (["-fsanitize=address,undefined"] if os.environ.get("SYNCLESS_SANITIZE") else []),
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        ),
        # The sync finder (syncless.doctor.audit): CUPTI's callback API, opened at run time.
        Extension(
            "syncless._cupti",
            sources=[os.path.join("csrc", "cupti.c")],
            extra_compile_args=flags,
            extra_link_args=["-ldl", "-pthread"] + (["-fsanitize=address,undefined"] if os.environ.get("SYNCLESS_SANITIZE") else []),
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        ),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
