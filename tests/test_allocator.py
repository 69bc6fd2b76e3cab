"""A training process keeps its heap between steps (hfl.runtime.allocator): a model-sized tensor
freed and allocated again no longer lands on fresh pages (counted as the kernel's minor faults)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from hfl.runtime.allocator import keep_freed_memory
from hfl.device.plan import prox_update
from hfl.device.training import BatchSampler, LocalTrainer, run_local_steps
from hfl.models import CNN
took = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)
trainer = LocalTrainer(CNN((1, 28, 28), 10))  # a 9.4 MB gradient a step
start, x, y = trainer.initial_params(), torch.rand(40, 1, 28, 28), torch.randint(0, 10, (40,))
def steps(n):
    run_local_steps(trainer, start, x, y, BatchSampler(40, 10, seed=0), n, prox_update(0.05, 0.0, None))
steps(20)  # warm-up: the heap grows
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps(20)
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensors_are_reused_not_faulted_in_again():
    _, default = faults("default")
    took, kept = faults("keep")
    assert took == "True"
    assert default > 20 * 100  # glibc's default: hundreds of fresh pages a step
    assert kept < default / 20
