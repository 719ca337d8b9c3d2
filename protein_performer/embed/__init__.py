"""Embed proteins with a trained model: pooled and per-residue representations.

Why this package exists: most users embed their proteins and fit a small model on top.
It mirrors ESM's ``extract.py`` (token-budget batches sorted by length, layer selection,
mean / BOS / per-residue outputs, ``<id>.pt`` files) but never truncates: linear
attention embeds any length; exact attention runs long proteins one at a time without a
padding mask, where SDPA's flash kernel keeps memory linear in length.

Layers are numbered as ESM numbers them: 0 is the token embedding, ``depth`` the last
block after the final layer norm; negative indices count from the end (-1 = ``depth``).
Pooling runs over residues only (``<cls>`` and ``<eos>`` excluded), except ``cls``,
which is the ``<cls>`` (BOS) position, refused for causal models (there it has seen
nothing but itself, so every protein would get the same vector).

Files (:func:`embed_file`) are written only after every setting and the whole input have
been checked, and record what defines them (the model's weights and config, input file,
layers, pooling, precision, ...): a rerun resumes only when all of it matches. Each
finished batch is saved at once (a kill loses at most one batch), keyed by protein (its
position in the input), so a rerun with another ``max_tokens``, ``sort_records`` or number
of devices embeds only the proteins still missing; the final file is assembled in input
order, the same whether or not the run was interrupted. One run writes an output at a time
(a lock beside it), and an ``overwrite`` removes only what an earlier embed run recorded
writing.

Modules: :mod:`.settings` (the keys, checked), :mod:`.embedder` (the model side),
:mod:`.identity` (what defines an output; names; path checks), :mod:`.h5` and
:mod:`.pt_dir` (one per output format), :mod:`.plan` (the batches, each process's share,
saving a finished batch), :mod:`.run` (the entry points), :mod:`.ddp` (several devices
through Lightning's predict loop).
"""
from ..formats.tabular import sequence_id
from .embedder import Embedder
from .run import embed_file, embed_sequences

__all__ = ["embed_sequences", "embed_file", "sequence_id", "Embedder"]
