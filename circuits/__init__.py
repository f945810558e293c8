"""circuits: probabilistic circuits with a symbolic IR, structural checks and exact torch queries.

Layers of the library, from the bottom up:

* :mod:`circuits.symbolic`: the IR (input, sum and product layers over scoped variables; input
  families Categorical, Bernoulli, Binomial and Gaussian);
* :mod:`circuits.region_graphs`: region graphs and circuits built from them;
* :mod:`circuits.templates`: named architectures (FF, CP, HMM, BTree) by name or function;
* :mod:`circuits.structure`: smoothness, decomposability, structured decomposability, compatibility;
* :mod:`circuits.operations`: product of compatible circuits, symbolic integration;
* :mod:`circuits.compiled`: folded torch modules and the exact queries;
* :mod:`circuits.learn`: EM and the training loop ``fit``;
* :mod:`circuits.plotting`: ``circuits.plot``, pictures of region graphs and circuits.
"""

from circuits import learn
from circuits.compiled import CompiledCircuit, ParameterSpec, Semiring, compile
from circuits.errors import (
    CircuitError,
    InvalidInputError,
    InvalidParameterError,
    ParameterProblem,
    RegionGraphError,
    SerializationError,
    StructureError,
    UnknownArchitectureError,
    ZeroProbabilityEvidenceError,
)
from circuits.operations import integrate, multiply, snapshot, square
from circuits.parameterizations import Exp, Native, Parameterization, Softmax
from circuits.plotting import plot
from circuits.serialization import circuit_from_dict, circuit_to_dict, load_circuit, save_circuit
from circuits.structure import are_compatible, check, is_decomposable, is_smooth, is_structured_decomposable
from circuits.symbolic import (
    Bernoulli,
    Binomial,
    Categorical,
    Circuit,
    Gaussian,
    InputDistribution,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    SumLayer,
)

__all__ = [
    "Bernoulli",
    "Binomial",
    "Categorical",
    "Circuit",
    "CircuitError",
    "CompiledCircuit",
    "Exp",
    "Gaussian",
    "InputDistribution",
    "InputLayer",
    "InvalidInputError",
    "InvalidParameterError",
    "Layer",
    "Native",
    "ParameterProblem",
    "ParameterSpec",
    "Parameterization",
    "ProductKind",
    "ProductLayer",
    "RegionGraphError",
    "Semiring",
    "SerializationError",
    "Softmax",
    "StructureError",
    "SumLayer",
    "UnknownArchitectureError",
    "ZeroProbabilityEvidenceError",
    "are_compatible",
    "check",
    "circuit_from_dict",
    "circuit_to_dict",
    "compile",
    "integrate",
    "is_decomposable",
    "is_smooth",
    "is_structured_decomposable",
    "learn",
    "load_circuit",
    "multiply",
    "plot",
    "save_circuit",
    "snapshot",
    "square",
]
