"""``circuits.learn.fit`` data-parallel: 2 CPU processes (gloo) against one process.

Each rank runs with the environment ``torchrun`` gives it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...), so ``fit`` initialises and ends the process group itself. Every rank shuffles
identically, reads its share of each batch (uneven shares included: batches
of 7 rows over 2 ranks) and the EM statistics or gradients are summed before each step, so the
two-process run takes the steps of the one-process run up to the order of floating-point sums
(float64 here: equal to 1e-10). A run that forgot to reduce would see half the data per step and
differ by far more; the negative control shows it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from factories import compile64

from circuits import Gaussian, region_graphs
from circuits.compiled import CompiledCircuit
from circuits.learn import EM, fit

ROWS, BATCH, EPOCHS = 40, 7, 2


KINDS = ("em", "adam", "gaussian")


def make(kind: str = "em") -> tuple[CompiledCircuit, torch.Tensor, torch.Tensor]:
    """A quad-tree CP circuit (categorical, or Gaussian: EM through the family's em_estimate,
    whose rows are gathered from every rank) and data drawn from another of the same shape."""
    graph = region_graphs.quad_tree(2, 2)
    family = {"input_distribution": Gaussian()} if kind == "gaussian" else {"num_categories": 3}
    source = compile64(region_graphs.build_circuit(graph, "cp", 3, 3, **family), seed=5)
    data = source.sample(ROWS + 10, generator=torch.Generator().manual_seed(1))
    observed = torch.ones_like(data, dtype=torch.bool)
    observed[::3, 1] = False  # missing values travel too
    return compile64(region_graphs.build_circuit(graph, "cp", 3, 3, **family), seed=0), data, observed


def optimizer_for(kind: str, model: CompiledCircuit) -> torch.optim.Optimizer:
    if kind in ("em", "gaussian"):
        return EM(model, step_size=0.4, pseudocount=0.01)
    return torch.optim.Adam(model.parameters(), lr=0.05)


def train(kind: str) -> tuple[list[torch.Tensor], list[float], list[float]]:
    model, data, observed = make(kind)
    history = fit(model, data[:ROWS], observed=observed[:ROWS], optimizer=optimizer_for(kind, model),
                  epochs=EPOCHS, batch_size=BATCH, valid=data[ROWS:], progress=False, seed=3)
    return [p.detach().clone() for p in model.parameters()], history.train_ll, history.valid_ll


def worker(rank: int, port: int, out: str) -> None:
    """One rank with the environment torchrun gives it: the first fit makes the process group,
    the later ones join it (it lives until the process exits)."""
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    results = {kind: train(kind) for kind in KINDS}
    assert dist.is_initialized() and dist.get_world_size() == 2
    torch.save(results, f"{out}.{rank}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_processes_take_the_steps_of_one(tmp_path: Path) -> None:
    out = str(tmp_path / "result")
    mp.spawn(worker, args=(free_port(), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1)]
    for kind in KINDS:
        single, train_ll, valid_ll = train(kind)
        for rank in ranks:
            parallel, parallel_train, parallel_valid = rank[kind]
            for a, b in zip(parallel, single, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(torch.tensor(parallel_train), torch.tensor(train_ll))
            torch.testing.assert_close(torch.tensor(parallel_valid), torch.tensor(valid_ll))
        # the replicas are bit-for-bit identical: every rank took the same step
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][kind][0], ranks[1][kind][0], strict=True))


def test_half_the_data_per_step_is_far_from_the_whole() -> None:
    """Negative control: what a rank would compute without the all-reduce."""
    single, _, _ = train("em")
    model, data, observed = make()
    half = torch.arange(ROWS) % 2 == 0
    fit(model, data[:ROWS][half], observed=observed[:ROWS][half], optimizer=optimizer_for("em", model),
        epochs=EPOCHS, batch_size=BATCH // 2, progress=False, seed=3)
    assert max(float((a.detach() - b).abs().max())
               for a, b in zip(model.parameters(), single, strict=True)) > 1e-3
