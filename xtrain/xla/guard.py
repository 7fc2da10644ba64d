"""The recompilation guard (``trainer.max_compiles``): stop an XLA run whose graph count grows
past the limit, instead of letting it train slowly, naming the graph and the cause torch_xla gives.

torch_xla explains every compilation when ``PT_XLA_DEBUG_LEVEL=1`` (its "Compilation Analysis":
cause, graph name, the Python frame); ``PT_XLA_DEBUG_FILE`` sends that to a file in the run dir
instead of the console (xtrain/xla/runtime.py sets both before torch_xla starts).
"""

from __future__ import annotations

import re

import lightning as L

from xtrain.errors import RecompileError
from xtrain.xla.spmd import counters


def last_compilation(analysis: str) -> dict[str, str]:
    """Cause and graph name of the last compilation in torch_xla's analysis text."""
    blocks = analysis.split("Compilation Analysis: Compilation Cause")
    if len(blocks) < 2:
        return {}
    last = blocks[-1]
    cause = re.search(r"Compilation Analysis:\s+(.+)", last)
    graph = re.search(r"Graph Name:\s*(.+)", last)
    return {"cause": cause.group(1).strip() if cause else "?",
            "graph": graph.group(1).strip() if graph else "?"}


class RecompileGuard(L.Callback):
    """Counts the graphs compiled while training steps run (not the optimizer-state init before
    them, nor validation between them): a healthy run compiles its step once."""

    def __init__(self, limit: int, analysis_file: str):
        self.limit, self.analysis_file = limit, analysis_file
        self.step_compiles = 0
        self._before = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = counters()["xla_compiles"]  # a host-side counter: no device transfer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_compiles += counters()["xla_compiles"] - self._before
        if self.step_compiles <= self.limit:
            return
        try:
            with open(self.analysis_file) as f:
                last = last_compilation(f.read())
        except OSError:
            last = {}
        raise RecompileError(
            f"trainer.max_compiles={self.limit}: the training step compiled graph "
            f"{self.step_compiles} at step {trainer.global_step}: {last.get('graph', '?')} "
            f"(torch_xla: {last.get('cause', 'no analysis')}); every compilation is explained in "
            f"{self.analysis_file}")
