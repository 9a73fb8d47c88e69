"""DeepStack (Qwen3-VL): vision features added to the language hidden states after the first decoder layers.

Why this shape: megatron's MIMO path carries ONE tensor per modality from the encoder to the language
model (through ``BridgeCommunicator`` / ``ColocatedBridgeCommunicator`` when the modules sit on other
ranks), and ``MimoModel.align_embeddings_by_token_positions`` checks only the row count before its
``masked_scatter_``: a tensor wider than the hidden size would pass and scatter wrong values. So the
Qwen3-VL encoder returns one tensor per image-token row, ``[main | deepstack_0 | ... | deepstack_{k-1}]``
(width ``hidden * (1 + k)``, main first, in ``deepstack_visual_indexes`` order), the bridges move it as
any encoder output (their shapes travel with the tensor; the colocated padding of ``train.bridge`` pads
rows, whatever their width), and on the language side :func:`split_deepstack` -- the one place that
reads that layout -- asserts the width and splits it:

* ``main`` goes to megatron's ``align_embeddings_by_token_positions`` (``deepstack_mimo_model_class``);
* ``deepstack_j`` is added to the language hidden states at the image-token positions right after
  decoder layer ``j`` (global index, j = 0..k-1; check 31 keeps them on the first pipeline stage, the
  only one the bridge feeds), as transformers' ``Qwen3VLTextModel`` does
  (``hidden[mask] = hidden[mask] + deepstack_j``): :class:`DeepStackLanguageMixin`.

The positions are the image tokens of the ``input_ids`` the alignment sees (padded rows ``[B, S]`` or
the packed ``[1, T]``), in batch-major order (the encoder's row order), mapped onto the decoder's
sequence-first ``[S, B, H]`` hidden states. Three things make the addition exact in every layout:

* **Sequence parallelism**: the hidden states hold this TP rank's contiguous ``S/tp`` positions
  (the ``PartitionAdapter`` scatter of the combined embeddings), so each rank adds only the rows that
  fall in its shard; every TP rank holds all rows (the bridge gives each the whole tensor), and the
  rows' gradient -- non-zero on one rank per row -- is summed over TP (exact: the others add zeros).
* **Recomputation**: megatron's checkpoint is re-entrant, and a layer's forward hook that reached the
  bridge's graph from inside a checkpointed region would backpropagate into the encoder from the
  nested backward (a second pass through its graph). The layers therefore add a detached copy of the
  rows (``DeepStackInputs.features``, a leaf that gathers the rows' gradient from every layer and
  every recomputation), and :class:`_ReturnFeatureGrad`, an identity on the combined embeddings, hands
  that gradient to the bridge's tensor when the backward reaches the decoder's input -- after every
  layer's backward.
* **Pipelining (1F1B)**: a later micro-batch's forward can run before an earlier one's backward. A
  recomputed layer must add its own micro-batch's rows, so :class:`_ReplayFeatures`, an identity on
  the decoder's output, makes that micro-batch's rows the ones a recomputing hook reads for the
  duration of its backward (set when the backward enters the decoder, cleared when it leaves).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from mimo_sft.parallel.runtime import host_to


def split_deepstack(features: torch.Tensor, *, hidden: int, num_deepstack: int):
    """``[rows, hidden*(1+k)]`` -> ``(main [rows, hidden], deepstack [rows, hidden*k])`` (views).

    A tensor of another width is an error (never a silent scatter). Zero rows of width ``hidden``
    are accepted too: megatron's MIMO sends ``[0, hidden]`` for a text-only micro-batch on a
    non-colocated layout (``MimoModel._empty_encoder_output``); they carry no feature.
    """
    width = hidden * (1 + num_deepstack)
    if features.dim() == 2 and features.shape[0] == 0 and features.shape[-1] in (hidden, width):
        return features[:, :hidden], features.new_zeros((0, hidden * num_deepstack))
    if features.dim() != 2 or features.shape[-1] != width:
        raise AssertionError(
            f"DeepStack encoder output has shape {tuple(features.shape)}; expected [rows, {width}] = [main | "
            f"{num_deepstack} deepstack features] of hidden size {hidden}")
    return features[:, :hidden], features[:, hidden:]


@dataclass
class DeepStackInputs:
    """One micro-batch's deepstack rows on this rank and where they go in its ``[S_local, B, H]``."""

    features: torch.Tensor  # [rows, hidden*k] leaf: every image token's features (gathers their gradient)
    rows: torch.Tensor  # [r] which of them fall in this rank's share of the sequence
    seq_index: torch.Tensor  # [r] their positions s in the local hidden states
    batch_index: torch.Tensor  # [r] their samples b
    hidden: int
    #: the group whose ranks each hold a share of the sequence (tp under sequence parallelism, cp under context
    #: parallelism, or both): the rows' gradient is summed over it; None when every rank holds the whole sequence
    sp_group: object = None

    def feature(self, j: int) -> torch.Tensor:
        """``deepstack_j`` of this rank's rows ``[r, hidden]``."""
        return self.features[self.rows, j * self.hidden:(j + 1) * self.hidden]


