"""Benchmarks of the ``circuits`` library (run ``python -m benchmarks.circuits_bench``)."""
