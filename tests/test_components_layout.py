"""Component grammar and pure rank arithmetic (no processes)."""

import itertools

import pytest

from mimo_sft.errors import UserError
from mimo_sft.parallel.components import parse_component
from mimo_sft.parallel.layout import Layout, coord_of, lcm, rank_of


def test_parse_full_and_defaults():
    s = parse_component("language=tp=2,pp=1,dp=4,rank_offset=3")
    assert (s.name, s.tp, s.pp, s.cp, s.dp, s.ep, s.etp, s.rank_offset) == ("language", 2, 1, 1, 4, 1, None, 3)
    assert s.size == 8 and list(s.ranks) == list(range(3, 11))
    assert (s.expert_tp, s.expert_dp) == (2, 4)  # etp defaults to tp, as megatron's expert_tensor_parallel_size
    d = parse_component(" images = dp=2 ")
    assert (d.tp, d.pp, d.cp, d.ep, d.expert_tp, d.rank_offset, d.dp) == (1, 1, 1, 1, 1, 0, 2)
    assert parse_component(s.to_flag()) == s and "etp" not in s.to_flag()
    e = parse_component("language=tp=2,dp=4,ep=4,etp=1")
    assert (e.ep, e.etp, e.expert_tp, e.expert_dp, e.size) == (4, 1, 1, 2, 8)  # ep adds no ranks
    assert parse_component(e.to_flag()) == e
    assert parse_component("language=tp=2,dp=2,ep=4").expert_dp == 0  # ep*etp = 8 does not divide 4 ranks


@pytest.mark.parametrize("text,needle", [
    ("language", "expected NAME=k=v"),
    ("=dp=2", "expected NAME=k=v"),
    ("language=tp=1", "has no 'dp'"),
    ("language=dp=2,tpp=1", "did you mean 'tp'"),
    ("language=dp=2,,tp=1", "empty entry"),
    ("language=dp=two", "must be an integer"),
    ("language=dp=2,dp=4", "given twice"),
    ("language=dp", "is not k=v"),
])
def test_parse_errors_are_one_line(text, needle):
    with pytest.raises(UserError) as e:
        parse_component(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 1, 2, 1), (2, 1, 2, 2), (2, 2, 2, 1), (4, 1, 1, 2)])
def test_coords_match_hypercommgrid_order(tp, cp, dp, pp):
    spec = parse_component(f"language=tp={tp},cp={cp},dp={dp},pp={pp},rank_offset=5")
    seen = set()
    for r in spec.ranks:
        c = coord_of(spec, r)
        assert rank_of(spec, tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r
        seen.add((c.tp, c.cp, c.dp, c.pp))
    assert len(seen) == spec.size
    # tp varies fastest: consecutive ranks differ in tp first
    if tp > 1:
        assert coord_of(spec, 5).tp == 0 and coord_of(spec, 6).tp == 1
    assert coord_of(spec, 4) is None


def test_canonical_grid_and_shards():
    lay = Layout.from_specs([parse_component("images=dp=2,rank_offset=6"), parse_component("language=tp=2,dp=3")])
    assert lay.names == ["language", "images"] and lay.world_size == 8
    assert lay.canonical_grid == 6 == lcm([2, 3])
    assert list(lay.canonical_groups("language", 1)) == [2, 3]
    assert list(lay.canonical_groups("images", 1)) == [3, 4, 5]
    assert list(lay.sample_slice("images", 1, 12)) == list(range(6, 12))
    assert not lay.colocated
    assert set(lay.modules_of(7)) == {"images"} and lay.coords(3)["language"].dp == 1


@pytest.mark.parametrize("dps", [(1, 1), (1, 2), (2, 2), (2, 3), (2, 4), (4, 4)])
def test_canonical_groups_partition_for_every_module(dps):
    lay = Layout.from_specs([parse_component(f"language=dp={dps[0]}"),
                             parse_component(f"images=dp={dps[1]},rank_offset={dps[0]}")])
    g = lay.canonical_grid
    for name, d in zip(["language", "images"], dps):
        groups = list(itertools.chain.from_iterable(lay.canonical_groups(name, r) for r in range(d)))
        assert groups == list(range(g))


def test_colocated_detection():
    lay = Layout.from_specs([parse_component("language=tp=2,dp=2"), parse_component("images=dp=4")])
    assert lay.colocated and lay.world_size == 4
