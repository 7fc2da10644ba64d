"""Checkpoint storage through fsspec (local paths or gs://): layout, commit, discovery, IO.

Layout: ``<dir>/step_000100/{tensors/, state.pt, meta.json, manifest.json, COMMITTED}``. ``tensors/`` is a
torch.distributed.checkpoint (DCP) directory holding every tensor of the checkpoint (model,
optimizer state); ``state.pt`` holds the rest (loop counters, loader position, ...) with each
tensor replaced by a reference into ``tensors/``. Under the XLA engine each host writes only its
own shards (torch_xla's SPMD planners) and loads only what its devices hold; the CPU engine
writes the same layout. ``COMMITTED`` is written last, after every other byte is durable: a
checkpoint without it is incomplete (a crash mid-save) and is never chosen for resume.
``manifest.json`` records every file's size and CRC32C at save time: a committed checkpoint
whose files no longer match (truncated, altered) is found before loading. Object
stores have no atomic directory rename, so the marker (as Orbax's ``commit_success.txt``) is the
commit on every filesystem. Loading is a trust boundary: ``torch.load(weights_only=True)``, DCP
tensor data, DCP's pickled ``.metadata`` unpickled with only its own classes allowed
(xtrain/compat.py, dcp_reader), and JSON; nothing that can run code. No name a checkpoint holds
reaches outside it: the data files DCP's metadata names must be plain DCP file names, the
manifest's entries paths inside the checkpoint (:mod:`.layout`); anything else is refused
(CheckpointError) before a file is read or downloaded. Only retention deletes a committed
checkpoint: one in the way (corrupt, rewound past, or at the step being saved) is renamed aside,
and a step dir is removed as a torn save only once the storage says its marker is missing.

Modules: :mod:`.layout` (paths, discovery, retention), :mod:`.io` (one save or load of one
checkpoint), :mod:`.manifest` (sizes and checksums: record, verify), :mod:`.async_io`
(Lightning's CheckpointIO: background uploads with retries), :mod:`.collective` (one verdict on
a save for every process). When
to save and what to do on a signal is training policy (xtrain/train/).
"""
