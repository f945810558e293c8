"""The compiled (torch) layer of the library: folded modules and the queries that run on them."""

from circuits.compiled.circuit import CompiledCircuit, compile
from circuits.compiled.core import CircuitCore, ParameterSpec
from circuits.compiled.folding import FoldKind
from circuits.compiled.layers import Semiring
from circuits.compiled.prepared import LogParameters, Trace

__all__ = ["CircuitCore", "CompiledCircuit", "FoldKind", "LogParameters", "ParameterSpec", "Semiring",
           "Trace", "compile"]
