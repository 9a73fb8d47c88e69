"""Every rule a layout and config must satisfy, checked before any process starts (``validate``, and
``finetune`` on every rank before step 0). One module per concern; the numbered list is ``registry``.

- ``context``: ``CheckContext`` (what a check reads), ``Problem``, shared helpers.
- ``layout`` (1-12), ``data`` (13, 14, 17, 19), ``checkpoint`` (15, 24, 34), ``model`` (16, 18),
  ``training`` (20, 29), ``memory`` (21-23), ``data_scale`` (25), ``paths`` (26, 27), ``validation`` (28),
  ``family`` (30), ``deepstack`` (31), ``overlap`` (33).
- ``registry``: ``CHECKS`` in order, ``check_config``, ``require_valid``.

Pure: no torch.distributed, no megatron; a model family's limits come from ``config.families``. Callers
use ``mimo_sft.validate``, which hands check 23 its forecaster (``memory.check``): config/ never imports
memory/. Nothing is re-exported here.
"""
