"""The CPU engine: plain PyTorch on this machine through Lightning's Trainer."""

from __future__ import annotations

from xtrain.engines.base import Engine


class CPUEngine(Engine):
    name = "cpu"

    def trainer_kwargs(self, checkpoint_io) -> dict:
        return {"accelerator": "cpu", "devices": 1, "plugins": [checkpoint_io]}
