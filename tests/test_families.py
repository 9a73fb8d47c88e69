"""The family descriptors (``config.families``) are the one source of a family's names and limits."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from mimo_sft.config import families
from mimo_sft.config.checks import context as check_context, layout as layout_checks, model as model_checks
from mimo_sft.validate import check_config
from mimo_sft.config.families import EncoderLimits, FamilySpec, LanguageDims
from mimo_sft.config.loader import flag_table, load_config
from mimo_sft.config.schema import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: packages (not submodules: importing ``mimo_sft.parallel`` registers a stand-in for one megatron submodule)
HEAVY = ("torch", "megatron", "megatron.core", "transformers")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_descriptors_and_config_import_neither_torch_nor_megatron():
    out = _run("import sys, mimo_sft.config.families, mimo_sft.config.schema, mimo_sft.config.checks.registry, "
               "mimo_sft.validate, mimo_sft.config.loader; "
               f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out == "[]"


def test_schema_choices_and_supported_types_come_from_the_descriptors():
    choices = ("auto",) + families.family_names()
    assert ModelConfig.__dataclass_fields__["family"].metadata["choices"] == choices
    assert flag_table()["--model-family"].choices == choices
    assert "qwen2_5_vl" in families.family_names() and "qwen2_5_vl" in families.model_types()
    assert families.QWEN2_5_VL.modalities == ("images",)
    for mod in (check_context, layout_checks, model_checks):
        assert not hasattr(mod, "SUPPORTED_MODEL_TYPES") and not hasattr(mod, "FAMILY_MODALITIES")


def _problems(tmp_path, config: dict, *components: str) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    # (a default-sized vision tower at the default --max-pixels: the memory forecast is not under test here)
    args = ["--hf-model", str(tmp_path), "--allow-random-init", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--gpu-memory-gb", "100000"]
    for c in components:
        args += ["--component", c]
    return [str(p) for p in check_config(load_config(args)).problems]


def test_a_registered_descriptor_is_all_check_config_needs(tmp_path, monkeypatch):
    toy = FamilySpec(name="toy_audio", model_types=("toy_audio",),
                     encoders={"audio": EncoderLimits(tower="audio tower", implementation="toy", pp=True)},
                     language_dims=lambda cfg: LanguageDims(heads=cfg["heads"], kv_heads=cfg["heads"], layers=6),
                     adapter="nowhere:Nothing")
    monkeypatch.setitem(families._FAMILIES, toy.name, toy)
    cfg = {"model_type": "toy_audio", "heads": 6}
    assert _problems(tmp_path, cfg, "language=tp=2,pp=3,dp=1", "audio=pp=2,dp=1,rank_offset=6") == []
    probs = _problems(tmp_path, cfg, "language=tp=4,dp=1", "images=dp=1,rank_offset=4")
    assert any("[04] module 'images' is not a modality of toy_audio models; use one of: language, audio" in p
               for p in probs), probs
    assert any("language.tp=4 does not divide the model's 6 attention heads" in p for p in probs), probs
    probs = _problems(tmp_path, cfg, "language=dp=1", "audio=tp=2,dp=1,rank_offset=1")
    assert any("audio.tp=2: the toy audio tower runs unsharded" in p for p in probs), probs
    probs = _problems(tmp_path, {"model_type": "llava"}, "language=dp=1", "images=dp=1,rank_offset=1")
    assert any("'llava' is not supported; supported model types: qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_vl_moe, qwen3_5_moe, toy_audio" in p for p in probs), probs


def test_adapters_point_at_their_descriptor():
    from mimo_sft.errors import UserError
    from mimo_sft.model import supported_families
    from mimo_sft.model.qwen2_5_vl import Qwen25VLAdapter
    from mimo_sft.model.registry import adapter_for, get_family

    assert Qwen25VLAdapter.spec is families.QWEN2_5_VL
    for spec in families.families():
        adapter = adapter_for(spec)
        assert adapter.spec is spec and adapter.name == spec.name and adapter.model_types == spec.model_types
        for mt in spec.model_types:
            assert get_family({"model_type": mt}, hf_dir="M") is adapter
    assert supported_families() == sorted(families.family_names())
    with pytest.raises(UserError, match="'llava' is not supported; supported model types: qwen2_5_vl, qwen3_vl"):
        get_family({"model_type": "llava"}, hf_dir="M")


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    out = set()
    for node in ast.walk(tree):  # function-level (lazy) imports count too
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_family_adapter_import_cycle():
    assert not any(m.startswith("mimo_sft.model.qwen") or m == "mimo_sft.model.registry"
                   for m in _imports("mimo_sft/model/family.py"))
    assert "mimo_sft.model.registry" not in _imports("mimo_sft/model/qwen2_5_vl.py")
    out = _run("import sys, mimo_sft.model.qwen2_5_vl; print('mimo_sft.model.registry' in sys.modules)")
    assert out == "False"


def test_one_constant_per_module_name():
    from mimo_sft.model import family
    from mimo_sft.parallel import layout

    assert (layout.LANGUAGE, layout.IMAGES) == ("language", "images")
    assert family.IMAGES is layout.IMAGES
    for path in ("mimo_sft/config/checks/layout.py", "mimo_sft/config/checks/context.py", "mimo_sft/config/families.py", "mimo_sft/model/family.py",
                 "mimo_sft/model/builder.py", "mimo_sft/model/qwen2_5_vl.py", "mimo_sft/plan/__init__.py"):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        defined = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                   if isinstance(t, ast.Name)}
        assert not defined & {"LANGUAGE", "IMAGES"}, path


LAYOUTS = [
    ("language=tp=1,dp=2", "images=dp=2,rank_offset=2"),
    ("language=dp=2", "images=dp=2"),
    ("language=dp=2", "images=tp=2,dp=1"),  # colocated fan-out: a note, not a problem
    ("language=pp=2,dp=1", "images=dp=1,rank_offset=2"),
    ("language=dp=2", "images=tp=2,dp=1,rank_offset=2"),
    ("language=dp=1", "images=pp=2,dp=1,rank_offset=1"),
    ("language=dp=1", "images=cp=2,dp=1,rank_offset=1"),
    ("language=tp=4,dp=1", "images=dp=1,rank_offset=4"),
    ("language=pp=4,dp=1", "images=dp=1,rank_offset=4"),
    ("language=cp=2,dp=1", "images=dp=1,rank_offset=2"),
    ("language=pp=2,dp=1", "images=dp=2"),
    ("language=dp=2", "audio=dp=2,rank_offset=2"),
]


@pytest.mark.parametrize("components", LAYOUTS, ids=["|".join(c) for c in LAYOUTS])
def test_the_builder_asserts_exactly_what_check_config_refuses(tmp_path, components):
    """Checks 3, 4, 10, 11, 12 and 16 refuse a layout for a checkpoint iff ``_check_layout`` asserts on it."""
    from transformers import Qwen2_5_VLConfig

    from mimo_sft.model.builder import _check_layout
    from mimo_sft.model.registry import adapter_for
    from mimo_sft.parallel.components import parse_component
    from mimo_sft.parallel.layout import Layout

    hf_cfg = Qwen2_5_VLConfig(text_config=dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                               hidden_size=64))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg.to_dict()))
    # (a default-sized vision tower at the default --max-pixels: the memory forecast is not under test here)
    args = ["--hf-model", str(tmp_path), "--allow-random-init", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--gpu-memory-gb", "100000"]
    for c in components:
        args += ["--component", c]
    res = check_config(load_config(args))
    assert all(p.check in (3, 4, 10, 11, 12, 16) for p in res.problems), res.problems
    try:
        _check_layout(Layout.from_specs([parse_component(c) for c in components]), hf_cfg,
                      adapter_for(families.QWEN2_5_VL), "M")
        asserted = False
    except AssertionError:
        asserted = True
    assert asserted == (not res.ok), res.problems


def test_make_tiny_qwen_vl_help_lists_every_family_and_preset():
    """Issue 44 item 5: its --help hid the mixture-of-experts families and presets (hand-written lists)."""
    import os
    import subprocess
    import sys

    from mimo_sft.config.families import family_names
    from mimo_sft.testing.tiny_checkpoint import PRESETS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "make_tiny_qwen_vl.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in family_names()) and all(preset in out for preset in PRESETS), out
