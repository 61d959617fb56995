"""Process groups: ParallelLayout (DeviceMesh + every group) and the DeepSpeed mpu adapter."""
from .layout import GROUP_NAMES, MESH_DIMS, ParallelLayout, init_parallel
from .mpu import DeepSpeedMPU

__all__ = ["DeepSpeedMPU", "GROUP_NAMES", "MESH_DIMS", "ParallelLayout", "init_parallel"]
