"""loaderd's two compiled parts, each a loop over a batch's records.

- ``loaderd/gather_rows.c``: the cache-hit copy (loaded by ``loaderd/row_copy.py``);
- ``storage/read_rows.c``: a miss worker's reads and hashes (``storage/row_reads.py``).

Everything else is in pyproject.toml. Both are plain C, loaded with ctypes: they need a C
compiler, not Python's headers. Where one cannot be built, the install goes on and its loop
runs in Python, more slowly.
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
        ),
        Extension(
            "loaderd.storage._read_rows",
            ["storage/read_rows.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ]
)
