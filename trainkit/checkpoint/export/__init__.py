"""Weights written for other programs (``python -m trainkit export``), apart from the checkpoint formats a run resumes.

- :mod:`~trainkit.checkpoint.export.target`: where an export may write (never a checkpoint, never over anything
  but an earlier export), for every export format;
- :mod:`~trainkit.checkpoint.export.safetensors_files`: weights as safetensors files, laid out as the Hugging Face
  hub lays them out.

An export is not a checkpoint: nothing resumes from it, and its formats are other programs' (a torch state dict, the
hub's safetensors), so it lives beside :mod:`trainkit.checkpoint.formats`, not in it.
"""
