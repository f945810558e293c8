"""``circuits.learn.fit``: history, early stopping, checkpoints and exact resume, missing values,
any torch optimiser, and one clear error for bad data with the parameters untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from factories import compile64

from circuits import Bernoulli, Exp, Gaussian, InvalidInputError, region_graphs, templates
from circuits.compiled import CompiledCircuit
from circuits.learn import EM, CheckpointError, FitHistory, fit, normalised_log_likelihood


def model_and_data(seed: int = 0, rows: int = 60) -> tuple[CompiledCircuit, torch.Tensor, torch.Tensor]:
    """A small quad-tree CP circuit and rows drawn from a different circuit of the same shape."""
    graph = region_graphs.quad_tree(2, 3)
    source = compile64(region_graphs.build_circuit(graph, "cp", 3, 3, 4), seed=seed + 100)
    data = source.sample(rows + 20, generator=torch.Generator().manual_seed(seed))
    model = compile64(region_graphs.build_circuit(graph, "cp", 3, 3, 4), seed=seed)
    return model, data[:rows], data[rows:]


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- the loop
def test_em_history_and_learning() -> None:
    model, train, valid = model_and_data()
    history = fit(model, train, optimizer=EM(model, step_size=0.5, pseudocount=0.01), epochs=4,
                  batch_size=16, valid=valid, progress=False)
    assert isinstance(history, FitHistory)
    assert len(history.train_ll) == len(history.valid_ll) == len(history.epoch_seconds) == 4
    assert all(s > 0 for s in history.epoch_seconds)
    assert history.train_ll[-1] > history.train_ll[0] + 0.1
    assert history.best_epoch is not None and not history.stopped_early


def test_full_batch_em_first_epoch_reports_the_initial_log_likelihood() -> None:
    model, train, _ = model_and_data()
    with torch.no_grad():
        initial = float(normalised_log_likelihood(model, train).mean())
    history = fit(model, train, optimizer=EM(model, step_size=1.0, pseudocount=0.0), epochs=3,
                  batch_size=len(train), progress=False)
    assert history.train_ll[0] == pytest.approx(initial, rel=1e-12)
    assert history.valid_ll == [] and history.best_epoch is None
    assert history.train_ll[0] <= history.train_ll[1] <= history.train_ll[2]


def test_adam_runs_in_the_same_loop_on_an_unnormalised_circuit() -> None:
    """Any torch optimiser; the objective is the normalised likelihood c(x) / Z."""
    graph = region_graphs.quad_tree(2, 3)
    model = compile64(region_graphs.build_circuit(graph, "cp", 3, 3, 4, input_parameterization=Exp(),
                                                  sum_parameterization=Exp()))
    _, train, valid = model_and_data()
    with torch.no_grad():
        initial = float(normalised_log_likelihood(model, train).mean())
        unnormalised = float(model.log_likelihood(train).mean())
    assert abs(initial - unnormalised) > 0.1  # the test would notice a missing log Z
    history = fit(model, train, optimizer=torch.optim.Adam(model.parameters(), lr=0.05), epochs=5,
                  batch_size=len(train), valid=valid, progress=False)
    assert history.train_ll[0] == pytest.approx(initial, rel=1e-12)
    assert history.train_ll[-1] > history.train_ll[0]


def test_missing_values_train_on_the_marginal_likelihood() -> None:
    model, train, _ = model_and_data()
    observed = torch.from_numpy(np.random.default_rng(0).random(train.shape) < 0.6)
    holes = torch.where(observed, train.double(), torch.nan)  # anything may sit in a hole
    with torch.no_grad():
        initial = float(model.log_marginal(train, observed).mean())
    history = fit(model, holes, observed=observed, optimizer=EM(model, step_size=1.0, pseudocount=0.0),
                  epochs=3, batch_size=len(train), progress=False)
    assert history.train_ll[0] == pytest.approx(initial, rel=1e-12)
    assert history.train_ll[2] >= history.train_ll[1] >= history.train_ll[0]


def test_numpy_data_and_a_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    model, train, valid = model_and_data()
    history = fit(model, train.numpy(), optimizer=EM(model), epochs=2, batch_size=20,
                  valid=valid.numpy(), progress=True)
    assert len(history.train_ll) == 2
    assert "epoch" in capsys.readouterr().err


def test_early_stopping_restores_the_best_parameters() -> None:
    """Training on zeros and validating on ones: validation only gets worse after epoch 0."""
    model, _, _ = model_and_data()
    twin, _, _ = model_and_data()
    train = torch.zeros(30, 6, dtype=torch.long)
    valid = torch.ones(10, 6, dtype=torch.long)
    history = fit(model, train, optimizer=EM(model, step_size=0.5, pseudocount=0.1), epochs=10,
                  batch_size=30, valid=valid, patience=2, progress=False)
    assert history.stopped_early and len(history.train_ll) == 3
    assert history.best_epoch == 0
    assert history.valid_ll[0] > history.valid_ll[1] > history.valid_ll[2]
    fit(twin, train, optimizer=EM(twin, step_size=0.5, pseudocount=0.1), epochs=1, batch_size=30,
        progress=False)
    assert same(parameters(model), parameters(twin))


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kind", ["em", "adam"])
def test_an_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path: Path, kind: str) -> None:
    def optimizer_for(model: CompiledCircuit) -> torch.optim.Optimizer:
        if kind == "em":
            return EM(model, step_size=0.3, pseudocount=0.01)
        return torch.optim.Adam(model.parameters(), lr=0.02)

    model, train, valid = model_and_data()
    full = fit(model, train, optimizer=optimizer_for(model), epochs=5, batch_size=16, valid=valid,
               patience=3, checkpoint=tmp_path / "full.ckpt", progress=False, seed=4)

    interrupted, _, _ = model_and_data()
    optimizer = optimizer_for(interrupted)
    steps = {"count": 0}
    original = optimizer.step

    def crash(*args: object, **kwargs: object) -> object:
        steps["count"] += 1
        if steps["count"] == 11:  # mid-epoch 3 (4 batches per epoch)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    optimizer.step = crash  # type: ignore[method-assign]
    path = tmp_path / "run.ckpt"
    with pytest.raises(KeyboardInterrupt):
        fit(interrupted, train, optimizer=optimizer, epochs=5, batch_size=16, valid=valid, patience=3,
            checkpoint=path, progress=False, seed=4)
    resumed_model, _, _ = model_and_data(seed=9)  # other initial values: the checkpoint decides
    resumed = fit(resumed_model, train, optimizer=optimizer_for(resumed_model), epochs=5,
                  batch_size=16, valid=valid, patience=3, checkpoint=path, progress=False, seed=4)
    assert resumed.train_ll == full.train_ll and resumed.valid_ll == full.valid_ll
    assert resumed.best_epoch == full.best_epoch and len(resumed.epoch_seconds) == 5
    assert same(parameters(resumed_model), parameters(model))


def test_a_finished_run_extends_and_a_second_call_does_nothing_more(tmp_path: Path) -> None:
    model, train, _ = model_and_data()
    path = tmp_path / "run.ckpt"
    fit(model, train, optimizer=EM(model), epochs=2, batch_size=16, checkpoint=path, progress=False)
    longer = fit(model, train, optimizer=EM(model), epochs=3, batch_size=16, checkpoint=path,
                 progress=False)
    assert len(longer.train_ll) == 3
    after = parameters(model)
    again = fit(model, train, optimizer=EM(model), epochs=3, batch_size=16, checkpoint=path,
                progress=False)
    assert again.train_ll == longer.train_ll and same(after, parameters(model))


def test_corrupt_or_foreign_checkpoints_are_refused(tmp_path: Path) -> None:
    model, train, _ = model_and_data()
    path = tmp_path / "run.ckpt"
    fit(model, train, optimizer=EM(model), epochs=1, batch_size=16, checkpoint=path, progress=False)
    before = parameters(model)
    with pytest.raises(CheckpointError, match="batch_size"):
        fit(model, train, optimizer=EM(model), epochs=2, batch_size=8, checkpoint=path, progress=False)
    with pytest.raises(CheckpointError, match="data"):
        fit(model, train[:-1], optimizer=EM(model), epochs=2, batch_size=16, checkpoint=path,
            progress=False)
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="SHA-256"):
        fit(model, train, optimizer=EM(model), epochs=2, batch_size=16, checkpoint=path, progress=False)
    path.write_bytes(bytes(blob[:50]))
    with pytest.raises(CheckpointError, match=str(path)):
        fit(model, train, optimizer=EM(model), epochs=2, batch_size=16, checkpoint=path, progress=False)
    assert same(before, parameters(model))


# --------------------------------------------------------------------------- bad data
def bad_cases(train: torch.Tensor) -> list[tuple[dict[str, object], str]]:
    out_of_range = train.clone()
    out_of_range[3, 4] = 4
    negative = train.clone()
    negative[0, 2] = -1
    nan = train.double()
    nan[5, 1] = torch.nan
    fraction = train.double()
    fraction[2, 0] = 1.5
    return [
        ({"data": out_of_range}, r"data\[3, 4\] = 4 is outside the values of variable 4 \(valid: 0..3\)"),
        ({"data": negative}, r"data\[0, 2\] = -1 is outside the values of variable 2"),
        ({"data": nan}, r"data\[5, 1\] is NaN \(variable 1\)"),
        ({"data": fraction}, r"data\[2, 0\] = 1.5 is not a value of variable 0"),
        ({"data": train[:, :5]}, r"data must have shape \(rows, 6\)"),
        ({"data": train[0]}, r"data must have shape \(rows, 6\)"),
        ({"data": [[0] * 6]}, "torch.Tensor or a numpy array"),
        ({"data": train, "observed": torch.ones(60, 5, dtype=torch.bool)}, "observed mask of data"),
        ({"data": train, "observed": torch.ones(60, 6)}, "must be bool"),
        ({"data": train, "valid": out_of_range[:10]}, r"valid\[3, 4\] = 4 is outside"),
        ({"data": train, "patience": 2}, "needs validation data"),
        ({"data": train, "batch_size": 0}, "batch_size must be an int >= 1"),
        ({"data": train[:0]}, "no rows"),
    ]


def test_bad_data_is_one_clear_error_and_nothing_changes(tmp_path: Path) -> None:
    model, train, _ = model_and_data()
    before = parameters(model)
    for optimizer in (EM(model), torch.optim.Adam(model.parameters(), lr=0.1)):
        for arguments, message in bad_cases(train):
            kwargs: dict[str, object] = {"batch_size": 16, **arguments}
            data = kwargs.pop("data")
            with pytest.raises(InvalidInputError, match=message):
                fit(model, data, optimizer=optimizer, epochs=2, checkpoint=tmp_path / "c.ckpt",
                    progress=False, **kwargs)  # type: ignore[arg-type]
            assert same(before, parameters(model))
            assert not (tmp_path / "c.ckpt").exists()


def test_missing_entries_may_hold_anything() -> None:
    model, train, _ = model_and_data()
    holes = train.double()
    holes[0, 0], holes[1, 1], holes[2, 2] = torch.nan, 99.0, -7.5
    observed = torch.ones_like(train, dtype=torch.bool)
    observed[0, 0] = observed[1, 1] = observed[2, 2] = False
    history = fit(model, holes, observed=observed, optimizer=EM(model), epochs=1, batch_size=16,
                  progress=False)
    assert np.isfinite(history.train_ll[0])


def test_wrong_optimizer_or_model_is_refused() -> None:
    model, train, _ = model_and_data()
    other, _, _ = model_and_data(seed=3)
    with pytest.raises(InvalidInputError, match="another model"):
        fit(model, train, optimizer=EM(other), epochs=1, batch_size=8, progress=False)
    with pytest.raises(InvalidInputError, match=r"torch\.optim\.Optimizer"):
        fit(model, train, optimizer="adam", epochs=1, batch_size=8, progress=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="compiled circuit"):
        fit(torch.nn.Linear(2, 2), train, optimizer=EM(model), epochs=1, batch_size=8,  # type: ignore[arg-type]
            progress=False)


def test_templates_train_with_em_and_adam() -> None:
    """Every template (Softmax) learns with both optimisers in a couple of epochs."""
    rng = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (40, 5), generator=rng)
    x[:, 1] = x[:, 0]
    for name in ("ff", "cp", "hmm", "btree"):
        for make in (lambda m: EM(m, step_size=0.5), lambda m: torch.optim.Adam(m.parameters(), lr=0.1)):
            model = compile64(templates.build(name, 5, 3, rank=1 if name == "ff" else 3))
            history = fit(model, x, optimizer=make(model), epochs=3, batch_size=10, progress=False)
            assert history.train_ll[-1] > history.train_ll[0]


def test_real_valued_and_binary_data() -> None:
    """Gaussian and Bernoulli variables: floats with holes train; bad values are named."""
    distributions = {0: Gaussian(), 1: Bernoulli(), 2: Gaussian(), 3: Bernoulli()}
    circuit = region_graphs.build_circuit(region_graphs.quad_tree(2, 2), "cp", 2, 2,
                                          input_distribution=distributions)
    model = compile64(circuit)
    data = model.sample(30, generator=torch.Generator().manual_seed(0))
    observed = torch.from_numpy(np.random.default_rng(1).random(data.shape) < 0.8)
    holes = torch.where(observed, data, torch.nan)
    history = fit(model, holes, observed=observed, optimizer=EM(model, step_size=1.0), epochs=3,
                  batch_size=30, progress=False)
    assert history.train_ll[2] >= history.train_ll[0]
    before = parameters(model)
    binary = data.clone()
    binary[4, 3] = 2.0
    with pytest.raises(InvalidInputError, match=r"data\[4, 3\] = 2.0 is outside the values of variable 3"):
        fit(model, binary, optimizer=EM(model), epochs=1, batch_size=8, progress=False)
    row, col = (int(i) for i in (~observed).nonzero()[0])
    with pytest.raises(InvalidInputError, match=rf"data\[{row}, {col}\] is NaN \(variable {col}\)"):
        fit(model, holes, optimizer=EM(model), epochs=1, batch_size=8, progress=False)
    assert same(before, parameters(model))
