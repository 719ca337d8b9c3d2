"""Speed and memory benchmarks, each a script run from the repository root:

    python benchmarks/speed/attention.py --help     # attention kernels -> docs/benchmarks.md
    python benchmarks/speed/training.py --help      # one optimizer step -> docs/benchmarks_training.md
    python benchmarks/speed/generation.py --help    # decoding per token -> docs/generation.md
    python benchmarks/speed/embed.py --help         # embedding -> docs/embeddings.md
    python benchmarks/speed/data.py --help          # data preparation and loading -> docs/data_benchmarks.md

Their shared plumbing (child processes, memory probes, timing, markdown, generated docs, the
anchor figures of docs/anchors.md) is :mod:`benchmarks.common`.
"""
