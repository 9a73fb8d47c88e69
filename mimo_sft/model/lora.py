"""LoRA adapters on the MIMO model's linears, tensor-parallel aware, merged back for export.

Why the layers keep their names: an adapted layer stays the same object with the same parameter
names (``linear_qkv.weight``), its class swapped for a subclass that adds ``lora_a`` ``[r, in]`` and
``lora_b`` ``[out, r]`` and adds ``scaling * B(A(dropout(x)))`` to its output. HF weight loading,
checkpoint keys of the base weights and export therefore work unchanged, and :func:`merge_lora`
folds the adapters into the weights and restores the original class.

Tensor parallelism (megatron's local ``ColumnParallelLinear`` / ``RowParallelLinear``):

* column-parallel (``linear_qkv`` or a Gated DeltaNet's ``in_proj``, ``linear_fc1``; output
  sharded): A whole and replicated, B holds
  this rank's output rows. ``A x`` goes through megatron's copy-to-TP region, whose backward
  all-reduces ``dL/d(Ax)`` over TP: every rank then has the full gradient of A (identical on all
  TP ranks) and the full input gradient of the adapter path.
* row-parallel (``linear_proj`` or a GDN's ``out_proj``, ``linear_fc2``; input sharded): A holds this rank's input
  columns, its partial product is all-reduced over TP (reduce-from-TP region, identity backward),
  B whole and replicated; ``dL/dB`` is the same on every rank because the output is.
* with ``--sequence-parallel`` the column layer's input and the row layer's output hold 1/tp of the
  positions, as megatron's own layers do: ``A x`` is all-gathered along the sequence (column; backward
  reduce-scatter) or reduce-scattered along it (row; backward all-gather) instead, and the replicated
  adapter (column A, row B), whose gradient then covers this rank's positions only, is marked
  ``sequence_parallel`` so that megatron's ``finalize_model_grads`` sums it over TP.

Replicated adapters are marked ``tensor_model_parallel=False`` and sharded ones ``True`` with their
partition dim, so megatron's grad-norm (``param_is_not_tensor_parallel_duplicate``) counts each
replicated tensor once (tp rank 0) and checkpoints shard B (column) and A (row) over TP, B's rows
stored as the weight's are: fc1's split into gate and up (megatron's swiglu factory), a GDN
``in_proj``'s into its named q/k/v/z/beta/alpha sections (rank r holds ``[q_r; k_r; v_r; z_r;
b_r; a_r]``, not a contiguous slice of the whole; megatron's ``<linear>_split_sections``), so
any TP reads any other's adapters.

A mixture-of-experts model's sparse layers get no MLP adapters: ``linear_fc1`` / ``linear_fc2`` adapt the
dense layers' MLP only, and the experts and routers stay frozen under LoRA (transformers stores
Qwen3-VL-MoE's experts as fused 3-D parameters, which PEFT adapts only through ``target_parameters``, a
different adapter than a per-expert LoRA; not built here). Attention is adapted as in a dense model.

Initialisation is layout-free: A is drawn whole from a generator seeded by ``(seed, layer name with
its global layer number)`` and sliced (row-parallel), PEFT's Kaiming-uniform bound 1/sqrt(in); B = 0.
The vision tower (transformers' plain ``nn.Linear``, TP 1) gets the same adapter without
collectives. Dropout draws from megatron's RNG tracker (see ``_lora_dropout_input``).
"""

from __future__ import annotations

import math
import zlib
from typing import Iterator

import torch
import torch.nn.functional as F

from mimo_sft.config.lora import LANGUAGE_TARGETS, LoraSpec
from mimo_sft.parallel.layout import IMAGES

#: language target -> the linears it may adapt, each (attribute path inside a TransformerLayer, column- or
#: row-parallel); a layer has exactly one of them: its token mixer is attention or, in a hybrid decoder
#: (Qwen3.5), megatron's ``GatedDeltaNet`` (``config.lora``: why the mixer targets cover both)
LANGUAGE_LAYERS = {"linear_qkv": (("self_attention.linear_qkv", "column"), ("self_attention.in_proj", "column")),
                   "linear_proj": (("self_attention.linear_proj", "row"), ("self_attention.out_proj", "row")),
                   "linear_fc1": (("mlp.linear_fc1", "column"),),
                   "linear_fc2": (("mlp.linear_fc2", "row"),)}
