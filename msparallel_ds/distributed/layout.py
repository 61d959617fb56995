"""ParallelLayout: the one owner of topology. Built once from a Plan inside an initialized process group.

One DeviceMesh with dims ("pp", "dp", "cp_ring", "cp_ulysses", "tp"), outermost first, so
    rank = (((pp_i*dp + d)*cp_ring + r)*cp_ulysses + u)*tp + t          (DESIGN.md, MindFormers/Megatron order)
plus flattened dims: "cp" = cp_ring x cp_ulysses, "dp_cp" = dp x cp (ZeRO partitions and gradients reduce over
it: cp ranks hold the same weights), "pp_tp" = pp x tp (the Megatron "model parallel" group: DeepSpeed sums
gradient norms over it). Every name has a group on every rank, size-1 ones included (DeepSpeed calls them); on
gloo, names with the same rank sets share one (_shared_groups).

Expert parallel (MindFormers mcore, Megatron-Core): the dp x cp x tp ranks of one pipeline stage (a block of
consecutive ranks) fold into "edp" x "ep", ep innermost, so an EP group is `ep` consecutive ranks and the
expert-data-parallel group "edp" (dp*cp*tp/ep ranks holding the same experts) strides by ep. A second DeviceMesh
("ep_pp", "edp", "ep") over the same ranks holds them.
No module-level state: pass the layout to whatever needs a group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelLayout", "init_parallel", "MESH_DIMS", "GROUP_NAMES"]

MESH_DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
_FLATTENED = {"cp": ("cp_ring", "cp_ulysses"), "dp_cp": ("dp", "cp_ring", "cp_ulysses"), "pp_tp": ("pp", "tp")}
EP_DIMS = ("ep_pp", "edp", "ep")  # the expert mesh: ep_pp equals pp
GROUP_NAMES = MESH_DIMS + tuple(_FLATTENED) + EP_DIMS[1:]


def _require_dist() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "msparallel_ds needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first, or launch the script with "
            "torchrun / deepspeed / accelerate launch (which set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).")


def _mesh_sizes(plan: Any) -> dict[str, int]:
    """Mesh sizes from plan.mesh, read by attribute or by key."""
    mesh = plan.mesh
    sizes = {}
    for name in MESH_DIMS:
        value = mesh[name] if isinstance(mesh, Mapping) else getattr(mesh, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan.mesh.{name}={value!r}: mesh sizes must be positive integers")
        sizes[name] = value
    cp = mesh.get("cp") if isinstance(mesh, Mapping) else getattr(mesh, "cp", None)
    if cp is not None and cp != sizes["cp_ring"] * sizes["cp_ulysses"]:
        raise ValueError(f"plan.mesh.cp={cp} must equal cp_ring*cp_ulysses="
                         f"{sizes['cp_ring']}*{sizes['cp_ulysses']}")
    return sizes


def _default_device_type() -> str:
    return "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"


def _default_timeout(device_type: str) -> timedelta:
    """The default group's timeout (what init_process_group was given), else torch's default."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device(device_type)).options._timeout
    except Exception:  # private API; fall back rather than fail
        return dist.distributed_c10d.default_pg_timeout


def _backend_options(timeout: timedelta):
    """Options that carry `timeout` into DeviceMesh's subgroups.

    init_device_mesh / _flatten create subgroups with torch's default timeout (30 min), not the timeout given
    to init_process_group; they only take one from backend options (`pg_options._timeout`).
    """
    if "nccl" in str(dist.get_backend()):
        opts = dist.ProcessGroupNCCL.Options()  # NCCL rejects generic options
    else:
        opts = torch._C._distributed_c10d.Backend.Options(str(dist.get_backend()), timeout)
    opts._timeout = timeout
    return opts


