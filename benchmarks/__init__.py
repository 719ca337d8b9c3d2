"""Benchmarks, scripts run from the repository root, grouped by purpose (benchmarks/README.md):
:mod:`benchmarks.speed` (time and memory) and :mod:`benchmarks.quality` (how well); their shared
plumbing is :mod:`benchmarks.common`."""
