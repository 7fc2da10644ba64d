"""The one monkeypatch that must be in place before any library is imported, installed by
xtrain/__init__.py (the others are in xtrain/compat.py, whose rules it follows: tagged with the
packages it relies on, checked against the versions in ``xtrain.compat.VERIFIED``)."""

from __future__ import annotations

import importlib.util
import sys


class TorchmetricsWithoutExtras:
    """[torchmetrics, lightning-utilities] ``import torchmetrics``, which Lightning's own import
    makes, imports scipy.signal and matplotlib.pyplot whenever they are installed (torchmetrics
    issue #3457, open in 1.9.0): 1.3-1.5 s of the 4.3-5.0 s xtrain's training imports took here,
    for audio metrics and plots xtrain never uses (its charts import matplotlib themselves).
    Other threads' checks during that import read them as absent too. As a finder on
    ``sys.meta_path``, it runs torchmetrics' top module with lightning_utilities' checks
    (``package_available``, ``RequirementCache``) reading those two packages as absent; before
    and after that, the checks answer as they would without it."""

    EXTRAS = ("scipy", "matplotlib")
    hiding = False

    @classmethod
    def install(cls) -> None:
        if "torchmetrics" not in sys.modules and not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name, path=None, target=None):
        if name != "torchmetrics":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the other finders'
        if spec is None or spec.loader is None:
            return spec
        from lightning_utilities.core import imports

        cls, found, met = type(self), imports.package_available, imports.RequirementCache.__bool__
        # (torchmetrics binds package_available by name: the replacements stay, and hide nothing
        # once its top module ran)
        imports.package_available = lambda name: not cls.hides(name) and found(name)
        imports.RequirementCache.__bool__ = lambda req: not cls.hides(req.requirement) and met(req)
        run = spec.loader.exec_module

        def exec_module(module):
            cls.hiding = True
            try:
                run(module)
            finally:
                cls.hiding = False

        spec.loader.exec_module = exec_module  # (torchmetrics' own loader object alone)
        return spec

    @classmethod
    def hides(cls, requirement: str) -> bool:
        return cls.hiding and requirement.split(">")[0].split("=")[0].strip() in cls.EXTRAS
