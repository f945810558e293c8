"""A CPU test double of CUDA-graph replay (``torch.compile(mode="reduce-overhead")``) for CI.

Under CUDA graphs a compiled program's outputs are the graph's *static outputs*: storage in the
one memory pool that every compiled program of the device shares (cudagraph trees). In inference
every call of a compiled function starts a new cudagraph-tree generation (dynamo advances its
generation counter on each entry into compiled code; with no backward pending the tree manager
may then start a new generation), and a new generation may reuse the memory of every output of
the previous one. So an output read after any later compiled call, directly or as that call's
input, either raises ``accessing tensor output of CUDAGraphs that has been overwritten by a
subsequent run`` (torch marks the old outputs' storage) or silently reads what a later replay
wrote there (a view the user made of it).

:class:`CudaGraphDouble` is a :class:`~circuits_llm.runtime.compiling.Compiler` whose programs
behave like that, eagerly, on any device:

* every call runs the eager function, then copies its tensor outputs into **persistent buffers**
  of that program (one set per input signature, like one graph per shape, reused at every call:
  static outputs) and hands out aliases of them;
* **every call of any program of the same double** (one double = one shared pool) first
  **poisons every earlier output**: the buffers are filled with NaN (floating point), the most
  negative integer (integers) or their negation (booleans), so that a stale view reads garbage;
  and the handed-out aliases (and the views the caller makes of them) are marked stale, so that
  *any* use of one raises :class:`StaleOutputError` (torch's message). The poisoning happens
  before the program reads its inputs, as in torch, where the generation changes on entry: an
  earlier output passed as an input is a stale read too.

``torch.compiler.cudagraph_mark_step_begin()`` is not emulated because it changes nothing here:
a mark only declares that a new generation begins (the previous outputs may be overwritten); it
never keeps an output alive, and without it inference calls start new generations anyway. So the
double is the worst case torch allows, and code that passes under it reads no compiled output
after a later compiled call.

:meth:`CudaGraphDouble.torch_compile` has ``torch.compile``'s signature, to be patched in for code
that calls ``torch.compile`` itself (the demonstration that the unfixed code fails).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from circuits_llm.runtime.compiling import Compilation

STALE_MESSAGE = "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"


class StaleOutputError(RuntimeError):
    """A compiled program's output was used after a later compiled call (see the module doc)."""


class ReplayOutput(Tensor):
    """An alias of a static output buffer, handed out by one call; any use after a later call of
    any program of the same double raises :class:`StaleOutputError`."""

    _double: CudaGraphDouble
    _generation: int
    _program: str

    def _check(self) -> None:
        double = self.__dict__.get("_double")
        if double is not None and self._generation != double.generation:
            raise StaleOutputError(
                f"{STALE_MESSAGE}: an output of {self._program} (call {self._generation}) was used "
                f"after call {double.generation} ({double.last_program}). To prevent overwriting, "
                "clone the tensor before the next compiled call")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Check every output alias among the arguments, run ``func`` on plain tensors, and hand
        out the views of an alias as aliases (stale with it), other results as plain tensors."""
        kwargs = kwargs or {}
        aliases = [value for value in _leaves((args, kwargs)) if isinstance(value, ReplayOutput)]
        for alias in aliases:
            alias._check()
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            if not aliases:
                return result
            storages = {alias.untyped_storage().data_ptr(): alias for alias in aliases}

            def rewrap(tensor: Tensor) -> Tensor:
                source = None if isinstance(tensor, ReplayOutput) else \
                    storages.get(tensor.untyped_storage().data_ptr())
                if source is None:
                    return tensor
                view = tensor.as_subclass(ReplayOutput)
                view._double, view._generation = source._double, source._generation
                view._program = source._program
                return view

            return _map(result, rewrap)


def _leaves(value: Any) -> list[Any]:
    """Every leaf of nested tuples, lists and dicts (dataclasses too)."""
    if isinstance(value, tuple | list):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [leaf for f in dataclasses.fields(value) for leaf in _leaves(getattr(value, f.name))]
    return [value]


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with every tensor leaf replaced by ``fn(leaf)``, in leaf order (dataclasses too)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(v, fn) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: _map(getattr(value, f.name), fn)
                              for f in dataclasses.fields(value)})
    return value


def _poison(buffer: Tensor) -> None:
    """Overwrite ``buffer`` with values no program computes (what a later replay leaves there)."""
    if buffer.dtype == torch.bool:
        buffer.logical_not_()
    elif buffer.is_floating_point() or buffer.is_complex():
        buffer.fill_(float("nan"))
    else:
        buffer.fill_(torch.iinfo(buffer.dtype).min)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What selects a graph: the shapes and dtypes of the tensor inputs (and the other leaves)."""
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, Tensor) else (type(v).__name__, v)
                 if isinstance(v, bool | int | float | str | None) else type(v).__name__
                 for v in _leaves((args, kwargs)))


class _Replayed:
    """One compiled program of a :class:`CudaGraphDouble`."""

    def __init__(self, double: CudaGraphDouble, fn: Callable[..., Any], name: str) -> None:
        self.double = double
        self.fn = fn
        self.name = name
        #: input signature -> the static output buffers of that "graph"
        self.graphs: dict[tuple[Any, ...], list[Tensor]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        double = self.double
        double.begin(self.name)  # a new generation: every earlier output is overwritten
        out = self.fn(*args, **kwargs)  # the inputs are read now, after the poisoning
        key = _signature(args, kwargs)
        buffers = self.graphs.get(key)
        fresh = buffers is None
        if fresh:
            buffers = self.graphs[key] = []
        index = iter(range(1 << 30))

        def static(tensor: Tensor) -> Tensor:
            i = next(index)
            if fresh:
                buffers.append(torch.empty_like(tensor, memory_format=torch.contiguous_format))
            buffer = buffers[i]
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                raise AssertionError(f"{self.name}: a graph's outputs changed shape or dtype")
            with torch.no_grad():
                buffer.copy_(tensor)
            double.written.append(buffer)
            alias = buffer.as_subclass(ReplayOutput)
            alias._double, alias._generation, alias._program = double, double.generation, self.name
            return alias

        return _map(out, static)


class CudaGraphDouble:
    """A :class:`~circuits_llm.runtime.compiling.Compiler` whose programs behave like CUDA-graph
    replays sharing one memory pool (see the module docstring).

    Attributes:
        generation: how many calls its programs have made (the current generation).
        calls: program name -> number of calls.
        last_program: the name of the program called last.
    """

    def __init__(self) -> None:
        self.generation = 0
        self.calls: Counter[str] = Counter()
        self.last_program = ""
        #: the buffers written since the last call began (poisoned once when the next one begins)
        self.written: list[Tensor] = []

    def __call__(self, fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation:
        return Compilation(_Replayed(self, fn, name), static_outputs=True)

    def torch_compile(self, fn: Callable[..., Any], **_options: Any) -> Callable[..., Any]:
        """Stand-in for ``torch.compile(fn, ...)`` (patched over it): the same replay behaviour."""
        return _Replayed(self, fn, getattr(fn, "__qualname__", repr(fn)))

    def begin(self, program: str) -> None:
        """A call of ``program`` starts: poison every output handed out so far, of every program."""
        with torch.no_grad():
            for buffer in self.written:
                _poison(buffer)
        self.written = []
        self.generation += 1
        self.calls[program] += 1
        self.last_program = program
