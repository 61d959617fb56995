"""Pipeline parallel (parallel_config.pipeline_stage > 1) on torch.distributed.pipelining; see engine.py."""
