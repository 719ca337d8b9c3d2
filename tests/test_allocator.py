"""keep_freed_memory: a freed 64 MiB tensor's memory is reused by the next one instead of being
unmapped and page-faulted in again, once the heap has settled (counted with getrusage's minor faults, against the page count
a fresh mapping must fault: 64 MiB / the page size)."""
import json
import platform
import re
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
import torch
from protein_performer.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def touch():
    torch.empty(16 * 2 ** 20, dtype=torch.float32).fill_(1.0)   # 64 MiB, written, then freed
for _ in range(10):  # the heap settles: an aligned request need not fit the first few freed blocks
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "pages": 64 * 2 ** 20 // resource.getpagesize()}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_keep_freed_memory_reuses_large_blocks():
    system, keep = probe("system"), probe("keep")
    assert system["faults"] >= 0.9 * system["pages"]  # glibc's default: a fresh mmap, every page faulted again
    assert keep["applied"] is True
    assert keep["faults"] < 0.1 * keep["pages"]  # the freed block served the second tensor


def test_train_refuses_an_unknown_malloc_setting():
    from omegaconf import OmegaConf

    from protein_performer.errors import UserError
    from protein_performer.training.run import check_settings

    cfg = OmegaConf.create({"model": {"name": "performer"}, "objective": {"name": "mlm"},
                            "optim": {"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 0.1}, "malloc": "jemalloc"})
    with pytest.raises(UserError, match=re.escape("malloc='jemalloc'; choose from keep | system")):
        check_settings(cfg)
