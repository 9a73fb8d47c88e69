"""The one place that creates process groups: HyperCommGrids and every group built from them.

``torch.distributed.new_group`` is collective over the whole world, so every rank must create every
module's groups in the same order, whether or not it belongs to them. ``build_parallel_state``
walks the layout's modules in its fixed order (``language`` first, then encoders by name) and for
each creates, in this order:

1. base grid ``[tp, cp, dp, pp]`` groups: tp, cp, dp, pp, dp-cp, tp-pp, tp-cp, tp-cp-dp-pp,
   tp-dp-cp;
2. the ``expert`` view ``[expt_tp, ep, expt_dp, pp]`` groups megatron's MIMO optimizer asks for;
3. embedding groups (first + last pipeline stage) and position-embedding groups (first stage);
4. per-module gloo DP groups for host-side traffic (reorder costs and sample bytes, data checks),
   and, when reordering overlaps, a second gloo DP group used only by the background exchange
   thread, so its collectives never interleave with the training thread's. The exchanged samples
   are host tensors at both ends, so the thread never touches NCCL: driving an NCCL communicator
   from a second thread while the training thread runs DDP reductions and bridge sends is a known
   deadlock pattern.

Then one world-wide gloo group for control messages, and one more for the start-up verdicts that
one rank computes while the others wait (the image-file check): that group's timeout is
:data:`STARTUP_WAIT`, not ``--dist-timeout``, so a check longer than the collective timeout (millions
of files on a shared filesystem) does not kill the waiting ranks. The world (default) group itself is created
here too (``start_world_group``), when ``parallel.bootstrap`` starts the process. Nothing else in
mimo-sft calls ``init_process_group`` or ``new_group``; megatron's own bridge communicators create
their groups inside megatron. Every group gets the run's ``--dist-timeout`` (megatron's through
torch's default, see ``runtime.set_default_group_timeout``). Each group gets its name for the hang
watchdog's reports (``parallel.collectives.name_group``: "language dp", "images tp", "world gloo").
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from mimo_sft.parallel import runtime
from mimo_sft.parallel.collectives import name_group
from mimo_sft.parallel.layout import Layout, rank_of

EXPERT_VIEW = "expert"  # megatron.core.models.mimo.optimizer._EXPERT_VIEW
BASE_GROUPS = (["tp"], ["cp"], ["dp"], ["pp"], ["dp", "cp"], ["tp", "pp"], ["tp", "cp"],
               ["tp", "cp", "dp", "pp"], ["tp", "dp", "cp"])
EXPERT_GROUPS = (["expt_tp"], ["ep"], ["expt_dp"], ["expt_tp", "ep"], ["expt_tp", "ep", "pp"])


@dataclass
class ModuleGroups:
    """Everything one module needs on this rank (groups are None where this rank is not a member)."""

    name: str
    grid: HyperCommGrid
    pg_collection: Optional[ProcessGroupCollection]
    dp_gloo: Optional[dist.ProcessGroup]
    #: gloo DP group for the reorder thread only (never shared with the training thread)
    reorder_side_gloo: Optional[dist.ProcessGroup]
    member: bool


#: how long ranks wait for a verdict one rank computes at start-up (the image-file check: 5M paths
#: took 8-80 min on Lustre/NFS in the issue's figures), independent of ``--dist-timeout``
STARTUP_WAIT = datetime.timedelta(hours=6)


@dataclass
class ParallelState:
    layout: Layout
    rank: int
    modules: dict[str, ModuleGroups] = field(default_factory=dict)
    world_gloo: Optional[dist.ProcessGroup] = None
    #: world gloo group with the long :data:`STARTUP_WAIT` timeout (start-up verdicts only)
    startup_gloo: Optional[dist.ProcessGroup] = None

    @property
    def grids(self) -> dict[str, HyperCommGrid]:
        return {n: m.grid for n, m in self.modules.items()}

    def mine(self) -> list[str]:
        return [n for n, m in self.modules.items() if m.member]


def start_world_group(backend: str, *, in_process: bool, timeout: Optional[datetime.timedelta] = None) -> None:
    """Create the default (world) process group; ``parallel.bootstrap`` calls it, nothing else.

    ``in_process=False``: from torchrun's environment (``env://``: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). ``in_process=True``: a 1-rank group whose store lives in this process
    (``HashStore``: no port, nothing to rendezvous with). Inside torchrun a TCP init would connect to
    torchrun's agent store instead (``TORCHELASTIC_USE_AGENT_STORE``) and hang, which is where
    ``finetune --export-hf`` starts its 1-rank group. ``timeout=None``: torch's default.
    """
    assert not dist.is_initialized(), "the world group is already running"
    kw = {} if timeout is None else {"timeout": timeout}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if in_process:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    elif attempt != "0":
        # Workers restarted by torch's agent (--max-restarts): the agent keeps its store, and with torch 2.13 the
        # new workers read the dead ones' gloo addresses from it and cannot connect (measured: connectFullMesh
        # refused). Each start gets keys of its own under a prefix, as torch's env:// handler once did.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=not agent and rank == 0, multi_tenant=not agent, **kw)
        dist.init_process_group(backend, store=dist.PrefixStore(f"/mimo_sft/attempt_{attempt}", store), rank=rank,
                                world_size=world, **kw)
    else:
        dist.init_process_group(backend=backend, **kw)


def _enum_groups(ranks_list: list[list[int]], backend: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """Create one group per rank list (collectively); return the one this rank is in."""
    pg, _ = dist.new_subgroups_by_enumeration(ranks_list, backend=backend, timeout=_timeout())
    return pg


def host_twin(ranks: list[int]) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` beside a device group on the same ranks, for what those ranks exchange as host
    values (megatron's bridge shapes: ``parallel.megatron_patches.host_bridge_shapes``). Collective: every rank of
    the world calls it, in the same order, as megatron creates the group it twins."""
    return dist.new_group(sorted(ranks), backend="gloo", timeout=_timeout())


