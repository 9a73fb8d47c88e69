"""Real HyperCommGrids and process groups on gloo: each rank's groups match the pure layout."""

import pytest

from dist_utils import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]


def _build(rank, world, component_texts):
    import torch.distributed as dist

    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.parallel.layout import Layout, coord_of, rank_of

    layout = Layout.from_specs([parse_component(t) for t in component_texts], world)
    state = build_parallel_state(layout, reorder_side_group=True)
    out = {}
    for name, mg in state.modules.items():
        spec = layout.spec(name)
        assert mg.member == (rank in spec.ranks)
        if not mg.member:
            assert mg.pg_collection is None
            continue
        pgc = mg.pg_collection
        c = coord_of(spec, rank)
        want_tp = [rank_of(spec, tp=t, cp=c.cp, dp=c.dp, pp=c.pp) for t in range(spec.tp)]
        want_dp = [rank_of(spec, tp=c.tp, cp=c.cp, dp=d, pp=c.pp) for d in range(spec.dp)]
        want_pp = [rank_of(spec, tp=c.tp, cp=c.cp, dp=c.dp, pp=p) for p in range(spec.pp)]
        got = {k: dist.get_process_group_ranks(getattr(pgc, k)) for k in ("tp", "dp", "pp", "embd")}
        assert got["tp"] == want_tp and got["dp"] == want_dp and got["pp"] == want_pp, got
        assert got["embd"] == sorted({want_pp[0], want_pp[-1]})
        assert dist.get_process_group_ranks(mg.dp_gloo) == want_dp
        assert dist.get_process_group_ranks(mg.reorder_side_gloo) == want_dp
        assert pgc.dp.rank() == c.dp and pgc.tp.rank() == c.tp
        # the groups really communicate: all-reduce over dp sums the dp coordinates
        import torch
        t = torch.tensor([float(c.dp)])
        dist.all_reduce(t, group=mg.dp_gloo)
        assert t.item() == sum(range(spec.dp))
        out[name] = (c.tp, c.dp, c.pp)
    assert mg.grid.is_current_rank_in_grid() == mg.member
    return out


def test_non_colocated_4_ranks():
    res = run_distributed(_build, 4, ["language=tp=1,pp=1,dp=2,rank_offset=0", "images=tp=1,dp=2,rank_offset=2"])
    assert res == [{"language": (0, 0, 0)}, {"language": (0, 1, 0)}, {"images": (0, 0, 0)}, {"images": (0, 1, 0)}]


def test_colocated_2_ranks_heterogeneous_tp_dp():
    res = run_distributed(_build, 2, ["language=tp=2,dp=1", "images=tp=1,dp=2"])
    assert res == [{"language": (0, 0, 0), "images": (0, 0, 0)}, {"language": (1, 0, 0), "images": (0, 1, 0)}]


def test_language_tp_pp_4_ranks():
    res = run_distributed(_build, 4, ["language=tp=2,pp=2,dp=1"])
    assert [r["language"] for r in res] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]


def _timeouts(rank, world):
    """Every group of a run waits --dist-timeout: ours (explicit) and megatron's (created without one)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.groups import build_parallel_state
    from mimo_sft.parallel.layout import Layout

    layout = Layout.from_specs([parse_component("language=dp=1"), parse_component("images=dp=1,rank_offset=1")], world)
    build_parallel_state(layout, reorder_side_group=True)
    dist.new_group([0, 1], backend="gloo")  # as megatron's bridge communicator creates its groups
    cpu = torch.device("cpu")
    return sorted({int(pg._get_backend(cpu).options._timeout.total_seconds()) for pg in c10d._world.pg_map})


def test_dist_timeout_reaches_every_group():
    # dist_utils starts the workers through bootstrap.start_world(timeout_s=120); the one exception is the
    # start-up group, which waits parallel.groups.STARTUP_WAIT for rank 0's data check, never --dist-timeout
    from mimo_sft.parallel.groups import STARTUP_WAIT

    assert run_distributed(_timeouts, 2) == [[120, int(STARTUP_WAIT.total_seconds())]] * 2
