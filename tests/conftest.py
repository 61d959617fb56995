"""Each test module leaves the pytest process as it found it: a module that started torch.distributed in this
process (msp.initialize on one process sets RANK / WORLD_SIZE / MASTER_* and a gloo group, as a launcher would)
would otherwise make a later `msparallel-ds train --nproc 4` believe it was launched as rank 0 of 1."""
import os

import pytest

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def _restore_launch_state():
    import torch.distributed as dist

    before = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    started = dist.is_available() and dist.is_initialized()
    yield
    if not started and dist.is_available() and dist.is_initialized():
        from msparallel_ds.runtime import teardown

        teardown()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