def _rank_sets(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of mesh dims `dims` (varying those, the others fixed) over arange(world).view(shape), each in
    row-major order over `dims`: the ranks and order DeviceMesh gives the dim (flattened: _flatten)."""
    ranks = torch.arange(math.prod(shape)).view(shape)
    rest = [d for d in range(len(shape)) if d not in dims]
    rows = ranks.permute(*rest, *dims).reshape(-1, math.prod(shape[d] for d in dims))
    return tuple(tuple(r) for r in rows.tolist())


def _shared_groups(shape: tuple[int, ...], expert_shape: tuple[int, int, int], timeout: timedelta,
                   device_type: str) -> dict[str, dist.ProcessGroup]:
    """gloo: one process group per distinct set of rank groups. Every gloo group runs its own TCP loop thread,
    which wakes every 10 ms even when idle, so the 12 groups DeviceMesh made at dp4 (size-1 dims included) cost
    each rank about 1160 wake-ups a second against plain DeepSpeed's 195 (measured; benchmarks/README.md, issue
    44). Names with the same rank sets (dp, dp_cp and edp at dp only; every size-1 dim) share one group, the
    world's being the default group when the timeouts agree (what DeviceMesh does without backend options).
    Every rank builds them in the same order, as new_group requires."""
    index = {d: i for i, d in enumerate(MESH_DIMS)}
    wanted = {name: _rank_sets(shape, (index[name],)) for name in MESH_DIMS}
    wanted.update({name: _rank_sets(shape, tuple(index[d] for d in dims)) for name, dims in _FLATTENED.items()})
    wanted.update({name: _rank_sets(expert_shape, (i,)) for i, name in enumerate(EP_DIMS) if i})
    world = tuple(range(math.prod(shape)))
    made: dict[tuple, dist.ProcessGroup] = {}
    for sets in wanted.values():
        if sets in made:
            continue
        if sets == (world,) and _default_timeout(device_type) == timeout:
            made[sets] = dist.group.WORLD
        else:
            made[sets], _ = dist.new_subgroups_by_enumeration([list(r) for r in sets], timeout=timeout)
    return {name: made[sets] for name, sets in wanted.items()}


class ParallelLayout:
    """The DeviceMesh and every process group of one run, built from a Plan (see module docstring).

    size(name), rank(name), group(name), ranks(name) for name in GROUP_NAMES; rank(name) is this rank's
    coordinate in that dim (its index in ranks(name)).
    """

    def __init__(self, plan: Any, *, device_type: str | None = None,
                 timeout: timedelta | float | None = None):
        _require_dist()
        sizes = _mesh_sizes(plan)
        world = dist.get_world_size()
        shape = tuple(sizes[n] for n in MESH_DIMS)
        product = math.prod(shape)
        if product != plan.world_size:
            raise ValueError(f"plan.mesh pp*dp*cp_ring*cp_ulysses*tp = {'*'.join(map(str, shape))} = {product} "
                             f"but plan.world_size={plan.world_size}")
        if plan.world_size != world:
            raise ValueError(
                f"the plan was made for world_size={plan.world_size} but torch.distributed has "
                f"world_size={world}: make the plan with make_plan(cfg, world_size={world}) (or pass the config "
                f"to init_parallel), or launch {plan.world_size} processes")
        self.plan = plan
        self.device_type = device_type or _default_device_type()
        if timeout is None:
            timeout = _default_timeout(self.device_type)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self.timeout = timeout
        self.world_size = world
        self.global_rank = dist.get_rank()
        self._sizes = {**sizes, **{n: math.prod(sizes[d] for d in dims) for n, dims in _FLATTENED.items()}}

        ep = _expert_parallel(plan, sizes)
        stage = world // sizes["pp"]
        self._sizes.update(ep=ep, edp=stage // ep)
        if str(dist.get_backend()) == "gloo":
            self._groups = _shared_groups(shape, (sizes["pp"], stage // ep, ep), timeout, self.device_type)
            self.mesh: DeviceMesh = DeviceMesh.from_group(
                [self._groups[name] for name in MESH_DIMS], self.device_type,
                mesh=torch.arange(world).view(shape), mesh_dim_names=MESH_DIMS)
        else:
            opts = (None, _backend_options(timeout))
            self.mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=MESH_DIMS,
                                         backend_override={name: opts for name in MESH_DIMS})
            # Keep the flattened 1-D meshes ourselves: slicing them back out of the root mesh is deprecated.
            meshes = {name: self.mesh[name] for name in MESH_DIMS}
            for name, dims in _FLATTENED.items():
                meshes[name] = self.mesh[dims]._flatten(name, backend_override=opts)
            expert_mesh = init_device_mesh(self.device_type, (sizes["pp"], stage // ep, ep), mesh_dim_names=EP_DIMS,
                                           backend_override={name: opts for name in EP_DIMS})
            meshes.update({name: expert_mesh[name] for name in EP_DIMS[1:]})
            self._groups = {name: m.get_group() for name, m in meshes.items()}
        self._ranks = {name: tuple(dist.get_process_group_ranks(g)) for name, g in self._groups.items()}

    def _check(self, name: str) -> str:
        if name not in self._groups:
            raise ValueError(f"unknown parallel dim {name!r}; valid names: {', '.join(GROUP_NAMES)}")
        return name

    def size(self, name: str) -> int:
        return self._sizes[self._check(name)]

    def rank(self, name: str) -> int:
        """This rank's coordinate in dim `name` (its rank inside group(name))."""
        return self._ranks[self._check(name)].index(self.global_rank)

    def group(self, name: str) -> dist.ProcessGroup:
        return self._groups[self._check(name)]

    def ranks(self, name: str) -> tuple[int, ...]:
        """Global ranks of this rank's group for `name`, in group-rank order."""
        return self._ranks[self._check(name)]

    def embedding_group(self, last_pp: int) -> dist.ProcessGroup:
        """Megatron's embedding group: the ranks of pp coordinates 0 and `last_pp` (the stages holding the word
        embedding and its last-stage copy) sharing this rank's other coordinates. Collective on first use (every
        rank calls, same `last_pp`); last_pp must differ from 0."""
        cache = self.__dict__.setdefault("_embedding_groups", {})
        if last_pp not in cache:
            stage = self.world_size // self.size("pp")
            pairs = [[r, last_pp * stage + r] for r in range(stage)]
            group, _ = dist.new_subgroups_by_enumeration(pairs, timeout=self.timeout)
            cache[last_pp] = group
        return cache[last_pp]

    @property
    def coords(self) -> dict[str, int]:
        return {name: self.rank(name) for name in GROUP_NAMES}

    @property
    def is_first_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank("pp") == self.size("pp") - 1

    def mpu(self):
        """DeepSpeed's `mpu` duck type over this layout (pass to deepspeed.initialize(mpu=...))."""
        from .mpu import DeepSpeedMPU

        return DeepSpeedMPU(self)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={self.rank(n)}/{self.size(n)}" for n in MESH_DIMS)
        return f"ParallelLayout(rank={self.global_rank}/{self.world_size}, {dims}, device={self.device_type})"


