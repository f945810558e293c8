"""``circuits.learn`` makes every tensor on the model's device (issue 24, item 3), checked on CPU.

A GPU run of ``fit`` crashed in ``prepare_data`` on ``torch.zeros(())`` without ``device=``: a
CPU scalar mixed with CUDA tensors. Without a GPU, :class:`OtherDefaultDevice` makes such a call
fail on the CPU: while it is active, a tensor constructor (``torch.zeros``, ``torch.tensor``,
``torch.arange``, ``torch.randperm``...) called directly from the ``circuits`` package without
``device=`` makes its tensor on the ``meta`` device, as the default device would put it anywhere
but on the model's; any torch call whose tensors then span ``meta`` and another device fails,
naming the line of ``circuits`` that called it, and so does reading a ``meta`` value
(``float()``, ``.item()``). The model and the data stay on the CPU, so everything done right runs
and computes as usual. Torch's own code (an optimiser's step counter) is left alone: on a GPU it
is right there too.

Covered: ``fit`` with EM and with Adam, with missing values, with a validation set, with
checkpoints, for each input family (Categorical, Bernoulli, Binomial, Gaussian) and an
unnormalised circuit (EM's extra ``log Z`` row), EM's statistics and step called directly, and
the data-parallel paths (:class:`OneOfTwo`: every tensor a collective gets is on the model's
device, as ``nccl`` requires). The guard is shown to catch the call that crashed on the GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import compile64
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import circuits
from circuits import Bernoulli, Binomial, Categorical, Exp, Gaussian, region_graphs
from circuits.compiled import CompiledCircuit
from circuits.learn import EM, fit
from circuits.learn.distributed import LearningContext

PACKAGE = str(Path(circuits.__file__).resolve().parent)
META = torch.device("meta")
CPU = torch.device("cpu")

#: the factories that take a device and otherwise use the default one (``*_like`` and
#: ``Tensor.new_*`` follow their input and are not listed)
CONSTRUCTORS = {getattr(torch, name) for name in (
    "arange", "as_tensor", "asarray", "empty", "empty_strided", "eye", "full", "linspace",
    "logspace", "ones", "rand", "randint", "randn", "randperm", "range", "scalar_tensor", "tensor",
    "tril_indices", "triu_indices", "zeros")}


def _circuits_frame(depth: int) -> str | None:
    """``file:line`` of the nearest frame of the circuits package from ``depth`` up, else None."""
    frame = sys._getframe(depth)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            return f"{frame.f_code.co_filename[len(PACKAGE) - len('circuits'):]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class OtherDefaultDevice(TorchFunctionMode):
    """See the module docstring. ``made`` counts the tensors it sent to ``meta``."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        caller = sys._getframe(1).f_code.co_filename
        if func in CONSTRUCTORS and kwargs.get("device") is None and caller.startswith(PACKAGE):
            kwargs["device"] = META
            self.made += 1
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        if META in devices and len(devices) > 1:
            raise AssertionError(
                f"{getattr(func, '__name__', func)} mixes devices {sorted(map(str, devices))} at "
                f"{_circuits_frame(1)}: a tensor was made without device= (on the default device)")
        return func(*args, **kwargs)


def _all_on_cpu(*trees: object) -> None:
    for leaf in tree_leaves(trees):
        if isinstance(leaf, Tensor):
            assert leaf.device.type == "cpu", f"a result is on {leaf.device}"


@dataclass
class OneOfTwo(LearningContext):
    """Rank 0 of 2 in one process: the collectives see this rank alone (the other adds zeros),
    so fit and EM run their data-parallel paths; every tensor they get must be on ``device``."""

    device: torch.device = CPU

    def __post_init__(self) -> None:
        self.rank, self.world_size = 0, 2

    def _check(self, tensors: list[Tensor]) -> None:
        assert all(t.device == self.device for t in tensors), [t.device for t in tensors]

    def all_sum_(self, tensors: list[Tensor]) -> None:
        self._check(tensors)

    def gather_rows(self, tensor: Tensor) -> Tensor:
        self._check([tensor])
        return tensor

    def barrier(self) -> None:
        pass


def make(family: str = "categorical", parameterization: str = "softmax"
         ) -> tuple[CompiledCircuit, Tensor, Tensor]:
    """A tiny CP circuit of the family (4 variables, 2 units), and 12 rows of a source circuit."""
    graph = region_graphs.quad_tree(2, 2)
    distribution = {"categorical": Categorical(3), "bernoulli": Bernoulli(), "binomial": Binomial(3),
                    "gaussian": Gaussian()}[family]
    extra = {"input_parameterization": Exp(), "sum_parameterization": Exp()} \
        if parameterization == "exp" else {}

    def build(seed: int) -> CompiledCircuit:
        return compile64(region_graphs.build_circuit(graph, "cp", 2, 2,
                                                     input_distribution=distribution, **extra),
                         seed=seed)

    data = build(7).sample(16, generator=torch.Generator().manual_seed(1))
    observed = torch.ones_like(data, dtype=torch.bool)
    observed[::3, 1] = False
    observed[1::4, 2] = False
    return build(0), data, observed


def run_fit(model: CompiledCircuit, data: Tensor, observed: Tensor | None, adam: bool,
            valid: bool, **options: Any) -> tuple[list[Tensor], Any]:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05) if adam else \
        EM(model, step_size=0.5, pseudocount=0.01)
    history = fit(model, data[:12], observed=None if observed is None else observed[:12],
                  optimizer=optimizer, epochs=2, batch_size=5, valid=data[12:] if valid else None,
                  valid_observed=None if observed is None or not valid else observed[12:],
                  progress=False, seed=3, **options)
    return [p.detach().clone() for p in model.parameters()], history


