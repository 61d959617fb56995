"""`msparallel-ds train RUN.yaml [--nproc N] [--output-dir DIR] [--stop-after K] [--tensorboard DIR]
[--override FILE ...] [--set KEY=VALUE ...]` (also `python -m msparallel_ds.train`).

Under torchrun / the deepspeed launcher / accelerate launch (RANK in the environment) every process runs the
Trainer. Started plainly, it runs N local processes itself (N = --nproc, default the YAML's device count), forked
after the heavy imports, over gloo on CPU, with a deadline (launch.run_local)."""
from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the MindFormers YAML (run_mode train / finetune)")
    p.add_argument("--nproc", type=int, default=None, help="local processes when not under a launcher "
                                                             "(default: data_parallel x model_parallel x cp x pp)")
    p.add_argument("--output-dir", default=None, help="default: the YAML's output_dir")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="end after step K without changing the schedule (resume_training continues)")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard scalars here")
    p.add_argument("--override", action="append", default=[], metavar="FILE",
                   help="a YAML merged over the run's (mappings key by key, lists replaced); repeatable")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one YAML value, e.g. --set runner_config.epochs=2; repeatable, after --override")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before local processes are stopped")
    # the deepspeed launcher passes --local_rank=N to every process (LOCAL_RANK is in the environment too)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def _spec(args):
    from .spec import RunSpec
    return RunSpec.load(args.file, args.override, args.set, output_dir=args.output_dir,
                        stop_after=args.stop_after, tensorboard=args.tensorboard)


def _worker(rank: int, world: int, args, send):
    import warnings

    from ..config.errors import ConfigWarning
    from .trainer import Trainer
    with warnings.catch_warnings():  # the parent showed the YAML's warnings once
        warnings.simplefilter("ignore", ConfigWarning)
        spec = _spec(args)
    return Trainer(spec).train()


def _precheck(spec) -> None:
    from .. import load_config
    from ..data import open_train_dataset
    from .model import check_sources
    check_sources(spec.raw)
    if spec.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            from ..config.errors import ConfigError, ConfigIssue
            raise ConfigError(ConfigIssue("--tensorboard", spec.tensorboard, "needs the tensorboard package",
                                          "pip install tensorboard, or drop --tensorboard (output_dir/metrics.jsonl "
                                          "has every step)")) from None
    cfg = load_config(spec.raw)
    open_train_dataset(spec.raw, 0, cfg.dp)


def run(args) -> dict:
    """The run's result on rank 0 (losses by step, last step, total steps)."""
    from .. import runtime
    runtime.quiet_deepspeed()
    spec = _spec(args)  # YAML, model source and data errors before any process starts
    _precheck(spec)
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        from .trainer import Trainer
        result = Trainer(spec).train()
        runtime.teardown()  # live groups at interpreter exit can abort a rank (SIGABRT) after the last step
        return result
    pc = spec.raw.get("parallel_config") or {}
    world = args.nproc or (int(pc.get("data_parallel", 1)) * int(pc.get("model_parallel", 1))
                           * int(pc.get("context_parallel", 1)) * int(pc.get("pipeline_stage", 1)))
    import torch  # noqa: F401  heavy imports before forking, so the workers share them
    import deepspeed  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import msparallel_ds.engine  # noqa: F401
    from ..launch import _free_port, run_local
    if world == 1:  # in this process, on a free port (29500 may be another job's); left as found
        import torch.distributed as dist

        from .trainer import Trainer
        env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        try:
            return Trainer(spec).train()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for k, v in env.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return run_local(_worker, world, (args,), timeout=args.timeout)[0]