def _timeout():
    """The default group timeout ``bootstrap.start_world`` set (``--dist-timeout``), passed explicitly."""
    from torch.distributed import distributed_c10d as c10d

    return c10d.default_pg_timeout


def _embedding_rank_lists(spec) -> tuple[list[list[int]], list[list[int]]]:
    embd, pos = [], []
    for dp in range(spec.dp):
        for cp in range(spec.cp):
            for tp in range(spec.tp):
                first = rank_of(spec, tp=tp, cp=cp, dp=dp, pp=0)
                last = rank_of(spec, tp=tp, cp=cp, dp=dp, pp=spec.pp - 1)
                embd.append(sorted({first, last}))
                pos.append([first])
    return embd, pos


def _dp_rank_lists(spec) -> list[list[int]]:
    out = []
    for pp in range(spec.pp):
        for cp in range(spec.cp):
            for tp in range(spec.tp):
                out.append([rank_of(spec, tp=tp, cp=cp, dp=dp, pp=pp) for dp in range(spec.dp)])
    return out


def build_grid(spec) -> HyperCommGrid:
    """A module's HyperCommGrid with its expert view registered (no groups yet; not collective)."""
    grid = HyperCommGrid(shape=[spec.tp, spec.cp, spec.dp, spec.pp], dim_names=["tp", "cp", "dp", "pp"],
                         rank_offset=spec.rank_offset, backend=runtime.backend())
    assert spec.expert_dp, f"{spec.name}: ep*etp must divide tp*cp*dp (check 12)"
    grid.register_view(EXPERT_VIEW, shape=[spec.expert_tp, spec.ep, spec.expert_dp, spec.pp],
                       dim_names=["expt_tp", "ep", "expt_dp", "pp"], shared_dims=["pp"])
    return grid


class _FoldedGrid(HyperCommGrid):
    """A module's grid with cp folded into tp (:func:`folded_grid`); its one process group, pp, is the real
    grid's (the same ranks), and it creates none of its own."""

    def __init__(self, grid: HyperCommGrid):
        shape = dict(zip(grid.dim_names, grid.shape))
        super().__init__(shape=[shape["tp"] * shape["cp"], 1, shape["dp"], shape["pp"]],
                         dim_names=["tp", "cp", "dp", "pp"], rank_offset=grid.rank_offset, backend=grid.backend)
        self.real = grid

    def create_pg(self, dims, *, view=None, **kwargs):
        raise AssertionError(f"the folded grid creates no process group (asked for {dims})")

    def get_pg(self, dims, *, view=None):
        assert dims in ("pp", ["pp"]) and view is None, f"the folded grid lends only its pp group (asked for {dims})"
        return self.real.get_pg("pp")


def folded_grid(grid: HyperCommGrid) -> HyperCommGrid:
    """``grid`` ``[tp, cp, dp, pp]`` as ``[tp * cp, 1, dp, pp]``: the same ranks in the same order (tp varies
    fastest, then cp), the same DP replicas and pipeline stages. megatron's bridges (``BridgeCommunicator``,
    ``ColocatedBridgeCommunicator``) assert cp = 1 but need only the replicas: a language cp rank receives the
    encoder's whole output as a tp rank does (``model.context_parallel``)."""
    return _FoldedGrid(grid)