CASES = [("categorical", "softmax", False, True, True), ("categorical", "softmax", True, True, True),
         ("categorical", "exp", False, True, False), ("categorical", "exp", True, False, True),
         ("bernoulli", "softmax", False, True, True), ("binomial", "softmax", False, True, True),
         ("binomial", "softmax", True, False, False), ("gaussian", "softmax", False, True, True),
         ("gaussian", "softmax", True, True, True)]


@pytest.mark.parametrize(("family", "parameterization", "adam", "missing", "valid"), CASES)
def test_fit_makes_no_tensor_off_the_model_device(family: str, parameterization: str, adam: bool,
                                                  missing: bool, valid: bool) -> None:
    """Under the guard, ``fit`` computes exactly what it computes without it."""
    model, data, observed = make(family, parameterization)
    expected = run_fit(model, data, observed if missing else None, adam, valid)
    model, data, observed = make(family, parameterization)
    with OtherDefaultDevice():
        got = run_fit(model, data, observed if missing else None, adam, valid)
    _all_on_cpu(got[0])
    for a, b in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[1].train_ll == expected[1].train_ll and got[1].valid_ll == expected[1].valid_ll


def test_fit_with_checkpoint_and_numpy_data_under_the_guard(tmp_path: Path) -> None:
    """Checkpoints (written, then resumed) and numpy data (copied to the model's device)."""
    model, data, observed = make()
    path = tmp_path / "run.ckpt"
    with OtherDefaultDevice():
        fit(model, data[:12].numpy(), observed=observed[:12].numpy(),
            optimizer=EM(model, step_size=0.5), epochs=1, batch_size=5, progress=False,
            checkpoint=path)
        history = fit(model, data[:12].numpy(), observed=observed[:12].numpy(),
                      optimizer=EM(model, step_size=0.5), epochs=2, batch_size=5, progress=False,
                      checkpoint=path)
    assert history.epochs == 2
    _all_on_cpu(list(model.parameters()))


@pytest.mark.parametrize(("family", "adam"), [("categorical", False), ("categorical", True),
                                              ("gaussian", False)])
def test_data_parallel_paths_under_the_guard(family: str, adam: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """EM's all_reduce (counts, rows gathered, the row count) and the summed gradients and
    log-likelihoods of fit: every collective's tensors on the model's device."""
    module = sys.modules["circuits.learn.fit"]  # (circuits.learn.fit is also the function)
    monkeypatch.setattr(module, "learning_context", lambda device: OneOfTwo(device=device))
    model, data, observed = make(family)
    with OtherDefaultDevice():
        parameters, history = run_fit(model, data, observed, adam, valid=True)
    _all_on_cpu(parameters)
    assert len(history.train_ll) == len(history.valid_ll) == 2


# Exp (unnormalised) parameters exist for categorical inputs only: the other families hold their
# own normalised parameters, so they are checked with softmax sum weights.
@pytest.mark.parametrize(("family", "parameterization"), [
    ("categorical", "softmax"), ("categorical", "exp"), ("bernoulli", "softmax"),
    ("binomial", "softmax"), ("gaussian", "softmax")])
def test_em_statistics_and_step_under_the_guard(family: str, parameterization: str) -> None:
    """``accumulate`` (with and without a mask, an empty batch), ``expected_counts``,
    ``state_dict`` / ``load_state_dict`` and ``step`` called directly."""
    model, data, observed = make(family, parameterization)
    em = EM(model, step_size=0.5, pseudocount=0.01)
    reference = EM(make(family, parameterization)[0], step_size=0.5, pseudocount=0.01)
    expected = [reference.accumulate(data[:6], observed[:6]), reference.accumulate(data[6:])]
    reference.step()
    with OtherDefaultDevice():
        got = [em.accumulate(data[:6], observed[:6]), em.accumulate(data[6:])]
        assert em.accumulate(data[:0]).shape == (0,)
        counts = em.expected_counts()
        em.load_state_dict(em.state_dict())
        em.all_reduce(LearningContext())
        em.step()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _all_on_cpu(got, counts, list(model.parameters()))
    for a, b in zip(model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)


def test_the_guard_catches_a_tensor_made_on_the_default_device() -> None:
    """The line that crashed on the GPU, as prepare_data had it: caught on the CPU."""
    x = torch.arange(6).reshape(2, 3)
    mask = x > 2
    namespace: dict[str, Any] = {"torch": torch}
    code = compile("def zero_missing(mask, x):\n"
                   "    return torch.where(mask, x, torch.zeros((), dtype=x.dtype))\n",
                   str(Path(PACKAGE) / "learn" / "data.py"), "exec")  # as if in circuits.learn
    exec(code, namespace)
    guard = OtherDefaultDevice()
    with guard, pytest.raises(AssertionError, match="mixes devices"):
        namespace["zero_missing"](mask, x)
    assert guard.made == 1
    with OtherDefaultDevice():  # the same call outside the package is torch's business
        torch.where(mask, x, torch.zeros((), dtype=x.dtype))


def test_collectives_move_cpu_tensors_to_the_gpu_only_under_nccl() -> None:
    """nccl moves CUDA tensors only: a CPU loss total or row count goes to the rank's GPU first;
    gloo takes every tensor where it is (so CPU runs never touch CUDA)."""
    from circuits.learn.distributed import collective_device

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert collective_device("nccl", cpu, 1) == gpu
    assert collective_device("nccl", gpu, 0) == gpu
    assert collective_device("gloo", cpu, 1) == cpu
    assert collective_device("gloo", gpu, 0) == gpu
