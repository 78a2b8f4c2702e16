"""Loop IR and code generators (LLVM via llvmlite, C).

Importing this package loads only the loop IR; the LLVM back end (``apollo_py.codegen.llvm``)
imports llvmlite lazily, on first compile.
"""
from apollo_py.codegen import loopir

__all__ = ["loopir"]
