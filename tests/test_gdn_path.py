"""Which Gated DeltaNet kernels run (``mimo_sft.gdn_path``) and how they are bound (``model.gdn_binding``).

The rule is tested by itself on the CPU, for every combination of GPU, triton version and tilelang; no
choice has been measured on a GPU. The binding is tested with stand-ins for fla's functions (fla must stay
out of this environment, ``test_gdn_kernels``): megatron's module globals get what the rule picks, and
fla's functions get a device copy of a host ``cu_seqlens``, one per micro-batch (the ``meta`` device
stands in for a GPU: a real device other than the host's).
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

import mimo_sft.parallel  # noqa: F401  (before anything imports megatron)
from mimo_sft.gdn_path import FLA, TORCH, GdnFacts, choose, local_choice, local_facts, tilelang_usable, version_tuple
from mimo_sft.model import gdn_binding as gb
from mimo_sft.model import gdn_kernels as gk

GPUS = [None, (7, 0), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)]
TRITONS = ["3.2.0", "3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.7.0", "3.7.1", "3.8.0+git"]


# ---- the rule ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu,triton,tilelang", list(itertools.product(GPUS, TRITONS, [False, True])))
def test_current_fla_runs_except_on_hopper_with_triton_3_4_to_3_7_0_and_no_tilelang(gpu, triton, tilelang):
    """fla 0.6.0 (any release from 0.5.2): the torch kernels without a GPU, and on Hopper (sm 9x) with triton
    >= 3.4.0 and < 3.7.1 unless fla's tilelang backend is usable; fla everywhere else."""
    choice = choose(GdnFacts(fla="0.6.0", capability=gpu, triton=triton, tilelang=tilelang))
    bad = (3, 4, 0) <= version_tuple(triton) < (3, 7, 1)
    torch_expected = gpu is None or (gpu[0] == 9 and bad and not tilelang)
    assert choice.kernels == (TORCH if torch_expected else FLA), choice
    assert choice.line().startswith("Gated DeltaNet: ") and "\n" not in choice.line()
    if gpu is not None and torch_expected:
        assert f"triton {triton}" in choice.reason and "tilelang" in choice.reason and "sm 90" in choice.reason


@pytest.mark.parametrize("fla,triton,tilelang,kernels", [
    ("0.4.2", "3.6.0", True, TORCH),   # no tilelang backend before 0.5.0: its backward would be silently wrong
    ("0.4.2", "3.3.1", False, FLA),
    ("0.4.2", "3.7.1", False, FLA),    # the fault is triton's, fixed in 3.7.1
    ("0.5.0", "3.6.0", True, FLA),     # the tilelang backward
    ("0.5.1", "3.7.1", False, TORCH),  # 0.5.0 and 0.5.1 refuse every triton from 3.4.0 without tilelang
    ("0.5.1", "3.7.1", True, FLA),
    ("0.5.2", "3.7.1", False, FLA),
    ("0.5.2", "3.6.0", False, TORCH),
    ("unknown", "3.6.0", True, TORCH),  # fla importable without metadata: its tilelang backend is not assumed
    ("unknown", "3.3.1", False, FLA),
])
def test_older_fla_releases_on_hopper(fla, triton, tilelang, kernels):
    assert choose(GdnFacts(fla=fla, capability=(9, 0), triton=triton, tilelang=tilelang)).kernels == kernels


def test_without_fla_or_triton_the_torch_kernels_run():
    assert choose(GdnFacts(fla=None, capability=(8, 0), triton="3.6.0", tilelang=True)).reason == "fla is not installed"
    no_triton = choose(GdnFacts(fla="0.6.0", capability=(9, 0), triton=None, tilelang=False))
    assert no_triton.kernels == TORCH and "triton is not installed" in no_triton.reason


def test_version_tuple():
    assert version_tuple("3.6.0+cu130") == (3, 6, 0) and version_tuple("3.7") == (3, 7, 0)
    assert version_tuple(None) is None and version_tuple("dev") is None


def test_this_machine_runs_the_torch_kernels():
    """No fla, no GPU, no triton here (``mimo_sft.parallel`` makes megatron importable without it)."""
    facts = local_facts()
    assert facts.fla is None and facts.capability is None and not facts.tilelang
    assert local_choice().kernels == TORCH and local_choice().reason == "fla is not installed"


