"""Every triton kernel compiles for real GPUs (sm_80 and sm_90, through ptx and cubin), no GPU needed.

The calls compiled are the ones the launchers actually make: each launcher runs on CPU tensors
with its :func:`~circuits.kernels._triton_launch.launch` replaced by a recorder, over shapes
that make it pick every block configuration it can pick, in float32 and float64, with every
feature switch. Each distinct call is typed as triton's JIT types it on a GPU (triton's own
specialiser: constant ones, ``tt.divisibility`` 16 on aligned pointers and on multiples of 16),
and the smallest and largest configuration of every kernel and dtype are compiled again with
every pointer and int divisible and with no hints at all. These are the specialisations that
crashed triton 3.6's GPU passes; a test that stops at Triton IR misses them.

``scripts/triton_compat.sh`` runs this file against several triton releases (3.6 and 3.7, the
versions torch 2.11 and 2.13 pin, and the newest).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from circuits import kernels

triton = pytest.importorskip("triton", reason="triton is not installed")
if kernels.interpreter_enabled():
    pytest.skip("compiling for a GPU needs triton's compiler, not its interpreter",
                allow_module_level=True)

from triton_helpers import Specialization, compile_for_cuda  # noqa: E402

from circuits.kernels import _triton, _triton_softmax  # noqa: E402
from circuits.kernels._triton_launch import KernelLaunch, uses_dot  # noqa: E402

ARCHS = (80, 90)
DTYPES = (torch.float32, torch.float64)
#: sizes that reach every block size of every launcher: 1 (a constant one, the smallest block),
#: 20 (rounded up, not a multiple of 16), 48 and 200 (divisible, and the largest blocks).
SIZES = (1, 20, 48, 200)


@dataclass(frozen=True)
class Case:
    """A distinct call to compile: the launch and how its arguments are specialised."""

    call: KernelLaunch
    specialization: Specialization

    @property
    def name(self) -> str:
        consts = ",".join(f"{k}={int(v)}" for k, v in sorted(self.call.constants.items()))
        dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in self.call.args
                         if isinstance(a, torch.Tensor) and a.is_floating_point()})
        return f"{self.call.kernel.__name__}[{'/'.join(dtypes)},{consts},{self.specialization.value}]"


def _record(run: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> list[KernelLaunch]:
    calls: list[KernelLaunch] = []
    with monkeypatch.context() as patch:
        patch.setattr(_triton, "launch", calls.append)
        patch.setattr(_triton_softmax, "launch", calls.append)
        run()
    return calls


def _launcher_runs(dtype: torch.dtype) -> Iterator[Callable[[], object]]:
    """Every launcher on shapes covering its block choices and feature switches."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=dt)

    for batch, units, width in itertools.product(SIZES, SIZES, SIZES[:3]):
        x, shared, rows = rand(2, batch, width), rand(2, units, width), rand(batch, 2, units, width)
        out, grad = rand(2, batch, units), rand(2, batch, units)
        yield lambda x=x, w=shared: _triton.lse_matmul_shared(x, w)
        yield lambda x=x, w=rows: _triton.lse_matvec_rows(x, w)
        yield lambda x=x, w=shared, o=out, g=grad: _triton.lse_matmul_shared_backward(
            x, w, o, g, x.amax(-1), w.amax(-1), (True, True))
    for batch, width in itertools.product(SIZES, (1, 20, 48, 100, 200)):
        unit = torch.zeros(2, batch, dtype=torch.long)
        uniforms = rand(2, batch, width, dt=torch.float64)
        for logw in (rand(2, 3, width), rand(batch, 2, 3, width)):
            for x in (None, rand(2, batch, width)):
                yield lambda w=logw, u=unit, x=x, r=uniforms: _triton.gumbel_sum_choice(w, u, x, r)
    for rows, categories in itertools.product((1, 20), (1, 20, 48, 100, 200, 300)):
        logits = rand(rows, categories)
        uniforms = rand(rows, categories, dt=torch.float64)
        for draw in (None, uniforms):
            yield lambda x=logits, u=draw: _triton_softmax.softmax_stats(x, None, u)
        for count in (1, 2, 3, 5, 9, 17, 33, 65) if categories == 48 else (1,):
            tokens = torch.zeros(rows, count, dtype=torch.long)
            for draw in (None, uniforms):
                yield lambda x=logits, t=tokens, u=draw: _triton_softmax.softmax_stats(x, t, u)
    for per_set, units, categories in itertools.product(SIZES, (1, 20, 48), (1, 20, 48, 100, 200)):
        weights, table = rand(2, 3 * per_set, units), rand(3, 2, units, categories)
        for lse in (None, rand(3, 2, units)):
            yield lambda w=weights, t=table, n=lse: _triton_softmax.softmax_mixture(w, t, n)


