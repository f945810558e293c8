"""One-off measurements behind docs/journal.md (run ``python -m experiments.<name>``; see README.md).

What users run (the circuits, decoder, learning, kernels and constrained benchmarks, the head
study, the GPU check) lives in :mod:`benchmarks`.
"""
