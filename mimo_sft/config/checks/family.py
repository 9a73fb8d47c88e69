"""Check 30: the checkpoint's family is the one asked for, and its own limits hold (registered in
``config.checks``).

Pure like the other checks (``config.checks.CheckContext``); every rule reads the family descriptor
(``config.families``): ``--model-family`` against config.json's ``model_type`` (either way round). A ``model_type``
no family reads (``qwen3_vl_moe``, ``qwen3_5_moe`` named as not yet supported) is check 16's line; the
encoder's parallel limits (images tp > 1 on its own ranks) are check 10's, from the same descriptor.
"""

from __future__ import annotations

import os

from mimo_sft.config import families


def c30_model_family(ctx):
    m = ctx.cfg.model
    if ctx.hf_config is None:
        return
    model_type = ctx.hf_config.get("model_type")
    where = f"--hf-model {os.path.join(m.hf_model, 'config.json')}" if m.hf_model else "config.json"
    mismatch = families.family_mismatch(m.family, model_type, where)
    if mismatch:
        yield mismatch