def build_parallel_state(layout: Layout, *, reorder_side_group: bool = False) -> ParallelState:
    """Create every grid and process group of ``layout`` on this rank (collective on all ranks)."""
    assert dist.is_initialized(), "bootstrap.start_world() first"
    rank = dist.get_rank()
    assert dist.get_world_size() == layout.world_size, (
        f"world size {dist.get_world_size()} != layout {layout.world_size}")
    state = ParallelState(layout=layout, rank=rank)
    for spec in layout.components:
        grid = build_grid(spec)
        for dims in BASE_GROUPS:
            name_group(grid.create_pg(dims, timeout=_timeout()), f"{spec.name} {'-'.join(dims)}")
        for dims in EXPERT_GROUPS:
            name_group(grid.create_pg(dims, view=EXPERT_VIEW, timeout=_timeout()), f"{spec.name} {'-'.join(dims)}")
        embd_lists, pos_lists = _embedding_rank_lists(spec)
        embd = _enum_groups(embd_lists)
        pos_embd = _enum_groups(pos_lists)
        dp_lists = _dp_rank_lists(spec)
        dp_gloo = _enum_groups(dp_lists, backend="gloo")
        side_gloo = _enum_groups(dp_lists, backend="gloo") if reorder_side_group else None
        for group, what in ((embd, "embedding"), (pos_embd, "position embedding"), (dp_gloo, "dp gloo"),
                            (side_gloo, "dp gloo (reorder thread)")):
            name_group(group, f"{spec.name} {what}")
        member = rank in spec.ranks
        pgc = None
        if member:
            pgc = ProcessGroupCollection()
            pgc.tp = grid.get_pg("tp")
            pgc.cp = grid.get_pg("cp")
            pgc.dp = grid.get_pg("dp")
            pgc.pp = grid.get_pg("pp")
            pgc.dp_cp = grid.get_pg(["dp", "cp"])
            pgc.mp = grid.get_pg(["tp", "pp"])
            pgc.tp_cp = grid.get_pg(["tp", "cp"])
            pgc.tp_dp_cp = grid.get_pg(["tp", "dp", "cp"])
            pgc.intra_dp_cp = pgc.dp_cp
            pgc.intra_dist_opt = grid.get_pg(["tp", "cp", "dp", "pp"])
            pgc.embd = embd
            pgc.pos_embd = pos_embd
            pgc.expt_tp = grid.get_pg("expt_tp", view=EXPERT_VIEW)
            pgc.ep = grid.get_pg("ep", view=EXPERT_VIEW)
            pgc.expt_dp = grid.get_pg("expt_dp", view=EXPERT_VIEW)
            pgc.intra_expt_dp = pgc.expt_dp
            pgc.tp_ep = grid.get_pg(["expt_tp", "ep"], view=EXPERT_VIEW)
            pgc.tp_ep_pp = grid.get_pg(["expt_tp", "ep", "pp"], view=EXPERT_VIEW)
        state.modules[spec.name] = ModuleGroups(spec.name, grid, pgc, dp_gloo if member else None,
                                                side_gloo if member else None, member)
    state.world_gloo = dist.new_group(backend="gloo", timeout=_timeout())
    state.startup_gloo = dist.new_group(backend="gloo", timeout=max(STARTUP_WAIT, _timeout()))
    name_group(state.world_gloo, "world gloo")
    name_group(state.startup_gloo, "world gloo (start-up)")
    _register_language_dp_rank(layout, rank)
    return state


def _register_language_dp_rank(layout: Layout, rank: int) -> None:
    """Tell megatron's global ``parallel_state`` this rank's language DP(-CP) rank.

    One megatron call site still reads the global state instead of the model's process groups:
    ``LanguageModule.tie_embeddings_and_output_weights_state_dict`` (last pipeline stage, tied
    embeddings, checkpoint replica ids). ``set_data_parallel_rank`` is megatron's own override for
    that value; nothing else of the global state is used.
    """
    from megatron.core import parallel_state

    coord = layout.coords(rank).get("language")
    if coord is not None:
        spec = layout.language
        parallel_state.set_data_parallel_rank(coord.dp * spec.cp + coord.cp)


def megatron_ranks(pstate: "ParallelState") -> dict[str, int]:
    """This rank's tensor, expert and expert-tensor ranks for megatron's RNG tracker, read from the groups of
    the module whose layers it builds (the language model where it runs one)."""
    from mimo_sft.parallel.layout import LANGUAGE

    mine = pstate.mine()
    name = LANGUAGE if LANGUAGE in mine else mine[0]
    pgc = pstate.modules[name].pg_collection
    return {"tp_rank": pgc.tp.rank(), "ep_rank": pgc.ep.rank(), "etp_rank": pgc.expt_tp.rank()}
