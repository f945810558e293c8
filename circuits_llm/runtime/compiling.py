"""Compiled programs: one seam for the compiler, outputs owned by the caller, a loud fall back.

Every program ``circuits_llm`` compiles (the round's draft and accept programs,
:mod:`circuits_llm.decoding.round`; the backbone's step per block length,
:mod:`circuits_llm.backbone._static`) goes through :class:`CompiledProgram`, which does three
things once for all of them:

**The compiler is a seam.** A :class:`Compiler` turns an eager callable into a
:class:`Compilation`. The default, :func:`torch_compiler`, is ``torch.compile(fullgraph=True,
dynamic=False)``, with ``mode="reduce-overhead"`` (CUDA graphs) on CUDA. :func:`use_compiler`
swaps it for the programs built inside a ``with`` block: the tests run the compiled paths on the
CPU through a double that behaves like CUDA-graph replay (``tests/cuda_graph_double.py``), or
through a compiler that fails.

**Outputs are the caller's.** Under CUDA graphs a program's outputs are the graph's static
outputs, in the memory pool that every compiled program of the device shares (cudagraph trees).
In inference (no backward pending) every call of a compiled function starts a new cudagraph-tree
generation (dynamo advances its generation counter on each entry into compiled code), and a new
generation may reuse the memory of *every* output of the previous one, whichever program made
it. Reading such an output afterwards, directly or as the input of the next program, raises
"accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run", or, after
a replay, silently reads what a later graph wrote. ``torch.compiler.cudagraph_mark_step_begin()``
is no remedy: it only declares that a new generation begins (permission to overwrite); it never
keeps an output alive. So when a compilation has static outputs (:attr:`Compilation.static_outputs`),
:class:`CompiledProgram` clones every tensor output before it returns: no graph-owned tensor ever
reaches the caller, and any later call may overwrite the pool. The programs return few, small
tensors (the round's draft: 3, its accept: 1; the backbone's step: logits and hidden states), so
this costs a few device copies per round.

**A refused program runs eager, once, loudly.** ``torch.compile`` is lazy: Inductor refuses a
program (e.g. ``InductorError: NotImplementedError: NYI TritonSplitDimKernel reductions``) at the
call that compiles it (its first call, or one that recompiles it), which is where
:class:`CompiledProgram` catches it. A :class:`torch._dynamo.exc.BackendCompilerFailed` (Inductor's
errors are ones) is raised while compiling, before the graph ran, so running the same arguments
eagerly is exact and safe even for a step that updates caches in place. The program (or one
*variant* of it, e.g. one block length of the backbone's step) then runs eager for good, after one
:class:`CompileFallbackWarning` that names it and the error; :func:`compile_fallbacks` lists every
fall back of the process (the benchmarks record them). Nothing else falls back: a tracing failure
(dynamo's ``Unsupported``, a graph break under ``fullgraph=True``) is a bug of the traced code, and
an error raised while the graph runs may have run part of it.
"""

from __future__ import annotations

import contextvars
import types
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

__all__ = [
    "Compilation",
    "CompileFallback",
    "CompileFallbackWarning",
    "CompiledProgram",
    "Compiler",
    "compile_fallbacks",
    "current_compiler",
    "owned",
    "private_copy",
    "torch_compiler",
    "use_compiler",
]

R = TypeVar("R")


class CompileFallbackWarning(RuntimeWarning):
    """The compiler refused a program: it runs eager from now on (the message names it and why)."""


@dataclass(frozen=True)
class Compilation:
    """What a :class:`Compiler` makes of an eager callable.

    Attributes:
        fn: the compiled callable (compilation may happen lazily, at its first call).
        static_outputs: its outputs live in storage the compiled code reuses at later calls of
            any compiled program (CUDA graphs), so the caller copies them out at once.
    """

    fn: Callable[..., Any]
    static_outputs: bool