def deepstack_inputs(input_ids: torch.Tensor, image_token_id: int, features: torch.Tensor, *, hidden: int,
                     sp_group=None, shard: Optional[tuple[int, int]] = None,
                     host_positions: Optional[torch.Tensor] = None, cp_split=None, grad_group=None) -> DeepStackInputs:
    """Where each deepstack row goes: the image tokens of ``input_ids [B, S]`` in batch-major order, kept
    where they fall in this rank's ``S / tp`` positions when the sequence is scattered: ``shard`` =
    ``(rank, tp)``, by default ``sp_group``'s (megatron's scatter gives rank r the r-th contiguous chunk).
    ``host_positions``: those tokens' positions in the flattened ``[B*S]``, known on the host
    (``model.token_positions``): the indices are then built there and copied once (no device read).
    ``cp_split`` (context parallelism, ``model.context_parallel``; needs ``host_positions`` of the packed
    ``[1, T]``): only the rows of this rank's positions are kept, at their local slots, before the tp shard.
    ``grad_group``: the group the rows' gradient is summed over (default ``sp_group``; every rank that holds a
    share of the sequence: tp under sequence parallelism, cp, or both)."""
    length = input_ids.shape[1]
    if host_positions is not None:
        batch_index, seq_index = host_positions // length, host_positions % length
    else:
        batch_index, seq_index = (input_ids == image_token_id).nonzero(as_tuple=True)
    assert features.shape[0] == batch_index.shape[0], (
        f"{batch_index.shape[0]} image tokens but deepstack features of shape {tuple(features.shape)}")
    rows = torch.arange(batch_index.shape[0], device=batch_index.device)
    if cp_split is not None:
        assert host_positions is not None and input_ids.shape[0] == 1, "context parallelism splits one packed row"
        slots = cp_split.slots(host_positions)
        mine = slots >= 0
        rows, batch_index, seq_index = rows[mine], batch_index[mine], slots[mine]
        length = cp_split.local_host.numel()
    if shard is None and sp_group is not None:
        shard = (sp_group.rank(), sp_group.size())
    if shard is not None:
        (rank, tp) = shard
        assert length % tp == 0, f"sequence of {length} positions scattered over {tp} ranks"
        local = length // tp
        mine = (seq_index >= rank * local) & (seq_index < (rank + 1) * local)
        rows, batch_index, seq_index = rows[mine], batch_index[mine], seq_index[mine] - rank * local
    if host_positions is not None:
        rows, seq_index, batch_index = (host_to(t, input_ids.device) for t in (rows, seq_index, batch_index))
    leaf = features.detach().requires_grad_(features.requires_grad)
    return DeepStackInputs(leaf, rows, seq_index, batch_index, hidden, grad_group if grad_group is not None else sp_group)


def add_deepstack(hidden_states: torch.Tensor, inputs: DeepStackInputs, j: int) -> torch.Tensor:
    """``hidden_states [S, B, H]`` with ``deepstack_j`` added at this rank's image-token positions (out of place)."""
    feat = inputs.feature(j).to(hidden_states.dtype)
    return hidden_states.index_put((inputs.seq_index, inputs.batch_index), feat, accumulate=True)


class _ReturnFeatureGrad(torch.autograd.Function):
    """Identity on the combined embeddings; its backward gives the bridge's deepstack tensor the gradient
    the layers accumulated on ``inputs.features`` (summed over TP under sequence parallelism)."""

    @staticmethod
    def forward(ctx, embeddings, bridge_features, inputs, owner):
        ctx.inputs, ctx.owner = inputs, owner
        return embeddings.view_as(embeddings)

    @staticmethod
    def backward(ctx, grad):
        inputs, ctx.owner._replay = ctx.inputs, None
        if not ctx.needs_input_grad[1]:  # a frozen encoder: nothing to return (alike on every TP rank)
            return grad, None, None, None
        g = inputs.features.grad
        if g is None:  # no row fell in this rank's share of the sequence
            g = torch.zeros_like(inputs.features)
        if inputs.sp_group is not None:
            torch.distributed.all_reduce(g, group=inputs.sp_group)
        inputs.features.grad = None
        return grad, g, None, None


class _ReplayFeatures(torch.autograd.Function):
    """Identity on the decoder's output; its backward makes this micro-batch's rows the ones recomputed
    layers add (``DeepStackLanguageMixin._replay``) until ``_ReturnFeatureGrad`` clears them."""

    @staticmethod
    def forward(ctx, hidden, inputs, owner):
        ctx.inputs, ctx.owner = inputs, owner
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        ctx.owner._replay = ctx.inputs
        return grad, None, None


