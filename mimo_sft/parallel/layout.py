"""Pure rank arithmetic for a MIMO layout: who runs what, and which data each rank reads.

Everything here is plain Python over ``ComponentSpec``s, mirroring megatron-core's
``HyperCommGrid(shape=[tp, cp, dp, pp])`` ordering (the first dimension varies fastest), so the
layout table, the canonical grid and the sampler shards can be computed and tested without
``torch.distributed``. ``parallel.groups`` turns the same layout into real process groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

from mimo_sft.parallel.components import ComponentSpec

#: module names (``--component NAME=...`` and MimoModel's module keys); import them from here
LANGUAGE = "language"
IMAGES = "images"  # the vision encoder's modality
GRID_DIMS = ("tp", "cp", "dp", "pp")  # HyperCommGrid dim_names order; tp varies fastest


@dataclass(frozen=True)
class RankCoord:
    """A rank's coordinates inside one module's grid."""

    module: str
    tp: int
    cp: int
    dp: int
    pp: int


def coord_of(spec: ComponentSpec, rank: int) -> RankCoord | None:
    """Coordinates of global ``rank`` in ``spec``'s grid, or None when the rank is outside it."""
    if rank not in spec.ranks:
        return None
    local = rank - spec.rank_offset
    tp = local % spec.tp
    local //= spec.tp
    cp = local % spec.cp
    local //= spec.cp
    dp = local % spec.dp
    pp = local // spec.dp
    return RankCoord(spec.name, tp, cp, dp, pp)


def rank_of(spec: ComponentSpec, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
    """Inverse of :func:`coord_of`."""
    return spec.rank_offset + tp + spec.tp * (cp + spec.cp * (dp + spec.dp * pp))


def lcm(values) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


@dataclass(frozen=True)
class Layout:
    """All modules of one run. ``components`` keeps ``language`` first, then the encoders by name."""

    components: tuple[ComponentSpec, ...]
    world_size: int

    @classmethod
    def from_specs(cls, specs, world_size: int | None = None) -> "Layout":
        specs = sorted(specs, key=lambda s: (s.name != LANGUAGE, s.name))
        implied = max((s.rank_offset + s.size for s in specs), default=0)
        return cls(tuple(specs), world_size if world_size is not None else implied)

    # ---- module lookups -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [s.name for s in self.components]

    def spec(self, name: str) -> ComponentSpec:
        for s in self.components:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def language(self) -> ComponentSpec:
        return self.spec(LANGUAGE)

    @property
    def encoders(self) -> list[ComponentSpec]:
        return [s for s in self.components if s.name != LANGUAGE]

    # ---- global properties ----------------------------------------------------------------
    @property
    def canonical_grid(self) -> int:
        """Number of canonical groups per global micro-batch: LCM of the module DP sizes."""
        return lcm(s.dp for s in self.components)

    @property
    def colocated(self) -> bool:
        """True when every module spans exactly the same ranks (megatron's colocated mode)."""
        first = self.components[0]
        return len(self.components) > 1 and all(
            s.rank_offset == first.rank_offset and s.size == first.size for s in self.components
        )

    def modules_of(self, rank: int) -> list[str]:
        return [s.name for s in self.components if rank in s.ranks]

    def coords(self, rank: int) -> dict[str, RankCoord]:
        out = {}
        for s in self.components:
            c = coord_of(s, rank)
            if c is not None:
                out[s.name] = c
        return out

    def canonical_groups(self, module: str, dp_rank: int) -> range:
        """Canonical groups read by DP rank ``dp_rank`` of ``module``: [r*G/d, (r+1)*G/d)."""
        spec = self.spec(module)
        per = self.canonical_grid // spec.dp
        return range(dp_rank * per, (dp_rank + 1) * per)

    def samples_per_dp_rank(self, module: str, micro_batch_size: int) -> int:
        return micro_batch_size // self.spec(module).dp

    def sample_slice(self, module: str, dp_rank: int, micro_batch_size: int) -> range:
        """Positions of the global micro-batch that DP rank ``dp_rank`` of ``module`` reads."""
        n = self.samples_per_dp_rank(module, micro_batch_size)
        return range(dp_rank * n, (dp_rank + 1) * n)

    def rank_rows(self, micro_batch_size: int) -> list[dict]:
        """One row per module for the ``validate`` table."""
        rows = []
        for s in self.components:
            groups = []
            for r in range(s.dp):
                g = self.canonical_groups(s.name, r)
                groups.append(str(g.start) if len(g) == 1 else f"{g.start}-{g.stop - 1}")
            rows.append(
                {
                    "module": s.name,
                    "ranks": f"{s.rank_offset}-{s.rank_offset + s.size - 1}",
                    "tp": s.tp,
                    "pp": s.pp,
                    "cp": s.cp,
                    "dp": s.dp,
                    "ep": s.ep,
                    "etp": s.expert_tp,
                    "canonical_groups": groups,
                    "samples_per_rank": (micro_batch_size // s.dp) if s.dp and micro_batch_size % s.dp == 0 else None,
                }
            )
        return rows