def test_validate_says_it_for_gated_deltanet_checkpoints_only():
    from mimo_sft.validate import _gdn_note

    assert _gdn_note({"model_type": "qwen2_5_vl"}) is None and _gdn_note(None) is None
    for model_type in ("qwen3_5", "qwen3_5_moe"):
        note = _gdn_note({"model_type": model_type})
        assert note.startswith(local_choice().line() + " (this machine: no CUDA GPU, fla not installed")
        assert "the rule: " in note and "\n" not in note


def test_tilelang_counts_where_it_is_installed_with_an_nvcc_and_not_switched_off(tmp_path, monkeypatch):
    (tmp_path / "tilelang").mkdir()
    (tmp_path / "tilelang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    import mimo_sft.gdn_path as gp

    monkeypatch.setattr(gp, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda-here"))
    usable_without_nvcc = tilelang_usable()
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("")
    assert not usable_without_nvcc and tilelang_usable()
    monkeypatch.setenv("FLA_TILELANG", "0")
    assert not tilelang_usable()


# ---- the binding --------------------------------------------------------------------------------------
HOPPER_36 = GdnFacts(fla="0.6.0", capability=(9, 0), triton="3.6.0", tilelang=False)
AMPERE = GdnFacts(fla="0.6.0", capability=(8, 0), triton="3.6.0", tilelang=False)


class FakeFla:
    """fla's three functions as megatron imported them, recording what they are called with; the numbers
    are the torch kernels' (so a megatron layer built on them computes what the torch path does)."""

    def __init__(self):
        self.calls = []

        def conv(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                 activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):
            self.calls.append(("conv", cu_seqlens, cu_seqlens_cpu))
            if x.device.type == "meta":
                return x, None
            return gk.causal_conv1d(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens)

        def rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):  # an fla without cu_seqlens_cpu
            self.calls.append(("rule", cu_seqlens, kwargs.get("cu_seqlens_cpu")))
            if q.device.type == "meta":
                return v, None
            return gk.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm_in_kernel, cu_seqlens)

        def l2norm(x, dim=-1, eps=1e-6, output_dtype=None):
            return gk.l2norm(x, dim, eps, output_dtype)

        self.conv, self.rule, self.l2norm = conv, rule, l2norm


@pytest.fixture
def fake_fla():
    """megatron as on a machine where it imported fla; afterwards megatron as imported here, re-installed."""
    common = importlib.import_module(gb._MEGATRON_MODULES[0])
    saved = dict(gb._ORIGINALS)
    fla = FakeFla()
    with pytest.MonkeyPatch.context() as mp:
        for attr, value in (("causal_conv1d", fla.conv), ("l2norm", fla.l2norm), ("chunk_gated_delta_rule", fla.rule),
                            ("HAVE_FLA", True)):
            mp.setattr(common, attr, value)
        yield fla
    gb._ORIGINALS.clear()
    gb._ORIGINALS.update(saved)
    gb.install()


def _bound(name: str) -> dict:
    module = importlib.import_module(name)
    return {a: vars(module)[a] for a in ("causal_conv1d", "l2norm", "chunk_gated_delta_rule", "HAVE_FLA")
            if a in vars(module)}


def test_install_binds_the_torch_kernels_everywhere_megatron_looks_here():
    assert gb.install() == gb.install() == gb.installed_choice() and gb.installed_choice().kernels == TORCH
    ours = {"causal_conv1d": gk.causal_conv1d, "l2norm": gk.l2norm, "chunk_gated_delta_rule": gk.chunk_gated_delta_rule,
            "HAVE_FLA": True}
    for name in gb._MEGATRON_MODULES:
        bound = _bound(name)
        assert "chunk_gated_delta_rule" in bound and all(value is ours[a] for a, value in bound.items()), name


