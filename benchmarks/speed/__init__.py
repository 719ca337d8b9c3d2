"""Speed benchmarks: time and memory, each script writing the doc its README names (benchmarks/speed/README.md)."""
