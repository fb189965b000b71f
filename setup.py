"""The one compiled part of loaderd: the cache-hit copy (``loaderd/gather_rows.c``).

Everything else is in pyproject.toml. The library is plain C, loaded with ctypes
(``loaderd/row_copy.py``): it needs a C compiler, not Python's headers. Where it cannot be
built, the install goes on and batches are copied from Python, more slowly.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "loaderd._gather_rows",
            ["loaderd/gather_rows.c"],
            extra_compile_args=["-O2", "-Wall"],  # warnings do not fail a user's install
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
