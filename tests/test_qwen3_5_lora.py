"""LoRA on Qwen3.5's hybrid decoder against PEFT on transformers' ``Qwen3_5ForConditionalGeneration``, one process.

The tiny checkpoint is test_qwen3_5.py's (four layers: three Gated DeltaNet, one gated full attention;
every tensor moved away from its init). The default targets adapt every decoder linear: attention's
``linear_qkv``/``linear_proj`` and the GDN's ``in_proj``/``out_proj`` (``config.lora``), and the MLP.
Adapters are moved away from their init (B from 0), the adapter is written in PEFT's format and loaded
by ``PeftModel.from_pretrained``: its logits equal ours (fp32, 1e-5), the modules PEFT wraps are every
``nn.Linear`` of transformers' decoder layers, and the merged export (whole model, and streamed as
``mimo-sft export`` streams it) loads in transformers with our logits. Guards: a mapping that swaps
the GDN's z and v rows, or the attention's q and gate rows, moves PEFT's logits past the tolerance.
A GDN in_proj's B is checkpointed in the weight's named row sections: TP 2's ranks write what TP 1
writes, and a 1-rank checkpoint resumes bit for bit and exports (``--adapter-only``) with our logits.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import hf_eager, perturbed_tiny_checkpoint, trained_lora_model

TOL = 1e-5
BATCH = dict(image_grids=[[(4, 6)], [(2, 2), (6, 4)], [(8, 10)]], text_only=1, text_len=40)
PEFT_PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    return perturbed_tiny_checkpoint(tmp_path_factory, "qwen3_5", text_layers=4)


@pytest.fixture(scope="module")
def lora(q35_dir):
    """(our model with the default adapters, "trained": every trainable tensor moved; info; spec)."""
    return trained_lora_model(q35_dir)


@pytest.fixture(scope="module")
def reference(q35_dir, lora):
    """(a batch, its mRoPE positions, our logits, the base model's logits)."""
    from mimo_sft.model.check import hf_forward, hf_position_ids, mimo_forward, random_batch

    model, info, _ = lora
    base = hf_eager(q35_dir)
    batch = random_batch(base.config, seed=8, **BATCH)
    pos = hf_position_ids(base, batch)
    return batch, pos, mimo_forward(model, info, batch, pos), hf_forward(base, batch)[0]


def _peft_logits(q35_dir, adapter_dir, batch):
    from peft import PeftModel

    from mimo_sft.model.check import hf_forward

    peft = PeftModel.from_pretrained(hf_eager(q35_dir), adapter_dir).eval()
    return peft, hf_forward(peft, batch)[0]


def test_default_targets_adapt_both_layer_kinds(lora):
    """Each target adapts the linear its layer has: linear_qkv/linear_proj on the attention layer, the
    GDN's in_proj/out_proj on the others; the language base is frozen, only adapters train there."""
    from mimo_sft.model.lora import lora_modules

    model, _, _ = lora
    layers = model.language_model.decoder.layers
    adapted = sorted(n for n, _ in lora_modules(model))
    mixers = [("in_proj", "out_proj") if type(layer.self_attention).__name__ == "GatedDeltaNet"
              else ("linear_qkv", "linear_proj") for layer in layers]
    assert [m[0] for m in mixers] == ["in_proj"] * 3 + ["linear_qkv"]
    expected = sorted(f"language_model.decoder.layers.{i}.{part}" for i, m in enumerate(mixers)
                      for part in (f"self_attention.{m[0]}", f"self_attention.{m[1]}", "mlp.linear_fc1", "mlp.linear_fc2"))
    assert adapted == expected
    trained = [n for n, p in model.language_model.named_parameters() if p.requires_grad]
    assert trained and all(n.endswith((".lora_a", ".lora_b")) for n in trained), trained


@pytest.mark.parametrize("mutant", [None, "gdn_z_v", "attention_q_gate"])
def test_peft_adapter_gives_our_logits(q35_dir, lora, reference, tmp_path, monkeypatch, mutant):
    """``PeftModel.from_pretrained`` on transformers' model of the folder gives our LoRA model's logits,
    and wraps exactly the decoder's linears (every ``nn.Linear`` of transformers' decoder layers), with as
    many B rows as ours. The mutants (the layout the export follows taken wrong: the GDN's z and v row
    blocks swapped, or the attention's q and output-gate halves) must miss by far."""
    from mimo_sft.model import hybrid_weights as hw
    from mimo_sft.model.check import compare
    from mimo_sft.model.lora_export import write_peft_adapter

    model, info, spec = lora
    batch, _, ours, base_logits = reference
    if mutant == "gdn_z_v":
        original = hw._export_layer

        def swapped(sd, prefix, s, i):
            out = original(sd, prefix, s, i)
            A = f"{prefix}layers.{i}.linear_attn."
            if A + "in_proj_z.weight" in out:
                qkv = out[A + "in_proj_qkv.weight"]
                out[A + "in_proj_qkv.weight"] = torch.cat([qkv[: 2 * s.qk], out[A + "in_proj_z.weight"]])
                out[A + "in_proj_z.weight"] = qkv[2 * s.qk:]
            return out
        monkeypatch.setattr(hw, "_export_layer", swapped)
    elif mutant == "attention_q_gate":
        join = hw.join_q_gate
        monkeypatch.setattr(hw, "join_q_gate", lambda q, gate, head_dim: join(gate, q, head_dim))
    written = write_peft_adapter(model, info, spec, q35_dir, str(tmp_path / "adapter"))
    monkeypatch.undo()
    peft, logits = _peft_logits(q35_dir, str(tmp_path / "adapter"), batch)
    diff = compare(logits, ours, batch["attention_mask"])
    if mutant is not None:
        assert diff > 1e-3, (mutant, diff)
        return
    assert diff <= TOL
    assert compare(base_logits, ours, batch["attention_mask"]) > 1e-3  # the adapters matter
    assert written["modules_to_save"] == ["model.visual"]  # the default: the tower trains beside the adapters
    linears = {n for n, m in hf_eager(q35_dir).named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("model.language_model.layers.")}
    wrapped = {n[len(PEFT_PREFIX):] for n, m in peft.named_modules() if hasattr(m, "lora_A") and "lora_" not in n
               and n.startswith(PEFT_PREFIX + "model.language_model.")}
    assert wrapped == linears and len(linears) == 3 * (5 + 3) + 1 * (4 + 3)
    assert {n.rsplit(".", 1)[1] for n in linears if ".linear_attn." in n} == {
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    peft_rows = sum(m.lora_B["default"].weight.shape[0] for n, m in peft.named_modules()
                    if n[len(PEFT_PREFIX):] in linears and "lora_" not in n.rsplit(".", 1)[1])
    our_rows = sum(p.shape[0] for n, p in model.language_model.named_parameters() if n.endswith(".lora_b"))
    assert peft_rows == our_rows


def test_merged_export_loads_in_transformers_with_our_logits(q35_dir, lora, reference, tmp_path):
    """The merged export through the family's adapter: streamed as ``mimo-sft export`` streams a LoRA
    checkpoint (``merged_weight_reader``: base weights from the folder, the trained tensors on top, each
    adapter folded in), read here from our model's own state; transformers loads it with our logits, and
    it equals the whole-model merge (``merge_lora`` + ``export_model``) bit for bit."""
    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import compare, hf_forward
    from mimo_sft.model.export import export_model, export_weights
    from mimo_sft.model.hf_checkpoint import HFCheckpoint
    from mimo_sft.model.lora import apply_lora, merge_lora
    from mimo_sft.model.lora_export import merged_weight_reader

    model, _, spec = lora
    batch, _, ours, _ = reference
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    held = {n for n, p in model.named_parameters() if p.requires_grad}

    def read_stored(_model, keys):
        return {k: state[k] for k in keys}

    read = merged_weight_reader(read_stored, lambda _model: held, q35_dir,
                                {**spec.to_dict(), "freeze_vision": False, "freeze_projector": False,
                                 "freeze_language": False})
    export_weights(read, q35_dir, str(tmp_path / "streamed"))
    merged, _ = build_single_process_model(q35_dir)  # a copy of ours, merged (the fixture's model stays)
    apply_lora(merged, spec, seed=0)
    missing, unexpected = merged.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    assert merge_lora(merged) == 16
    export_model(merged, q35_dir, str(tmp_path / "whole"))
    streamed, whole = HFCheckpoint(str(tmp_path / "streamed")).full_dict(), HFCheckpoint(str(tmp_path / "whole")).full_dict()
    assert sorted(streamed) == sorted(whole) and all(torch.equal(streamed[k], whole[k]) for k in whole)
    logits, _ = hf_forward(hf_eager(str(tmp_path / "streamed")), batch)
    assert compare(logits, ours, batch["attention_mask"]) <= TOL


class _Group:
    """A stand-in process group of ``size`` ranks seen from ``rank`` (megatron asks only these two)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _stored_parts(module, prefix: str, tp_rank: int, tp: int, lora_b: torch.Tensor) -> dict:
    """``{checkpoint key: (global offset, data)}`` of ``module``'s lora_b as TP rank ``tp_rank`` of ``tp``
    would write it (its B = ``lora_b``)."""
    import types

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from mimo_sft.model.lora import _LoraMixin

    fake = types.SimpleNamespace(lora_kind="column", lora_a=module.lora_a, lora_b=lora_b, tp_group=_Group(tp_rank, tp),
                                 lora_swiglu=False, lora_b_split=tuple(
                                     (tuple(n // tp for n in module.lora_b_split[0]), module.lora_b_split[1])))
    sd = _LoraMixin._lora_sharded(fake, {}, prefix, (), {"dp_cp_group": _Group(0, 1)})
    factory = sd[prefix + "lora_b"]
    assert isinstance(factory, ShardedTensorFactory)
    return {t.key: (t.global_offset, t.local_shape, t.data) for t in factory.build()}


def test_gdn_in_proj_adapter_checkpoints_by_section_whatever_the_tp(lora):
    """A GDN in_proj's B is stored as its weight is, one tensor per named row section (megatron's
    ``in_proj_split_sections``): TP 2's ranks, each holding ``[q_r; k_r; v_r; z_r; b_r; a_r]``, write
    the same tensors as TP 1 -- so a TP-2 run's adapters export (TP 1) and resume on any TP."""
    model, _, _ = lora
    gdn = model.language_model.decoder.layers[0].self_attention
    in_proj = gdn.in_proj
    prefix = "language_model.decoder.layers.0.self_attention.in_proj."
    names, sizes = list(gdn.in_proj_split_names), list(gdn.in_proj_split_sections)
    assert names == ["query", "key", "value", "z", "beta", "alpha"] and in_proj.lora_b_split == (tuple(sizes), tuple(names))
    b = in_proj.lora_b.detach()
    one = _stored_parts(in_proj, prefix, 0, 1, b)
    assert sorted(one) == sorted(f"{prefix}lora_b.{n}" for n in names)
    sections = dict(zip(names, torch.split(b, sizes)))
    for n in names:
        assert torch.equal(one[f"{prefix}lora_b.{n}"][2], sections[n])
    halves = {n: torch.chunk(sections[n], 2) for n in names}
    for r in range(2):
        local = torch.cat([halves[n][r] for n in names])  # rank r's rows, as the weight's load gives them
        for key, (offset, shape, data) in _stored_parts(in_proj, prefix, r, 2, local).items():
            whole = one[key][2]
            assert torch.equal(data, whole[offset[0]: offset[0] + shape[0]]), (key, r)


def test_checkpoint_resumes_and_exports_the_gdn_adapters(q35_dir, lora, reference, tmp_path):
    """A 1-rank LoRA checkpoint (what trains, as the trainer writes it: megatron's torch_dist format) holds
    each GDN in_proj's B as its six sections; a resume reads them back bit for bit into a fresh LoRA
    model, and ``export --adapter-only`` (read through the checkpoint's keys) gives PEFT our logits."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from mimo_sft.model.builder import build_single_process_model
    from mimo_sft.model.check import compare
    from mimo_sft.model.lora import apply_lora
    from mimo_sft.model.lora_export import export_peft
    from mimo_sft.train.checkpoint.model import model_sharded_state_dict
    from mimo_sft.train.checkpoint.save import load_model_weights, model_weight_reader, stored_state_keys

    model, _, spec = lora
    batch, _, ours, _ = reference
    ckpt = tmp_path / "ckpt"
    (ckpt / "model").mkdir(parents=True)
    dist_checkpointing.save(model_sharded_state_dict(model), str(ckpt / "model"), TorchDistSaveShardedStrategy())
    present = set(dist_checkpointing.load_tensors_metadata(str(ckpt / "model")))
    in_proj = "language_model.decoder.layers.0.self_attention.in_proj."
    assert sorted(k for k in present if k.startswith(in_proj)) == sorted(
        [in_proj + "lora_a"] + [f"{in_proj}lora_b.{n}" for n in ("query", "key", "value", "z", "beta", "alpha")])
    fresh, _ = build_single_process_model(q35_dir)
    apply_lora(fresh, spec, seed=5)  # other initial adapters: the load must replace them
    load_model_weights(fresh, str(ckpt))
    mine, loaded = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(mine[k], loaded[k]) for k in mine if isinstance(mine[k], torch.Tensor))
    lora_meta = {**spec.to_dict(), "freeze_vision": False, "freeze_projector": False, "freeze_language": False}
    export_peft(model_weight_reader(str(ckpt)), stored_state_keys(str(ckpt)), q35_dir, str(tmp_path / "peft"), lora_meta)
    _, logits = _peft_logits(q35_dir, str(tmp_path / "peft"), batch)
    assert compare(logits, ours, batch["attention_mask"]) <= TOL
