"""The dp x tp device mesh, and the checks that must pass before any collective runs."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelConfigError(ValueError):
    """A parallelism setting that cannot work; the message names the keys and the fix."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh dim. tp is innermost so a TP group stays inside one node."""

    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @classmethod
    def resolve(cls, world_size: int, dp: int, tp: int) -> "ParallelDims":
        """Fill in dp = -1 from the world size and check dp x tp == world size."""
        if tp < 1 or world_size % tp:
            raise ParallelConfigError(
                f"parallelism.tensor_parallel_degree={tp} does not divide the world size {world_size}; "
                f"pick a divisor of {world_size} or launch with a multiple of {tp} processes."
            )
        if dp == -1:
            dp = world_size // tp
        if dp * tp != world_size:
            raise ParallelConfigError(
                f"parallelism.data_parallel_shard_degree ({dp}) x parallelism.tensor_parallel_degree ({tp}) "
                f"= {dp * tp} but the world size is {world_size}; set data_parallel_shard_degree to "
                f"{world_size // tp} or -1."
            )
        return cls(dp=dp, tp=tp)

    def check_divisible(self, sizes: dict[str, int]) -> None:
        """Every named size (heads, hidden dims, vocab, sequence length) must split over tp."""
        for name, size in sizes.items():
            if size % self.tp:
                raise ParallelConfigError(
                    f"{name}={size} is not divisible by parallelism.tensor_parallel_degree={self.tp}; "
                    f"choose a tensor_parallel_degree that divides {size}."
                )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
