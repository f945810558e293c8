"""Learning circuits from data: expectation-maximisation and a training loop.

* :class:`EM`: expectation-maximisation as a :class:`torch.optim.Optimizer` over a compiled
  circuit (classical with ``step_size=1`` on the full data, mini-batch below): the parameters move
  toward the estimates computed from the circuit's flows (:mod:`circuits.learn.flows`), one
  forward and one top-down pass per batch, on every parameterisation.
* :func:`fit`: the loop for EM and any torch optimiser: shuffled batches, train and validation
  log-likelihoods per epoch (:class:`FitHistory`), early stopping, a progress bar, verified
  checkpoints and exact resume, missing values (``observed=``), and data parallelism under
  ``torchrun``.

Example::

    import circuits
    from circuits import learn
    from circuits.region_graphs import build_circuit, quad_tree

    model = circuits.compile(build_circuit(quad_tree(8, 8), "cp", 32, 32, num_categories=17))
    history = learn.fit(model, train, optimizer=learn.EM(model, step_size=0.1, pseudocount=0.01),
                        epochs=20, batch_size=100, valid=test)
"""

from circuits.learn.checkpoint import CheckpointError
from circuits.learn.em import EM
from circuits.learn.fit import FitHistory, fit, normalised_log_likelihood

__all__ = ["EM", "CheckpointError", "FitHistory", "fit", "normalised_log_likelihood"]
