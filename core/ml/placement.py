"""Where a rank's share of the work runs: the one fact every rank-side function that splits work needs."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """Data-parallel rank `rank` of `world`, computing on `device`."""
    rank: int
    world: int
    device: torch.device | str

    def share(self, total: int) -> slice:
        """This rank's contiguous equal share of `total` items."""
        per = total // self.world
        return slice(self.rank * per, (self.rank + 1) * per)
