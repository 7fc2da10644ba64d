"""How a training step runs: the step itself (:mod:`.step`, torch only), the interface every
engine implements (:mod:`.base`) and the CPU engine (:mod:`.cpu`); the XLA engine lives beside
the SPMD code (xtrain/xla/engine.py)."""
