"""xtrain.compat: the private APIs it wraps still exist in the installed versions, and those
versions are the ones it was checked against. A failure here names what to re-verify on an
upgrade; the behaviour behind each shim is exercised by the engine, checkpoint and preflight
tests."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain import compat

ROOT = Path(__file__).resolve().parent.parent

PRIVATE_NAMES = [  # (module, attribute) every compat shim reaches for
    ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),
    ("torch_xla", "_XLAC._get_xla_sharding_spec"),
    ("torch_xla", "_XLAC._get_tensors_handle"),
    ("torch._dynamo.utils", "counters"),
    ("torch_xla", "_XLAC._get_tensors_xla_device_data_node"),
    ("torch_xla.core.xla_model", "_maybe_convert_to_cpu"),
    ("torch_xla.experimental.distributed_checkpoint._helpers", "_sharded_cpu_state_dict"),
    ("torch_xla.experimental.distributed_checkpoint._helpers", "_CpuShards"),
    ("torch_xla.experimental.custom_kernel", "trace_pallas"),
    ("torch_xla.experimental.custom_kernel", "_extract_backend_config"),
    ("torch_xla.core.xla_builder", "JaxCallable"),
    ("lightning.pytorch.plugins.precision", "Precision"),
    ("jax._src.compiler", "backend_compile"),
    ("jax._src.interpreters.mlir", "make_ir_context"),
]


def test_installed_versions_are_the_verified_ones():
    assert compat.unverified() == []


@pytest.mark.parametrize("module, name", PRIVATE_NAMES)
def test_private_names_exist(module, name):
    obj = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(obj, part), f"{module}.{name} is gone"
        obj = getattr(obj, part)


def test_lightning_precision_still_wraps_closures():
    """The closure SPMDPrecision (xtrain/xla/lightning.py) hands to ``optimizer.step``, in a CPU
    fit of the same plugin without the XLA compile around the step: it runs Lightning's closure
    (training step and backward), hands its value back to the optimizer, and only then fires
    ``on_before_optimizer_step``, with the gradients in place."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.precision import Precision

    compat.quiet_lightning_tpu_probe()
    events, steps = [], []

    class Wrapping(Precision):  # SPMDPrecision.optimizer_step minus torch_xla.compile
        def optimizer_step(self, optimizer, model, closure, **kwargs):
            def lightnings():
                value = closure()
                events.append("closure")
                return value

            wrapped = compat.wrap_closure(self, model, optimizer, lightnings)
            out = optimizer.step(closure=wrapped, **kwargs)  # SGD returns what its closure did
            steps.append((out, closure._result.loss))
            return out

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            events.append(("training_step", out["loss"].item()))
            return out

        def on_before_optimizer_step(self, optimizer):
            grads = [p.grad is not None for p in self.parameters()]
            events.append(("hook", optimizer is self.trainer.optimizers[0], all(grads)))

    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[Wrapping()])
    trainer.fit(Model())
    assert [e if isinstance(e, str) else e[0] for e in events] == [
        "training_step", "closure", "hook"] * 2
    assert [e for e in events if e[0] == "hook"] == [("hook", True, True)] * 2
    losses = [e[1] for e in events if e[0] == "training_step"]
    assert len(steps) == 2
    for (out, closure_loss), loss in zip(steps, losses, strict=True):
        assert out is closure_loss and out.item() == loss  # the closure's value came back


