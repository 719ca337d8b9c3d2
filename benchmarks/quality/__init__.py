"""Quality studies: how well models, kernels and recipes do, each script writing the doc its README names
(benchmarks/quality/README.md)."""