class Compiler(Protocol):
    """Turns the eager callable of the program ``name`` that runs on ``device`` into a
    :class:`Compilation`."""

    def __call__(self, fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation: ...


def torch_compiler(fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation:
    """``torch.compile`` whole-graph with static shapes; on CUDA ``mode="reduce-overhead"`` (CUDA
    graphs, whose outputs are static). ``fullgraph``: a program that cannot be traced as one graph
    is an error, never a silent fall back to eager pieces. ``name`` is unused."""
    cuda = device.type == "cuda"
    compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                             mode="reduce-overhead" if cuda else None)
    return Compilation(compiled, static_outputs=cuda)


_COMPILER: contextvars.ContextVar[Compiler | None] = contextvars.ContextVar(
    "circuits_llm_compiler", default=None)


def current_compiler() -> Compiler:
    """The compiler programs built now use: the innermost :func:`use_compiler`, else
    :func:`torch_compiler`."""
    return _COMPILER.get() or torch_compiler


@contextmanager
def use_compiler(compiler: Compiler) -> Iterator[Compiler]:
    """Build compiled programs with ``compiler`` inside a ``with`` block (thread- and task-local,
    nestable). A program keeps the compiler it was built with; a decoder takes the one current when
    it is built, for its backbone and its round programs."""
    token = _COMPILER.set(compiler)
    try:
        yield compiler
    finally:
        _COMPILER.reset(token)


@dataclass(frozen=True)
class CompileFallback:
    """One program (variant) the compiler refused, which runs eager since.

    Attributes:
        program: the program's name, with its variant (e.g. a block length) when it has one.
        error: the compiler's error, ``"Type: first line"``.
    """

    program: str
    error: str


_FALLBACKS: list[CompileFallback] = []


def compile_fallbacks() -> tuple[CompileFallback, ...]:
    """Every fall back of this process so far, in order (slice from an earlier length to get those
    of one run)."""
    return tuple(_FALLBACKS)


def owned(value: R) -> R:
    """``value`` with every tensor replaced by a copy: tensors, ``None``, numbers and strings, and
    tuples, lists and dicts of them (anything else is a :class:`TypeError`, never a silent leak of
    a graph-owned tensor)."""
    if isinstance(value, Tensor):
        return value.clone()  # type: ignore[return-value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        items = [owned(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # type: ignore[return-value]
    if isinstance(value, list):
        return [owned(v) for v in value]  # type: ignore[return-value]
    if isinstance(value, dict):
        return {k: owned(v) for k, v in value.items()}  # type: ignore[return-value]
    raise TypeError(f"a compiled program with static outputs returned a {type(value).__name__}: "
                    "return tensors, or tuples, lists or dicts of them")


_copies = count()


def private_copy(method: Callable[..., R]) -> Callable[..., R]:
    """A bound ``method`` with a private copy of its function's code object, to hand to the
    compiler (:class:`CompiledProgram`'s ``target``): Dynamo keeps compiled graphs, and counts
    recompilations against ``recompile_limit``, per code object, so without the copy every
    instance of the class in the process (every backbone, every draft block) would share one
    budget of graphs."""
    fn = method.__func__  # type: ignore[attr-defined]
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class CompiledProgram(Generic[R]):
    """An eager callable run compiled, with its outputs copied out of static storage and a per
    variant fall back to eager when the compiler refuses it (see the module docstring).

    Args:
        eager: the program as plain Python; also what runs after a fall back.
        name: names the program in warnings and :func:`compile_fallbacks`.
        device: where it runs (the default compiler picks CUDA graphs on CUDA).
        compiler: ``None``: :func:`current_compiler` at construction.
        target: what is handed to the compiler, when not ``eager`` itself (e.g. a copy of it with
            a private code object); it must compute what ``eager`` computes.
        variant: the call's arguments -> a label of the compiled specialisation they select (e.g.
            ``"batch 1, 4 tokens"``); each variant falls back on its own. ``None``: one variant.
    """

    def __init__(self, eager: Callable[..., R], *, name: str, device: torch.device,
                 compiler: Compiler | None = None, target: Callable[..., R] | None = None,
                 variant: Callable[..., Hashable] | None = None) -> None:
        self.eager = eager
        self.name = name
        compilation = (compiler or current_compiler())(target or eager, name=name, device=device)
        self._compiled: Callable[..., R] = compilation.fn
        self.static_outputs = compilation.static_outputs
        self._variant = variant
        #: variant -> why it runs eager
        self.fallbacks: dict[Hashable, str] = {}

    def label(self, variant: Hashable) -> str:
        """The program's name with ``variant``."""
        return self.name if variant is None else f"{self.name} [{variant}]"

    def __call__(self, *args: Any) -> R:
        variant = None if self._variant is None else self._variant(*args)
        if variant in self.fallbacks:
            return self.eager(*args)
        try:
            out = self._compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            return self._fall_back(variant, error, args)
        return owned(out) if self.static_outputs else out

    def _fall_back(self, variant: Hashable, error: BaseException, args: tuple[Any, ...]) -> R:
        why = _first_line(error)
        self.fallbacks[variant] = why
        program = self.label(variant)
        _FALLBACKS.append(CompileFallback(program, why))
        warnings.warn(f"the compiler refused {program}; it runs eager from now on: {why}",
                      CompileFallbackWarning, stacklevel=3)
        return self.eager(*args)