def test_on_hopper_with_triton_3_6_the_torch_kernels_replace_fla(fake_fla):
    choice = gb.install(HOPPER_36)
    assert choice.kernels == TORCH and "triton 3.6.0" in choice.line()
    for name in gb._MEGATRON_MODULES:
        assert all(v is gk.chunk_gated_delta_rule for a, v in _bound(name).items() if a == "chunk_gated_delta_rule")
        assert all(v is gk.causal_conv1d for a, v in _bound(name).items() if a == "causal_conv1d")


def test_where_fla_is_correct_it_runs_with_a_device_copy_of_host_bounds(fake_fla):
    """fla's conv and rule get ``cu_seqlens`` on the inputs' device: one copy per micro-batch, the same tensor
    for every call of it (fla's identity caches hit); the host tensor as ``cu_seqlens_cpu`` where the
    function takes it; a device tensor, or inputs on the host, pass as they are. l2norm is fla's own."""
    assert gb.install(AMPERE).kernels == FLA and gb.install(AMPERE) == gb.installed_choice()
    gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    common = importlib.import_module(gb._MEGATRON_MODULES[0])
    assert common.l2norm is fake_fla.l2norm and gdn.causal_conv1d is not fake_fla.conv
    meta = dict(x=torch.empty(1, 10, 6, device="meta"), q=torch.empty(1, 10, 2, 4, device="meta"))
    v = torch.empty(1, 10, 2, 4, device="meta")
    host = [torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32)]
    for cu in (host[0], host[0], host[1]):  # two layers of one micro-batch, then the next micro-batch
        gdn.causal_conv1d(x=meta["x"], weight=torch.empty(6, 4, device="meta"), activation="silu", cu_seqlens=cu)
        gdn.chunk_gated_delta_rule(meta["q"], meta["q"], v, g=v[..., 0], beta=v[..., 0], cu_seqlens=cu)
    devices = [c[1] for c in fake_fla.calls]
    assert all(d.device.type == "meta" and d.dtype == torch.int32 for d in devices)
    assert all(d is devices[0] for d in devices[:4]) and devices[4] is devices[5] is not devices[0]
    hosts = [c[2] for c in fake_fla.calls]
    assert hosts[1] is hosts[3] is hosts[5] is None  # the rule's fla takes no cu_seqlens_cpu here
    assert hosts[0] is hosts[2] and torch.equal(hosts[0], host[0]) and torch.equal(hosts[4], host[1])
    assert hosts[0].dtype == hosts[4].dtype == torch.int64 and hosts[0].device.type == "cpu"
    fake_fla.calls.clear()
    gdn.causal_conv1d(x=meta["x"], weight=torch.empty(6, 4, device="meta"), cu_seqlens=devices[0])
    cpu_x = torch.randn(1, 10, 6)
    gdn.causal_conv1d(x=cpu_x, weight=torch.randn(6, 4), activation="silu", cu_seqlens=host[0])
    assert fake_fla.calls[0][1] is devices[0] and fake_fla.calls[1][1] is host[0] and fake_fla.calls[1][2] is None