def _key(call: KernelLaunch) -> tuple:
    """Calls with the same key compile to the same binary under the JIT's typing."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    typed = tuple(native_specialize_impl(CUDABackend, a, False, True, True) for a in call.args)
    return call.kernel, typed, tuple(sorted(call.constants.items()))


def _cases(dtype: torch.dtype) -> list[Case]:
    """JIT-typed: one call per block configuration (int constants) of each kernel, and one per
    combination of its feature switches (bool constants); then the extremes of the hints on each
    kernel's smallest and largest configuration."""
    monkeypatch = pytest.MonkeyPatch()
    distinct: dict[tuple, KernelLaunch] = {}
    for run in _launcher_runs(dtype):
        for call in _record(run, monkeypatch):
            distinct.setdefault(_key(call), call)
    chosen: dict[tuple, KernelLaunch] = {}
    for call in distinct.values():
        sizes = tuple(sorted((k, v) for k, v in call.constants.items() if not isinstance(v, bool)))
        switches = tuple(sorted((k, v) for k, v in call.constants.items() if isinstance(v, bool)))
        chosen.setdefault((call.kernel, "sizes", sizes), call)
        chosen.setdefault((call.kernel, "switches", switches), call)
    unique = {id(call): call for call in chosen.values()}
    cases = [Case(call, Specialization.JIT) for call in unique.values()]
    by_kernel: dict[Callable, list[KernelLaunch]] = {}
    for call in unique.values():
        by_kernel.setdefault(call.kernel, []).append(call)
    for calls in by_kernel.values():
        ordered = sorted(calls, key=lambda c: sum(v for v in c.constants.values()
                                                  if not isinstance(v, bool)))
        for call in {id(ordered[0]): ordered[0], id(ordered[-1]): ordered[-1]}.values():
            cases += [Case(call, Specialization.ALL_DIVISIBLE), Case(call, Specialization.PLAIN)]
    return cases


CASES = {dtype: _cases(dtype) for dtype in DTYPES}


def test_the_cases_cover_every_kernel_and_switch() -> None:
    """The recorded calls reach every kernel, both dtypes, and every feature switch both ways."""
    expected = {_triton._lse_matmul_shared_kernel, _triton._lse_matvec_rows_kernel,
                _triton._lse_matmul_grad_x_kernel, _triton._lse_matmul_grad_w_kernel,
                _triton._gumbel_sum_choice_kernel, _triton_softmax._softmax_stats_kernel,
                _triton_softmax._softmax_mixture_kernel}
    for dtype, cases in CASES.items():
        assert {case.call.kernel for case in cases} == expected, dtype
        switches: dict[str, set[bool]] = {}
        for case in cases:
            for name, value in case.call.constants.items():
                if isinstance(value, bool):
                    switches.setdefault(name, set()).add(value)
        assert switches.pop("USE_DOT") == {uses_dot(dtype)}
        assert all(values == {False, True} for values in switches.values()), switches
        assert {case.specialization for case in cases} == set(Specialization)


def test_float64_kernels_never_use_tl_dot() -> None:
    """The routing rule that keeps float64 compilable on triton 3.6 and 3.7: no ``tl.dot``."""
    assert uses_dot(torch.float32) and not uses_dot(torch.float64)
    for case in CASES[torch.float64]:
        assert case.call.constants.get("USE_DOT", False) is False, case.name


def _compile(case: Case, arch: int) -> str | None:
    """``None`` when ``case`` compiles to a cubin for ``sm_{arch}``, else what failed."""
    try:
        compiled = compile_for_cuda(case.call, arch, case.specialization)
    except Exception as error:  # collected: one report names every failing call
        last = str(error).strip().splitlines()[-1:] or [""]
        return f"{case.name}: {type(error).__name__}: {last[0][:200]}"
    if not compiled.asm.get("cubin"):
        return f"{case.name}: no cubin"
    # float32 products run on tl.dot; float64 ones never do (see uses_dot)
    if ("tt.dot" in compiled.asm["ttir"]) != bool(case.call.constants.get("USE_DOT", False)):
        return f"{case.name}: tt.dot in the Triton IR does not follow USE_DOT"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_kernel_call_compiles_to_cubin(dtype: torch.dtype, arch: int) -> None:
    cases = CASES[dtype]
    # compiling is CPU-bound and independent per call: one process per core ("spawn": forking
    # a process that runs torch threads can deadlock)
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failures = [f for f in pool.map(_compile, cases, [arch] * len(cases)) if f is not None]
    assert not failures, (f"triton {triton.__version__}, sm_{arch}: {len(failures)} of "
                          f"{len(cases)} calls fail:\n" + "\n".join(failures))
