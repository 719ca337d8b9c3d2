"""keep_freed_memory: a freed 64 MiB block's memory serves the next request instead of being
unmapped (or trimmed off the heap's top) and page-faulted in again. Counted with getrusage's minor
faults, against what glibc's defaults fault for the same request in a fresh process."""
import json
import re
import subprocess
import sys

import pytest

from protein_performer.allocator import IS_GLIBC

PROBE = """
import json, resource, sys
import numpy as np
import torch
from protein_performer.allocator import keep_freed_memory
mode, pattern = sys.argv[1:]
applied = keep_freed_memory() if mode == "keep" else False
def touch():
    if pattern == "settled":  # torch's aligned requests, after the heap has settled at a few freed blocks
        torch.empty(16 * 2 ** 20, dtype=torch.float32).fill_(1.0)
    else:  # "top": numpy's plain malloc, one block at the heap's top, freed (the default trim returns it)
        np.ones(16 * 2 ** 20, dtype=np.float32)
for _ in range(10 if pattern == "settled" else 1):
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "pages": 64 * 2 ** 20 // resource.getpagesize()}))
"""


def probe(mode: str, pattern: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, pattern], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not IS_GLIBC, reason="glibc malloc only")
def test_keep_freed_memory_reuses_large_blocks():
    system, keep = probe("system", "settled"), probe("keep", "settled")
    assert system["faults"] >= 0.9 * system["pages"]  # glibc's default: a fresh mmap, every page faulted again
    assert keep["applied"] is True
    assert keep["faults"] < 0.1 * keep["pages"]  # a freed block served the request


@pytest.mark.skipif(not IS_GLIBC, reason="glibc malloc only")
def test_keep_freed_memory_keeps_the_heap_top():
    system, keep = probe("system", "top"), probe("keep", "top")
    assert system["faults"] > 100  # faulted in again (huge pages may make it fewer than 64 MiB / 4 KiB)
    assert keep["faults"] < 0.1 * system["faults"]  # not trimmed: the same memory served it


def test_train_refuses_an_unknown_malloc_setting():
    from omegaconf import OmegaConf

    from protein_performer.errors import UserError
    from protein_performer.training.run import check_settings

    cfg = OmegaConf.create({"model": {"name": "performer"}, "objective": {"name": "mlm"},
                            "optim": {"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 0.1}, "malloc": "jemalloc"})
    with pytest.raises(UserError, match=re.escape("malloc='jemalloc'; choose from keep | system")):
        check_settings(cfg)
