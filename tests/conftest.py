"""Each test module leaves the pytest process as it found it: a module that started torch.distributed in this
process (msp.initialize on one process sets RANK / WORLD_SIZE / MASTER_* and a gloo group, as a launcher would)
would otherwise make a later `msparallel-ds train --nproc 4` believe it was launched as rank 0 of 1, and a
Trainer built with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED, which turns a later plain Trainer into a
DeepSpeed one. So the whole environment is restored, not a list of keys."""
import os

import pytest

# One torch thread in the pytest process (before torch is imported), as .ci/run sets it, so `python -m pytest -q` as
# the README writes it runs what CI runs: the single-process references sum in the order their parity bounds were
# measured with (with 2 threads, test_scaled_deepseek4_configs_train_like_one_process was 2.2e-5 over a 1e-5 bound).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="module")
def _restore_launch_state():
    import torch.distributed as dist

    before = dict(os.environ)
    started = dist.is_available() and dist.is_initialized()
    yield
    if not started and dist.is_available() and dist.is_initialized():
        from msparallel_ds.runtime import teardown

        teardown()
    for key in set(os.environ) - set(before):
        os.environ.pop(key, None)
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