class DeepStackLanguageMixin:
    """For a megatron ``GPTModel`` subclass: adds the pending deepstack features after layers 0..k-1.

    ``set_deepstack`` is called by the MIMO model (``deepstack_mimo_model_class``) just before the
    language model's forward; each decoder layer of this stage whose global index is < k gets a forward
    hook that adds its feature to the layer's output hidden states. A stage without those layers
    (pipeline stage > 0) never sees a feature. See the module docstring for ``_replay``.
    """

    def init_deepstack(self, num_deepstack: int) -> None:
        self.num_deepstack = int(num_deepstack)
        self._deepstack: Optional[DeepStackInputs] = None  # this forward's rows
        self._replay: Optional[DeepStackInputs] = None  # the rows of the micro-batch being backpropagated
        hooked = set()
        for layer in self.decoder.layers:
            j = layer.layer_number - 1  # megatron's layer_number is global and 1-based
            if j < self.num_deepstack:
                layer.register_forward_hook(self._deepstack_hook(j))
                hooked.add(j)
        # only the first stage gets the encoder's rows: it must hold every DeepStack layer (check 31)
        expected = set(range(self.num_deepstack)) if self.pre_process else set()
        assert hooked == expected, (f"DeepStack layers {sorted(hooked)} on this language stage, expected "
                                    f"{sorted(expected)} (check 31 refuses this layout)")
        if hooked:
            self.decoder.register_forward_hook(self._decoder_done)

    def set_deepstack(self, inputs: Optional[DeepStackInputs]) -> None:
        self._deepstack, self._replay = inputs, None

    def _deepstack_hook(self, j: int):
        def hook(module, args, output):
            inputs = self._replay or self._deepstack
            if inputs is None:
                return output
            hidden, *rest = output if isinstance(output, tuple) else (output,)
            hidden = add_deepstack(hidden, inputs, j)
            return (hidden, *rest) if isinstance(output, tuple) else hidden

        return hook

    def _decoder_done(self, module, args, output):
        """End of the decoder's forward: later forwards (another micro-batch) bring their own rows, and
        this micro-batch's backward replays its rows into recomputed layers."""
        inputs, self._deepstack = self._deepstack, None
        if inputs is None or not torch.is_grad_enabled() or not output.requires_grad:
            return output
        from megatron.core.utils import make_viewless_tensor

        return make_viewless_tensor(_ReplayFeatures.apply(output, inputs, self), requires_grad=True, keep_graph=True)


@functools.lru_cache(maxsize=None)
def deepstack_mimo_model_class(modality: str, num_deepstack: int) -> type:
    """megatron's ``MimoModel`` whose embedding alignment splits ``modality``'s DeepStack rows off."""
    from megatron.core.models.mimo import MimoModel
    from megatron.core.utils import make_viewless_tensor, unwrap_model

    from mimo_sft.model.token_positions import host_positions_class

    class DeepStackMimoModel(host_positions_class(MimoModel)):
        """``align_embeddings_by_token_positions`` takes the main embeddings; the deepstack rows go to the
        language model (``DeepStackLanguageMixin.set_deepstack``), positioned on the same ``input_ids``."""

        def align_embeddings_by_token_positions(self, modality_embeddings, input_ids, special_token_ids):
            language = unwrap_model(self.language_model)
            hidden = language.config.hidden_size
            embeddings = dict(modality_embeddings)
            wide = embeddings.get(modality)
            if wide is None:
                language.set_deepstack(None)
                return super().align_embeddings_by_token_positions(embeddings, input_ids, special_token_ids)
            embeddings[modality], features = split_deepstack(wide, hidden=hidden, num_deepstack=num_deepstack)
            combined = super().align_embeddings_by_token_positions(embeddings, input_ids, special_token_ids)
            if features.shape[0] == 0:
                language.set_deepstack(None)
                return combined
            adapter = self.partition_adapter
            sp_group = adapter.cfg.tp_group if adapter is not None and adapter.cfg.seq_parallel else None
            positions = self._positions_for(input_ids)
            split = self._cp_split  # context parallelism (model.context_parallel): this rank's positions only
            grad_group = None
            if split is not None:
                grad_group = language.pg_collection.tp_cp if sp_group is not None else split.group
            inputs = deepstack_inputs(input_ids, special_token_ids[modality], features, hidden=hidden, sp_group=sp_group,
                                      host_positions=positions.host[modality] if positions is not None else None,
                                      cp_split=split, grad_group=grad_group)
            language.set_deepstack(inputs)
            if not torch.is_grad_enabled() or not (combined.requires_grad or features.requires_grad):
                return combined
            out = _ReturnFeatureGrad.apply(combined, features, inputs, language)
            return make_viewless_tensor(out, requires_grad=True, keep_graph=True)

    DeepStackMimoModel.__qualname__ = DeepStackMimoModel.__name__
    return DeepStackMimoModel
