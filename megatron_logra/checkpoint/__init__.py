"""Checkpoints: one home for their layout, manifest, meta, saving and loading.

- ``layout``: folder names (``SAVE/latest``, ``iter_*``, ``.partial``, ``.old``), selection,
  pruning; pure path work.
- ``manifest``: every file's size and CRC32, written last and checked before any use.
- ``meta``: ``CheckpointMeta``, typed (``megatron_logra.json``), and the checks against it.
- ``state``: ``ResumableState``, the stateful parts (scheduler, baseline, KL controller)
  registered by name.
- ``sharded_state``: the model's and optimizer's megatron-core sharded state dicts.
- ``save``: ``CheckpointCommit``, the all-or-nothing write both training and the
  converters go through.
- ``load``: ``open_checkpoint``, ``load_checkpoint``, ``load_model_weights``,
  ``find_resume_checkpoint``.
- ``config``: ``CheckpointConfig``, the ``--save*``/``--load`` settings.
- ``manager``: ``CheckpointManager``, training's checkpoint rules: the resumable parts,
  the meta, cadence, keep-k and which checkpoint a run starts from (the loop says
  ``save``, ``training.prepare`` says ``load``).
"""
