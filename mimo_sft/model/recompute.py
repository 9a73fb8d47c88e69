"""Activation recomputation and sequence parallelism: the model's side of ``--recompute-*`` and
``--sequence-parallel`` (the rules that refuse bad combinations are checks 21 and 22,
``config.checks.memory``).

* Language: megatron's own ``TransformerConfig`` settings (``recompute_granularity`` 'selective'
  with ``recompute_modules``, or 'full' with ``recompute_method`` uniform/block and
  ``recompute_num_layers``), so the recomputed forward is megatron's, RNG tracker included.
  megatron's checkpoint is re-entrant: a checkpointed region whose inputs need no gradient returns
  an output that needs none, and the trainable weights inside it (LoRA adapters behind a frozen
  embedding, say) would silently get no gradient. ``require_decoder_input_grad`` makes the decoder's
  input require grad on the ranks where it does not (its gradient is computed and dropped).
* Vision tower: transformers' activation checkpointing of every vision block (``Qwen2_5_VLVisionBlock``, ``Qwen3VLVisionBlock``)
  (``torch.utils.checkpoint``, non-reentrant, ``preserve_rng_state=True``: a recomputed block draws
  the same random numbers as its first forward), frozen or trained, LoRA adapters included.
* Sequence parallelism (language tp > 1): megatron's flag; norms are ``model.norm.RMSNorm`` (weight
  reduced over TP), the MIMO embedding scatter is megatron's ``PartitionAdapter`` (the combined text
  and image embeddings are scattered after alignment, so the language embedding does not scatter).
"""

from __future__ import annotations

import torch

from mimo_sft.config.lora import split_targets



def language_memory_settings(model_cfg, *, tp: int) -> dict:
    """The ``TransformerConfig`` fields for ``model_cfg``'s recompute and sequence-parallel settings.

    Sequence parallelism at tp 1 is off (check 22 says so in a note; megatron refuses it there).
    """
    out = {"sequence_parallel": bool(getattr(model_cfg, "sequence_parallel", False)) and tp > 1}
    granularity = getattr(model_cfg, "recompute_granularity", None)
    if granularity:
        out["recompute_granularity"] = granularity
        if granularity == "full":
            out.update(recompute_method=model_cfg.recompute_method, recompute_num_layers=model_cfg.recompute_num_layers)
        else:
            out["recompute_modules"] = split_targets(model_cfg.recompute_modules)  # "a,b" (flag) or a list (YAML)
    return out


def _input_requires_grad(module, args, kwargs):
    """Forward pre-hook of the decoder (``TransformerBlock``): see the module docstring."""
    hidden = kwargs.get("hidden_states")
    if (module.training and torch.is_grad_enabled() and isinstance(hidden, torch.Tensor)
            and not hidden.requires_grad):
        kwargs["hidden_states"] = hidden.detach().requires_grad_(True)
    return args, kwargs


def require_decoder_input_grad(language_model) -> None:
    """Under language recomputation, the decoder's input always requires grad (module docstring)."""
    language_model.decoder.register_forward_pre_hook(_input_requires_grad, with_kwargs=True)


def enable_vision_recompute(encoder) -> None:
    """Non-reentrant, RNG-preserving gradient checkpointing of every block of an HF vision tower."""
    encoder.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": True})
