"""The compiled (torch) layer of the library: folded modules and the queries that run on them."""

from circuits.compiled.circuit import CompiledCircuit, LogParameters, ParameterSpec, compile
from circuits.compiled.folding import FoldKind
from circuits.compiled.layers import Semiring

__all__ = ["CompiledCircuit", "FoldKind", "LogParameters", "ParameterSpec", "Semiring", "compile"]
