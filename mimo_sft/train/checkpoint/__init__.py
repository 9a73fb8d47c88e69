"""A run's checkpoints: what is saved, how it is written, how it is read back (on any layout).

- ``save``: ``save_checkpoint`` / ``restore`` / ``load_model_weights`` / ``save_gradients`` -- the entry points
  the trainer, ``evaluate`` and the export call; the folder layout is in its docstring.
- ``files``: folder rules (``iter_N``, ``.tmp``, ``latest``), fsync order, publish and pruning, ``meta.json``.
- ``write``: the save's host copy and writer thread (``--async-save``), megatron's save requests.
- ``read``: chunked reads of stored tensors (the streamed export reads one group at a time).
- ``model`` / ``optimizer``: the model's and the optimizer's sharded state dicts, layout signatures and formats.
- ``reshard``: ``--save-reshardable``'s form written and read by each DP rank's own shard (boxes), no gather.
- ``spread``: a resume's weights read once per DP group (each rank a part, then broadcast).
- ``lora``: which tensors a LoRA run saves, and which checkpoints a LoRA run may start from.
- ``trusted``: every pickle a load reads, through a restricted reader (a checkpoint runs none of its author's code).
- ``info``: ``mimo-sft checkpoint info`` -- what a folder holds, whether it resumes on a layout, ``--verify``.

Nothing is re-exported here: importing ``files`` or ``info`` must not import megatron.
"""
