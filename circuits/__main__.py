"""``python -m circuits demo``: build, check, compile, query and sample a BTree circuit."""

from __future__ import annotations

import argparse
import time

import torch

import circuits
from circuits import templates


def demo(num_variables: int = 16, rank: int = 32, num_categories: int = 256) -> None:
    circuit = templates.build("btree", num_variables=num_variables, rank=rank,
                              num_categories=num_categories)
    print(f"built    {circuit}")
    circuits.check(circuit)
    print(f"checked  smooth={circuits.is_smooth(circuit)} "
          f"decomposable={circuits.is_decomposable(circuit)} "
          f"structured={circuits.is_structured_decomposable(circuit)}")
    compiled = circuits.compile(circuit, dtype=torch.float64)
    print(f"compiled {len(compiled.plans)} folds; parameter shapes {compiled.parameter_shapes()}")
    generator = torch.Generator().manual_seed(0)
    samples = compiled.sample(4, generator)
    print(f"log Z    {compiled.log_partition().item():+.3e} (normalised circuit: 0)")
    print(f"samples  {samples.tolist()}")
    print(f"log p    {compiled.log_likelihood(samples).tolist()}")
    observed = torch.zeros(num_variables, dtype=torch.bool)
    observed[: num_variables // 2] = True
    marginal = compiled.log_marginal(samples, observed)
    print(f"log p(first half) {marginal.tolist()}")
    conditional = compiled.log_conditional(samples[:1], observed, [num_variables // 2])
    print(f"p(x_{num_variables // 2} | first half) sums to {conditional.exp().sum().item():.12f}")
    completed = compiled.conditional_sample(samples[:1].repeat(3, 1), observed, generator)
    print(f"conditional samples (first half fixed) {completed.tolist()}")
    state, value = compiled.map_state()
    print(f"max-product state {state.tolist()} log-value {value.item():.4f}")
    batch = torch.randint(0, num_categories, (256, num_variables), generator=generator)
    start = time.perf_counter()
    for _ in range(10):
        compiled.log_likelihood(batch)
    elapsed = (time.perf_counter() - start) / 10
    print(f"log-likelihood of 256 rows: {elapsed * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m circuits")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("demo", help="build, check, compile, query and sample a BTree circuit")
    run.add_argument("--num-variables", type=int, default=16)
    run.add_argument("--rank", type=int, default=32)
    run.add_argument("--num-categories", type=int, default=256)
    args = parser.parse_args()
    demo(args.num_variables, args.rank, args.num_categories)


if __name__ == "__main__":
    main()