#: the vision targets; which encoder linears each adapts is the family's: its encoder class's
#: ``LORA_LAYERS`` (target -> regex full-matching the module names) and ``is_projector`` (name rule)
VISION_TARGETS = ("vision_attn", "vision_mlp", "merger")


class _LoraMixin:
    """What every adapted layer adds; ``lora_kind`` is 'column', 'row' or 'plain'."""

    lora_kind: str

    def _lora_setup(self, spec: LoraSpec, a: torch.Tensor, b: torch.Tensor, *, tp_group=None, swiglu: bool = False,
                    b_split=None):
        self.lora_a = torch.nn.Parameter(a)
        self.lora_b = torch.nn.Parameter(b)
        self.lora_scaling = spec.scaling
        self.lora_dropout = spec.dropout
        self.lora_tp_group = tp_group
        self.lora_swiglu = swiglu  # fc1's B is [gate rows; up rows] per rank, checkpointed like its weight
        self.lora_b_split = b_split  # (rows per section on this rank, section names): B checkpointed by section
        if self.lora_kind != "plain":
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            sharded, replicated, dim = ((self.lora_b, self.lora_a, 0) if self.lora_kind == "column"
                                        else (self.lora_a, self.lora_b, 1))
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)
            set_tensor_model_parallel_attributes(replicated, False, -1, 1)
            # under sequence parallelism the replicated adapter sees 1/tp of the positions on each rank:
            # megatron's finalize_model_grads sums its gradient over TP (as for the norms)
            replicated.sequence_parallel = self._lora_sequence_parallel()

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout and self.training:
            x = self._lora_dropout_input(x)
        h = F.linear(x, self.lora_a)
        tp = self.lora_tp_group
        if tp is not None and tp.size() > 1:
            from megatron.core.tensor_parallel import mappings

            if self._lora_sequence_parallel():  # x holds 1/tp of the positions (column) / the output does (row)
                h = (mappings.gather_from_sequence_parallel_region(h, group=tp) if self.lora_kind == "column"
                     else mappings.reduce_scatter_to_sequence_parallel_region(h, group=tp))
            else:
                h = (mappings.copy_to_tensor_model_parallel_region(h, group=tp) if self.lora_kind == "column"
                     else mappings.reduce_from_tensor_model_parallel_region(h, group=tp))
        return F.linear(h, self.lora_b) * self.lora_scaling

    def _lora_sequence_parallel(self) -> bool:
        """megatron's linear runs sequence-parallel (its input or output split over TP by position)."""
        return self.lora_kind != "plain" and bool(getattr(self, "sequence_parallel", False))

    def _lora_dropout_input(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter's input from a tracked stream: the column-parallel input is replicated,
        so every TP rank must drop the same entries (a stream seeded alike on the TP group); the
        row-parallel input is this rank's shard (megatron's per-TP-rank stream). Both streams live in
        megatron's RNG tracker, which checkpoints save per rank: a same-layout resume stays exact."""
        if self.lora_kind == "plain":
            return F.dropout(x, self.lora_dropout)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        shared = self.lora_kind == "column" and not self._lora_sequence_parallel()  # input replicated over TP
        with (tracker.fork(DROPOUT_RNG) if shared else tracker.fork()):
            return F.dropout(x, self.lora_dropout)

    def _lora_sharded(self, sd: dict, prefix: str, sharded_offsets, metadata) -> dict:
        """Replace the base class's (replicated) entries for the adapters by TP-sharded ones."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        for name in ("lora_a", "lora_b"):
            sd.pop(prefix + name, None)
        axis = {"lora_b": 0} if self.lora_kind == "column" else {"lora_a": 1}
        extra = make_sharded_tensors_for_checkpoint({"lora_a": self.lora_a, "lora_b": self.lora_b}, prefix, axis,
                                                    sharded_offsets, tp_group=self.tp_group,
                                                    dp_cp_group=metadata["dp_cp_group"])
        if self.lora_b_split:  # the weight's named row sections (a GDN in_proj): one stored tensor each
            from megatron.core.ssm.utils import _split_tensor_factory

            sections, names = self.lora_b_split
            extra[prefix + "lora_b"] = _split_tensor_factory(extra[prefix + "lora_b"], list(sections), list(names), 0)
        if self.lora_swiglu:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            extra[prefix + "lora_b"] = apply_swiglu_sharded_factory(
                extra[prefix + "lora_b"], sharded_offsets, metadata.get("singleton_local_shards", False),
                tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        sd.update(extra)
        return sd

    def merged_weight(self) -> torch.Tensor:
        """``W + scaling * B A`` (computed in fp32), for a TP-1 layer."""
        delta = (self.lora_b.float() @ self.lora_a.float()) * self.lora_scaling
        return (self.weight.float() + delta).to(self.weight.dtype)


_CLASSES: dict[type, type] = {}
#: megatron RNG tracker stream for column-parallel adapter dropout (same on a TP group)
DROPOUT_RNG = "mimo-sft-lora-dropout"


def _lora_class(base: type, kind: str) -> type:
    """The subclass of ``base`` with the adapter (one per base class)."""
    if base not in _CLASSES:
        if kind == "column":
            def forward(self, input_, weight=None, runtime_gather_output=None):
                assert weight is None and not (runtime_gather_output or self.gather_output), "LoRA on a gathered layer"
                out, bias = base.forward(self, input_)
                return out + self.lora_delta(input_), bias
        elif kind == "row":
            def forward(self, input_):
                out, bias = base.forward(self, input_)
                return out + self.lora_delta(input_), bias
        else:
            def forward(self, input):  # noqa: A002 - nn.Linear's name
                return base.forward(self, input) + self.lora_delta(input)
        body = {"forward": forward, "lora_kind": kind, "_lora_base": base}
        if kind != "plain":
            def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
                sd = base.sharded_state_dict(self, prefix, sharded_offsets, metadata)
                return self._lora_sharded(sd, prefix, sharded_offsets, metadata)
            body["sharded_state_dict"] = sharded_state_dict
        _CLASSES[base] = type(f"Lora{base.__name__}", (_LoraMixin, base), body)
    return _CLASSES[base]


def _full_a(spec: LoraSpec, in_full: int, key: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    bound = 1.0 / math.sqrt(in_full)
    return (torch.rand(spec.rank, in_full, generator=g, dtype=torch.float64) * 2 - 1) * bound


def _adapt(module: torch.nn.Module, kind: str, spec: LoraSpec, key: str, seed: int, *, swiglu: bool = False,
           b_split=None) -> None:
    w = module.weight
    out_local, in_local = w.shape
    tp_group = getattr(module, "tp_group", None) if kind != "plain" else None
    tp = tp_group.size() if tp_group is not None else 1
    rank = tp_group.rank() if tp_group is not None else 0
    in_full = in_local * tp if kind == "row" else in_local
    a = _full_a(spec, in_full, key, seed)
    if kind == "row":
        a = a[:, rank * in_local:(rank + 1) * in_local]
    a = a.to(dtype=w.dtype, device=w.device).contiguous()
    b = torch.zeros(out_local, spec.rank, dtype=w.dtype, device=w.device)
    module.__class__ = _lora_class(type(module), kind)
    module._lora_setup(spec, a, b, tp_group=tp_group, swiglu=swiglu, b_split=b_split)


def apply_lora(model, spec: LoraSpec, *, seed: int, dp_rank: int = 0) -> int:
    """Freeze the base weights LoRA replaces and add adapters to ``model`` (a bare ``MimoModel``, before
    DDP; this rank's modules). ``dp_rank``: this rank's language DP rank (seeds the dropout stream
    shared by its TP group). Returns the number of adapted layers on this rank."""
    count = 0
    lm = model.language_model
    if lm is not None and spec.dropout > 0 and spec.language:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        if DROPOUT_RNG not in tracker.get_states():
            tracker.add(DROPOUT_RNG, seed + 1_000_003 + 1009 * dp_rank)
    if lm is not None:
        for p in lm.parameters():
            p.requires_grad_(False)
        gated = bool(getattr(lm.config, "gated_linear_unit", False))
        for layer in lm.decoder.layers:
            g = layer.layer_number - 1  # global layer index: the same key under any PP split
            for target in spec.language:
                if target in MLP_TARGETS and is_sparse_layer(layer):
                    continue  # a mixture-of-experts layer: experts and router stay frozen (module docstring)
                path, kind = layer_linear(layer, target)
                _adapt(layer.get_submodule(path), kind, spec, f"language.layers.{g}.{path}", seed,
                       swiglu=gated and target == "linear_fc1", b_split=_row_sections(layer, path))
                count += 1
    vision = [t for t in spec.targets if t in VISION_TARGETS]
    if vision and IMAGES in model.modality_submodules and model.modality_submodules[IMAGES] is not None:
        for enc in model.modality_submodules[IMAGES].encoders.values():
            count += _adapt_vision(enc, vision, spec, seed)
    return count


#: the language targets of the dense MLP
MLP_TARGETS = ("linear_fc1", "linear_fc2")


def is_sparse_layer(layer) -> bool:
    """A mixture-of-experts decoder layer: its MLP is megatron's ``MoELayer`` (a router and experts)."""
    return hasattr(getattr(layer, "mlp", None), "router")


def _has_submodule(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def layer_linear(layer, target: str) -> tuple[str, str]:
    """(path, 'column' or 'row') of the linear language ``target`` adapts in decoder ``layer``: the one of
    its ``LANGUAGE_LAYERS`` entries the layer has (an AssertionError if it has none or several: a layer
    kind this module does not know)."""
    found = [(path, kind) for path, kind in LANGUAGE_LAYERS[target] if _has_submodule(layer, path)]
    assert len(found) == 1, (f"LoRA target {target}: decoder layer {layer.layer_number} "
                             f"({type(layer.self_attention).__name__}) has {len(found)} of "
                             f"{[p for p, _ in LANGUAGE_LAYERS[target]]}")
    return found[0]


def _row_sections(layer, path: str):
    """(rows per section on this rank, names) when the linear's owner checkpoints its weight in named row
    sections (megatron's ``<linear>_split_sections`` / ``_split_names``: a GatedDeltaNet's ``in_proj``), else
    None; B's rows follow the weight's."""
    owner_path, _, leaf = path.rpartition(".")
    owner = layer.get_submodule(owner_path) if owner_path else layer
    sections, names = (getattr(owner, f"{leaf}_split_sections", None), getattr(owner, f"{leaf}_split_names", None))
    return (tuple(sections), tuple(names)) if sections is not None and names is not None else None


def _adapt_vision(enc, vision: list, spec: LoraSpec, seed: int) -> int:
    """Freeze what the vision targets replace and adapt the linears the family's encoder names for them."""
    import re

    for name, p in enc.named_parameters():
        is_proj = enc.is_projector(name)
        if ("merger" in vision and is_proj) or (set(vision) - {"merger"} and not is_proj):
            p.requires_grad_(False)
    pattern = re.compile("|".join(f"(?:{enc.LORA_LAYERS[t]})" for t in vision))
    count = 0
    for name, module in list(enc.named_modules()):
        if isinstance(module, torch.nn.Linear) and pattern.fullmatch(name) and not is_lora(module):
            _adapt(module, "plain", spec, f"vision.{name}", seed)
            count += 1
    return count


def is_lora(module) -> bool:
    return isinstance(module, _LoraMixin)


def lora_modules(model) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        if is_lora(module):
            yield name, module


def has_lora(model) -> bool:
    return next(lora_modules(model), None) is not None


def merge_lora(model) -> int:
    """Fold every adapter into its weight (TP 1 only: export) and restore the original classes."""
    n = 0
    for _name, module in list(lora_modules(model)):
        assert module.lora_kind == "plain" or module.lora_tp_group is None or module.lora_tp_group.size() == 1, \
            "merge_lora needs a TP-1 model"
        with torch.no_grad():
            module.weight.copy_(module.merged_weight())
        del module.lora_a, module.lora_b
        for attr in ("lora_scaling", "lora_dropout", "lora_tp_group", "lora_swiglu", "lora_b_split"):
            module.__dict__.pop(attr, None)
        module.__class__ = module._lora_base
        n += 1
    return n


def trainable_counts(model) -> tuple[int, int]:
    """(trainable, total) parameter elements of this rank's model."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


__all__ = ["LANGUAGE_TARGETS", "LoraSpec", "apply_lora", "merge_lora", "has_lora", "is_lora", "lora_modules",
           "trainable_counts"]