def test_a_megatron_layer_built_on_fla_keeps_its_host_bounds_and_computes_as_the_torch_kernels(fake_fla):
    """megatron's GatedDeltaNet built where fla runs (here its stand-in, with the torch kernels' numbers): the
    layer takes the wrapped rule; a packed forward equals the torch path's, and megatron's own arithmetic
    saw the host ``cu_seqlens`` (the layer's inputs are on the host here, so fla gets them unchanged)."""
    from test_gdn_kernels import _cu, _gdn_layer, _packed

    from mimo_sft.parallel.bootstrap import start_single_process

    pg = start_single_process("cpu").modules["language"].pg_collection
    gb.install(AMPERE)
    layer = _gdn_layer(pg)
    assert getattr(layer.gated_delta_rule, "_mimo_device_bounds", False)
    gb.install(GdnFacts(fla=None, capability=None, triton=None, tilelang=False))
    reference = _gdn_layer(pg)
    reference.load_state_dict(layer.state_dict())
    assert reference.gated_delta_rule is gk.chunk_gated_delta_rule
    cu = _cu([70, 1, 5, 66])
    x = torch.randn(142, 1, 32, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(disable=True):
        gb.install(AMPERE)
        out, _ = layer(x, None, packed_seq_params=_packed(cu))
        gb.install(GdnFacts(fla=None, capability=None, triton=None, tilelang=False))
        ref, _ = reference(x, None, packed_seq_params=_packed(cu))
    assert torch.equal(out, ref) and {c[0] for c in fake_fla.calls} == {"conv", "rule"}
    assert all(c[1] is cu for c in fake_fla.calls) and cu.device.type == "cpu"
    # megatron's compiled helpers (bound for the fla path) ran with dynamo off: dynamo's caches remember that, and a
    # later compiled run in this process (tests/test_qwen3_5_memory.py's measurements) would run them uncompiled
    torch._dynamo.reset()


def test_install_runs_megatrons_compiled_helpers_eagerly_without_a_gpu_and_can_restore_them():
    """Without a CUDA GPU the GDN and output-gate helpers are plain functions (no inductor compile per rank
    and sequence length); ``compiled_helpers`` puts megatron's compiled ones back (the memory measurement)
    and takes them out again; where a GPU is present (fla or not) megatron's compiled ones stay."""
    from megatron.core.ssm.gated_delta_net import common
    from megatron.core.transformer.attention import Attention

    owners = [(common._GDNBase, "_apply_gated_norm"), (common._GDNBase, "_compute_g_and_beta"),
              (common._GDNBase, "_prepare_input_for_gated_delta_rule"), (Attention, "_apply_output_gate")]
    compiled = lambda fn: hasattr(fn, "_torchdynamo_orig_callable")  # noqa: E731
    gb.install()
    assert not any(compiled(owner.__dict__[name]) for owner, name in owners)
    with gb.compiled_helpers():
        assert all(compiled(owner.__dict__[name]) for owner, name in owners)
    assert not any(compiled(owner.__dict__[name]) for owner, name in owners)
    try:
        assert gb.install(GdnFacts(fla=None, capability=(9, 0), triton="3.6.0", tilelang=False)).kernels == TORCH
        assert all(compiled(owner.__dict__[name]) for owner, name in owners)
    finally:
        gb.install()
    assert not any(compiled(owner.__dict__[name]) for owner, name in owners)


# ---- scripts/check_gdn_fla.py -------------------------------------------------------------------------
def _check_script():
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("check_gdn_fla", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "check_gdn_fla.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_fla_check_fails_where_it_measures_nothing(capsys):
    assert _check_script().main([]) == 1
    out = capsys.readouterr().out
    assert "nothing measured" in out and "this machine: Gated DeltaNet: mimo-sft's torch kernels" in out


def test_the_fla_check_compares_host_and_device_bounds_and_reports_a_refused_backward():
    """The check's comparison on the CPU, every side the torch kernels (so every difference is 0): the side
    called as a run calls fla (through the binding's wrapper, host ``cu_seqlens``) and the direct one; a side
    whose backward raises (fla's refusal) leaves its gradient rows unmeasured and is reported."""
    check = _check_script()
    t = check.make_inputs(200, 3, heads=2, dk=16, dv=8, device="cpu")

    class Refused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results\nmore")

    def refusing_rule(*args, **kwargs):
        o, state = gk.chunk_gated_delta_rule(*args, **kwargs)
        return Refused.apply(o), state

    wrapped = (gb._with_device_bounds(gk.causal_conv1d), gb._with_device_bounds(gk.chunk_gated_delta_rule))
    sides = {"host": (*wrapped, t["cu"]), "device": (gk.causal_conv1d, gk.chunk_gated_delta_rule, t["cu"].clone()),
             "refusing": (gk.causal_conv1d, refusing_rule, t["cu"])}
    columns, refusals = check.compare((gk.causal_conv1d, gk.chunk_gated_delta_rule), sides, t)
    assert list(columns) == ["host vs torch", "device vs torch", "refusing vs torch", "host vs device cu_seqlens"]
    assert all(len(col) == len(check.ROWS) == 9 for col in columns.values())
    assert all(v == 0.0 for name, col in columns.items() if name != "refusing vs torch" for v in col)
    assert columns["refusing vs torch"][:2] == [0.0, 0.0] and columns["refusing vs torch"][2:] == [None] * 7
    assert refusals == ["refusing: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"]
