"""``mode=compile``: the TPU preflight. Know that a run compiles and fits before renting a TPU.

1. Trace the config's training step on XLA:CPU over as many virtual devices as the profile has
   chips (:mod:`.trace`, a child process: torch_xla reads its device count once).
2. Compile it for the profile's TPU topology with libtpu (:mod:`.tpu_compile`, a child: libtpu
   can abort its process).
3. Compile the attention kernels the config uses on the TPU at their real shapes, on their own,
   so a Pallas/libtpu version mismatch is reported with the compiler's reason.

Per-chip HBM is arguments + temporaries + outputs - aliases (donated buffers), the figure the TPU
runtime needs; it is compared with the profile's HBM and with the planner's estimate
(:mod:`.report`). Results are cached (:mod:`.cache`), so re-planning reads them back instantly
(``mode=plan`` prints the cached figure next to the estimate). :mod:`.runner` drives it all and
:mod:`.targets` says what to compile.

This package's ``__init__`` imports nothing: the compile child runs with only jax and libtpu.
"""
