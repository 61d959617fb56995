"""Each test module leaves the pytest process as it found it: a module that started torch.distributed in this
process (msp.initialize on one process sets RANK / WORLD_SIZE / MASTER_* and a gloo group, as a launcher would)
would otherwise make a later `msparallel-ds train --nproc 4` believe it was launched as rank 0 of 1, and a
Trainer built with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED, which turns a later plain Trainer into a
DeepSpeed one. So the whole environment is restored, not a list of keys."""
import os

import pytest


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
