"""The ``--component`` grammar: ``NAME=k=v,k=v,...`` with keys tp, pp, cp, dp, ep, etp, rank_offset.

Example: ``language=tp=1,pp=1,dp=2,rank_offset=0``. ``dp`` is required, the others default to 1
(``rank_offset`` to 0, ``etp`` to the module's tp, as megatron's ``expert_tensor_parallel_size``).
``ep`` and ``etp`` partition the ``tp*cp*dp`` ranks of each pipeline stage a second way, for the
experts of a mixture-of-experts language model (megatron's expert view ``[etp, ep, expert dp, pp]``);
they add no ranks. Parsing is pure: it never touches torch.distributed.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass
from typing import Optional

from mimo_sft.errors import UserError

COMPONENT_KEYS = ("tp", "pp", "cp", "dp", "ep", "etp", "rank_offset")


@dataclass(frozen=True)
class ComponentSpec:
    """One module's rank group: a contiguous block of ``tp*cp*dp*pp`` ranks from ``rank_offset``."""

    name: str
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    #: expert parallelism: experts split over ``ep`` ranks of a stage (mixture-of-experts language models only)
    ep: int = 1
    #: expert tensor parallelism as given (None: the module's tp; :attr:`expert_tp` is the value in force)
    etp: Optional[int] = None
    rank_offset: int = 0

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallelism in force: ``etp`` when given, else ``tp``."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Ranks of a stage holding the same experts (0 when ``ep*etp`` does not divide ``tp*cp*dp``,
        which check 3 refuses)."""
        stage, group = self.tp * self.cp * self.dp, self.ep * self.expert_tp
        return stage // group if group > 0 and stage % group == 0 else 0

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("name")
        if d["etp"] is None:
            d.pop("etp")
        return d

    def to_flag(self) -> str:
        # ep and etp only where given: a dense layout reads as it always has
        keys = [k for k in COMPONENT_KEYS if not (k == "etp" and self.etp is None) and not (k == "ep" and self.ep == 1)]
        return f"{self.name}=" + ",".join(f"{k}={getattr(self, k)}" for k in keys)


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def component_from_mapping(name: str, values: dict, *, where: str) -> ComponentSpec:
    """Build a spec from a ``{key: int}`` mapping (YAML or parsed flag); ``where`` names the source."""
    if not name or not name.replace("_", "").isalnum():
        raise UserError(f"{where}: module name {name!r} is not a valid name; use e.g. 'language' or 'images'")
    kwargs: dict = {}
    for key, raw in values.items():
        if key not in COMPONENT_KEYS:
            raise UserError(
                f"{where}: unknown key '{key}' for module '{name}'{_suggest(key, COMPONENT_KEYS)}; "
                f"valid keys: {', '.join(COMPONENT_KEYS)}"
            )
        if isinstance(raw, bool):
            raise UserError(f"{where}: {name}.{key} must be an integer, got {raw!r}")
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise UserError(f"{where}: {name}.{key} must be an integer, got {raw!r}") from None
        kwargs[key] = value
    if "dp" not in kwargs:
        raise UserError(f"{where}: module '{name}' has no 'dp'; add dp=N (the module's data-parallel size)")
    return ComponentSpec(name=name, **kwargs)


def parse_component(text: str) -> ComponentSpec:
    """Parse one ``--component`` value. Raises ``UserError`` naming the flag and what to change."""
    where = f"--component {text!r}"
    name, sep, rest = text.strip().partition("=")
    name = name.strip()
    if not sep or not name:
        raise UserError(f"{where}: expected NAME=k=v,... such as 'language=tp=1,pp=1,dp=2,rank_offset=0'")
    values: dict[str, str] = {}
    for item in rest.split(","):
        item = item.strip()
        if not item:
            raise UserError(f"{where}: empty entry in the key list; remove the stray comma")
        key, sep2, val = item.partition("=")
        key = key.strip()
        if not sep2 or not key or not val.strip():
            raise UserError(f"{where}: '{item}' is not k=v; write it like 'dp=2'")
        if key in values:
            raise UserError(f"{where}: key '{key}' given twice for module '{name}'")
        values[key] = val
    return component_from_mapping(name, values, where=where)