def test_lightning_leaves_the_signal_handlers_in_place_during_fit():
    """Lightning's own SIGTERM handler broadcasts inside the handler (a deadlock during a
    collective); after keep_signal_handlers the handler in place when fit starts stays."""
    import signal

    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    compat.quiet_lightning_tpu_probe()  # as xtrain's trainers do: no TPU metadata query here
    seen = []

    class Look(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(signal.getsignal(signal.SIGTERM))

    def ours(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        for keep in (False, True):
            trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[Look()])
            if keep:
                compat.keep_signal_handlers(trainer)
            trainer.fit(BoringModel())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen[0] is not ours  # Lightning's, composed around ours (what the call removes)
    assert seen[1] is ours


def pci_bus(root: Path, *devices: tuple[str, str]) -> str:
    """A stand-in for /sys/bus/pci/devices holding these (vendor, device) ids (this machine's bus
    has no Google device)."""
    for i, (vendor, device) in enumerate(devices):
        (root / f"0000:00:0{i}.0").mkdir(parents=True)
        (root / f"0000:00:0{i}.0" / "vendor").write_text(vendor + "\n")
        (root / f"0000:00:0{i}.0" / "device").write_text(device + "\n")
    return str(root)


def test_the_tpu_probe_counts_googles_tpu_devices_without_importing_torch_xla(tmp_path):
    """TPU chips are Google's devices with a TPU device id (torch_xla's own list, checked against
    its source below); other devices of Google's or anyone's are not; and the answer costs no
    import of torch_xla (seconds of every CPU run's start)."""
    bus = pci_bus(tmp_path, ("0x8086", "0x006f"), ("0x1ae0", "0x006f"), ("0x1ae0", "0x0063"),
                  ("0x1ae0", "0x0001"), ("0x1af4", "0x1000"))
    code = ("import sys; from xtrain import compat; "
            f"print(compat.tpu_chips_on_pci({bus!r}), 'torch_xla' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["2", "False"], r.stderr
    from torch_xla._internal import tpu

    assert sorted(compat.TPU_PCI_DEVICES) == sorted(tpu._TPU_PCI_DEVICE_IDS)
    assert compat.GOOGLE_PCI_VENDOR == tpu._GOOGLE_PCI_VENDOR_ID


def test_lightning_tpu_probe_answers_from_the_pci_bus_without_network(monkeypatch):
    """Lightning's own probe also says False here, but only after querying the GCE metadata
    server (a ~30 s timeout off GCE): the replacement must be installed, answer what the PCI bus
    says, and open no connection, neither when called nor when a Trainer is built."""
    import socket

    import lightning as L
    from lightning.pytorch.accelerators import XLAAccelerator

    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)

    compat.quiet_lightning_tpu_probe()
    compat.quiet_lightning_tpu_probe()  # idempotent: still the one replacement
    assert getattr(XLAAccelerator.is_available, "_xtrain", False) is True
    assert XLAAccelerator.is_available() is (compat.tpu_chips_on_pci() > 0)
    assert XLAAccelerator.is_available() is False  # no TPU on this machine
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)  # logs the probe's answer
    assert attempts == []
    # There is no TPU here: stand in for its PCI chips (the replacement reads nothing else).
    monkeypatch.setattr(compat, "tpu_chips_on_pci", lambda: 4)
    assert XLAAccelerator.is_available() is True


IMPORTS_OF_LIGHTNING = """
import sys
{first}
import lightning.pytorch
import torchmetrics
from lightning_utilities.core.imports import RequirementCache, package_available
from torchmetrics.utilities.imports import _MATPLOTLIB_AVAILABLE, _SCIPY_AVAILABLE
print(sorted(m for m in ("scipy.signal", "matplotlib.pyplot") if m in sys.modules))
print(package_available("scipy"), bool(RequirementCache("matplotlib")), bool(_SCIPY_AVAILABLE),
      bool(_MATPLOTLIB_AVAILABLE), torchmetrics.Metric.__name__)
"""


def _imports_of_lightning(first: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", IMPORTS_OF_LIGHTNING.format(first=first)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


def test_lightning_imported_after_xtrain_leaves_scipy_signal_and_pyplot_unimported():
    """xtrain/import_hooks.py: Lightning's import of torchmetrics imported scipy.signal and
    matplotlib.pyplot (about 1 s of every process's start); with xtrain imported first it does
    not, and afterwards every availability check answers as without the hook."""
    # without it (torchmetrics 1.9.0): the cost the hook is for; once torchmetrics stops importing
    # them itself, this fails and the hook can go
    assert _imports_of_lightning("")[0] == "['matplotlib.pyplot', 'scipy.signal']"
    assert _imports_of_lightning("import xtrain") == ["[]", "True True True True Metric"]
