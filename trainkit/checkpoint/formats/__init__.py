"""The checkpoint formats: one storage interface, and one class per format behind it.

- :mod:`~trainkit.checkpoint.formats.base`: the :class:`~trainkit.checkpoint.formats.base.Storage` interface the
  checkpointer talks to, and the :class:`~trainkit.checkpoint.formats.base.SaveRequest` a save hands it;
- :mod:`~trainkit.checkpoint.formats.pt`: ``ckpt.format="file"``,
  :class:`~trainkit.checkpoint.formats.pt.PtStorage` (``last.pt``/``best.pt``, rank 0 writes), with its background
  writer in :mod:`~trainkit.checkpoint.formats.async_save`;
- :mod:`~trainkit.checkpoint.formats.dcp`: ``ckpt.format="sharded"``,
  :class:`~trainkit.checkpoint.formats.dcp.DcpStorage` (``last.ckpt/``/``best.ckpt/``, every rank writes its shards),
  over one directory's writing, publishing and reading (:mod:`~trainkit.checkpoint.formats.dcp_directory`) and
  the reader that treats its files as hostile input (:mod:`~trainkit.checkpoint.formats.dcp_read`).

The :class:`~trainkit.checkpoint.checkpointer.Checkpointer` builds one of each at construction: a checkpoint is read
in its own format, whatever the run writes, and written in ``ckpt.format``'s.
"""

from __future__ import annotations

from trainkit.checkpoint.formats.base import BestWeights, SaveRequest, Storage
from trainkit.checkpoint.formats.dcp import DcpStorage
from trainkit.checkpoint.formats.pt import PtStorage

__all__ = ["Storage", "SaveRequest", "BestWeights", "PtStorage", "DcpStorage"]