def _expert_parallel(plan: Any, sizes: dict[str, int]) -> int:
    ep = getattr(plan, "expert_parallel", 1) or 1
    folded = sizes["dp"] * sizes["cp_ring"] * sizes["cp_ulysses"] * sizes["tp"]
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or folded % ep:
        raise ValueError(f"parallel_config.expert_parallel={ep!r} must divide data_parallel x context_parallel x "
                         f"model_parallel = {folded}: expert-parallel groups are folded out of those ranks "
                         f"(MindFormers mcore / Megatron-Core); pick a divisor of {folded}")
    return ep


def init_parallel(cfg_or_plan: Any, *, device_type: str | None = None,
                  timeout: timedelta | float | None = None) -> ParallelLayout:
    """Build the ParallelLayout from a Plan, or from a ParallelConfig (planned for the current world size).

    Needs an initialized torch.distributed. `timeout` (timedelta or seconds) applies to every mesh group;
    default: the timeout the default group was created with.
    """
    _require_dist()
    plan = cfg_or_plan
    if not (hasattr(plan, "mesh") and hasattr(plan, "world_size")):
        from msparallel_ds.plan import make_plan

        plan = make_plan(cfg_or_plan, world_size=dist.get_world_size())
    return ParallelLayout(plan, device_type=device_type, timeout=timeout)
