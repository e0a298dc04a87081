"""The (dp_replicate, dp_shard, tp) device mesh, and the checks that must pass before any collective runs.

Dims from outermost to innermost: `dp_replicate` (parameters replicated: across nodes, the
slow network carries one gradient all-reduce per step), `dp_shard` (parameters sharded, FSDP:
an all-gather per block, best inside a node or a few), `tp` (tensor parallel: collectives
inside every block, so it stays within a node's NVLink). The data-parallel world is
dp_replicate x dp_shard: every one of those ranks trains on its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelConfigError(ValueError):
    """A parallelism setting that cannot work; the message names the keys and the fix."""


@dataclass(frozen=True)
class Meshes:
    """The meshes a run uses, each built once (slicing a flattened dim from the root is deprecated)."""

    world: DeviceMesh  # (dp_replicate, dp_shard, tp)
    dp: DeviceMesh  # the data-parallel world, replicate x shard: data order, loss mean
    data_parallel: DeviceMesh  # what parameters are sharded over: dp_shard, or (dp_replicate, dp_shard) for HSDP
    tp: DeviceMesh

    def process_groups(self) -> list[ProcessGroup]:
        """This rank's process group of every mesh dim, and of the flattened dp mesh."""
        return [*self.world.get_all_groups(), self.dp.get_group()]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh dim."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks train on different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @classmethod
    def resolve(cls, world_size: int, dp_replicate: int, dp_shard: int, tp: int) -> "ParallelDims":
        """Fill in dp_shard = -1 from the world size and check replicate x shard x tp == world size."""
        if dp_replicate < 1:
            raise ParallelConfigError(
                f"parallelism.data_parallel_replicate_degree must be >= 1, got {dp_replicate}."
            )
        if tp < 1 or world_size % (tp * dp_replicate):
            raise ParallelConfigError(
                f"parallelism.tensor_parallel_degree={tp} x data_parallel_replicate_degree={dp_replicate} "
                f"does not divide the world size {world_size}; pick degrees whose product divides "
                f"{world_size}, or launch a multiple of {tp * dp_replicate} processes."
            )
        if dp_shard == -1:
            dp_shard = world_size // (tp * dp_replicate)
        if dp_replicate * dp_shard * tp != world_size:
            raise ParallelConfigError(
                f"parallelism.data_parallel_replicate_degree ({dp_replicate}) x data_parallel_shard_degree "
                f"({dp_shard}) x tensor_parallel_degree ({tp}) = {dp_replicate * dp_shard * tp} but the world "
                f"size is {world_size}; set data_parallel_shard_degree to {world_size // (tp * dp_replicate)} or -1."
            )
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    def check_divisible(self, sizes: dict[str, int]) -> None:
        """Every named size (heads, hidden dims, vocab, sequence length) must split over tp."""
        for name, size in sizes.items():
            if size % self.tp:
                raise ParallelConfigError(
                    f"{name}={size} is not divisible by parallelism.tensor_parallel_degree={self.tp}; "
                    f"choose a tensor_parallel_degree that divides {size}."
                )

    def build_meshes(self, device_type: str) -> Meshes:
        names = ("dp_replicate", "dp_shard", "tp")
        world = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=names)
        if self.dp_replicate == 1:
            dp = data_parallel = world["dp_shard"]
        else:
            data_parallel = world["dp_replicate", "dp_shard"]
            dp = _flatten(data_parallel, "dp")
        return Meshes(world=world, dp=dp, data_parallel=data_parallel, tp=world["tp"])


def _flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One 1-D mesh over all ranks of `mesh`, for the loss mean over every data-parallel rank.

    `DeviceMesh._flatten` is private, and the only way to get a 1-D mesh (and process group)
    over several dims of an existing mesh that DTensor and the root mesh know about; torchtitan
    uses it the same way. Present on torch 2.11 and 2.13. Used only with dp_replicate > 1.
    """
    return mesh._flatten(name)
