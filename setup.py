"""Build syncless._C: C11, the CPython headers and a C compiler; no CUDA toolkit, no torch headers."""
import os
import sys

from setuptools import Extension, setup

SANITIZE = bool(os.environ.get("SYNCLESS_SANITIZE"))

sources = ["module.c", "torch.c", "cuda.c", "metric.c", "ring.c", "events.c", "timer.c"]
flags = ["-std=c11", "-Wall", "-Wextra", "-O2", "-fvisibility=hidden"]
links = ["-ldl", "-pthread"]
if SANITIZE:
    # The test suite runs once under ASan+UBSan in CI (see .ci/run).
    flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
    links += ["-fsanitize=address,undefined"]
elif sys.platform.startswith("linux"):
    # The symbol versions of glibc 2.17 whatever glibc builds it (manylinux2014), with the two
    # libraries that define them there (see the header); no symbol table or debug sections in
    # what a wheel ships.
    flags += ["-include", os.path.join("csrc", "glibc_compat.h")]
    links += ["-s", "-Wl,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0"]

headers = [os.path.join("csrc", h) for h in
           ("syncless.h", "layout.h", "glibc_compat.h", os.path.join("kernels", "gather_ptx.h"))]

setup(
    ext_modules=[
        Extension(
            "syncless._C",
            sources=[os.path.join("csrc", s) for s in sources],
            depends=headers,
            extra_compile_args=flags,
            extra_link_args=links,
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        ),
        # The sync finder (syncless.doctor.audit): CUPTI's callback API, opened at run time.
        Extension(
            "syncless._cupti",
            sources=[os.path.join("csrc", "cupti.c")],
            depends=[os.path.join("csrc", "glibc_compat.h")],
            extra_compile_args=flags,
            extra_link_args=links,
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        ),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
