"""Every use of a library's private API, and every monkeypatch, in one place (but for the one
that must be in place before the libraries are imported: xtrain/import_hooks.py).

Each function below names what it relies on. They were checked against the versions in
``VERIFIED``; :func:`unverified` lists what differs in this environment, and on an upgrade
every function tagged with that package must be re-checked (tests/test_compat.py exercises them
against the installed versions). Public APIs are used directly elsewhere, never through here.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

# package -> version every private use below was checked against
VERIFIED = {"torch": "2.9.1", "torch_xla": "2.9.0", "lightning": "2.6.6", "jax": "0.7.0",
            "hydra-core": "1.3.8", "torchmetrics": "1.9.0", "lightning-utilities": "0.15.3"}


def installed_versions(packages) -> dict[str, str | None]:
    out = {}
    for package in packages:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def unverified() -> list[str]:
    """Installed packages whose version is not the one the private uses here were checked on."""
    found = installed_versions(VERIFIED)
    return [f"{p} {found[p]} (checked: {v}; re-verify the xtrain.compat functions tagged [{p}])"
            for p, v in VERIFIED.items() if found[p] is not None and found[p].split("+")[0] != v]


# --- torch -----------------------------------------------------------------------------------


def fsspec_writer(path: str, written: list | None = None):
    """[torch] DCP's fsspec writer lives in a private module (torch 2.9). per_thread_copy_ahead=0:
    snapshots are already in host memory, and DCP's overlapping device-to-host loader breaks once
    torchax is imported (torch_xla's mark_sharding imports it when flax is installed): torchax
    registers a "jax" device module without current_stream(), which that loader calls.

    ``written`` receives the names of the files this process wrote, listed once written: those of
    its plan's prefix (``plan.storage_data``, a private ``_StoragePrefix``). DCP's write results
    name all but one: the empty file it makes for a plan with nothing in it (a host whose
    replicated tensors another host saves)."""
    from fsspec.core import url_to_fs
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from xtrain.paths import is_local

    class RecordingWriter(FsspecWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            if written is not None:
                future.wait()
                fs, root = url_to_fs(path)
                fs.invalidate_cache(root)  # gcsfs keeps listings
                names = (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
                written.extend(sorted(n for n in names if n.startswith(plan.storage_data.prefix)))
            return future

    # sync_files only on a local disk: elsewhere a file has no descriptor, and DCP then calls
    # os.sync(), which writes every dirty page of the machine to disk
    return RecordingWriter(path, per_thread_copy_ahead=0, sync_files=is_local(path))


# What DCP's metadata is made of (torch 2.9): its dataclasses, the file writer's storage info,
# tensor sizes, dtypes and layouts. A non-tensor item (BytesStorageMetadata) is left out on
# purpose: DCP loads such an item's bytes with torch.load(weights_only=False), and xtrain stores
# none (xtrain/checkpoint/io.py keeps everything but tensors in state.pt).
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name, nothing else
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


def dcp_reader(reader_class):
    """[torch] ``reader_class`` (DCP's FileSystemReader or a subclass) reading DCP's ``.metadata``
    with only the classes above allowed (the pickle documentation's "restricting globals"):
    DCP unpickles that file with plain ``pickle.load``, which would run any code a crafted
    checkpoint names. Relies on the reader's private ``_get_metadata_path`` and ``fs``."""
    import pickle

    import torch

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            allowed = name in _DCP_METADATA_CLASSES.get(module, ())
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                allowed = True
            if not allowed:
                raise pickle.UnpicklingError(
                    f"checkpoint metadata refers to {module}.{name}, which DCP's metadata of "
                    "tensors never holds: refused (a checkpoint is untrusted input)")
            return super().find_class(module, name)

    class SafeReader(reader_class):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"checkpoint metadata holds a {type(metadata).__name__}, "
                                             "not DCP's Metadata: refused")
            if getattr(metadata, "storage_meta", None) is None:  # as DCP's own read_metadata
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    SafeReader.__name__ = SafeReader.__qualname__ = f"Safe{reader_class.__name__}"
    return SafeReader


def dynamo_graph_count() -> int:
    """[torch] Graphs torch.compile has compiled in this process (``torch._dynamo.utils.counters``,
    the count its own tests use): constant after warm-up when nothing recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def inductor_cache_lookups() -> tuple[int, int]:
    """[torch] (FX graph cache hits, lookups) in this process, from ``counters["inductor"]``."""
    from torch._dynamo.utils import counters

    found = {k: int(counters["inductor"][f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")}
    return found["hit"], sum(found.values())


# --- torch_xla -------------------------------------------------------------------------------


def sharding_spec(tensor) -> str:
    """[torch_xla] The HLO sharding string XLA holds for a device tensor (``_XLAC``)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def tensors_to_cpu(tensors) -> list:
    """[torch_xla] Several device tensors to the host in one transfer (``xm._maybe_convert_to_cpu``;
    ``.cpu()`` on each would transfer them one by one)."""
    import torch_xla.core.xla_model as xm

    return xm._maybe_convert_to_cpu(list(tensors))


def sharded_cpu_state_dict(tensors: dict) -> dict:
    """[torch_xla] This host's shards of SPMD tensors copied to the host, with their indices for
    DCP's SPMD save planner (the helper torch_xla's own CheckpointManager uses), each distinct
    shard once: torch_xla 2.9's ``dedup_tensors`` drops a shard listed twice in one host's plan
    (two of its devices hold it: fsdp_tp's data axis on one 8-chip host) from every plan, and the
    checkpoint committed without the tensor."""
    import dataclasses

    from torch_xla.experimental.distributed_checkpoint import _helpers

    out = _helpers._sharded_cpu_state_dict(tensors)
    for name, value in out.items():
        if isinstance(value, _helpers._CpuShards):
            distinct = {repr(shard.indices): shard for shard in value.shards}  # replicas: equal
            out[name] = dataclasses.replace(value, shards=list(distinct.values()))
    return out


GOOGLE_PCI_VENDOR = "0x1ae0"  # Google's PCI vendor id: TPU chips are among its devices
# TPU chips' PCI device ids as torch_xla 2.9 lists them (jax 0.7: v2/v3 v4 v5e v6e 7x plc v5p)
TPU_PCI_DEVICES = ("0x0027", "0x005e", "0x0063", "0x006f", "0x0076", "0x0056", "0x0062")


def tpu_chips_on_pci(devices: str = "/sys/bus/pci/devices") -> int:
    """[torch_xla] TPU chips attached to this host, counted on the PCI bus as torch_xla's
    ``num_available_chips`` does (Google's vendor id, TPU device ids), without its import: seconds
    at the start of every CPU run, and refusing a TPU profile on a machine without one must take
    well under that."""
    count = 0
    for vendor in Path(devices).glob("*/vendor"):
        device = vendor.with_name("device")
        if vendor.read_text().strip() == GOOGLE_PCI_VENDOR and device.exists() and \
                device.read_text().strip() in TPU_PCI_DEVICES:
            count += 1
    return count


def data_handles(tensors) -> list[int]:
    """[torch_xla] The device-data handle behind each tensor (``_XLAC._get_tensors_handle``): a
    tensor's id changes with every in-place update and torch_xla's scan re-wraps the data it
    reads, but the buffer a graph reads keeps its handle."""
    import torch_xla

    return list(torch_xla._XLAC._get_tensors_handle(list(tensors)))


def graph_input_handles(outputs) -> list[int]:
    """[torch_xla] Handles of the device-data inputs of the graph computing ``outputs``, in the
    order of the exported function's arguments (torch_xla/stablehlo.py relies on the same order)."""
    import torch_xla

    _, values = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    return data_handles(values)


def lower_pallas_for_tpu(n_devices: int) -> None:
    """[torch_xla, jax] Make torch_xla's Pallas kernels lower for the TPU rather than for the
    process's JAX backend (CPU in the preflight's trace child, where Mosaic has no lowering).
    Process-wide: only the trace child calls it.

    - flash: torch_xla's ``trace_pallas`` calls ``jax.jit(kernel).lower(...)`` on the default
      backend and has no platform argument; it is replaced by the same steps with
      ``lowering_platforms=("tpu",)``.
    - splash: torch_xla runs it through ``call_jax`` (a ``shard_map`` over a mesh of JAX's own
      devices, lowered to HLO by ``JaxCallable.specialize``, again on the default backend). JAX
      gets one CPU device per virtual torch_xla device, so that mesh exists, and ``specialize``
      lowers for the TPU.
    """
    import jax
    import torch
    import torch_xla.core.xla_builder as xb
    import torch_xla.experimental.custom_kernel as custom_kernel

    jax.config.update("jax_num_cpu_devices", n_devices)  # before JAX's CPU backend starts

    def trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False,
                     **kwargs):
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers Mosaic)

        specs = [custom_kernel.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a
                 for a in args]
        traced = jax.jit(kernel, static_argnums=static_argnums,
                         static_argnames=static_argnames).trace(*specs, **kwargs)
        ir = traced.lower(lowering_platforms=("tpu",)).compiler_ir()
        return custom_kernel._extract_backend_config(ir), [a for a in args if torch.is_tensor(a)]

    def specialize(self, sample_flat_args):
        from torchax.ops.mappings import t2j_dtype

        specs = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, t2j_dtype(a.dtype))
                      for a in sample_flat_args)
        traced = jax.jit(self._flat_input_func.flat_call, keep_unused=True).trace(specs)
        hlo = traced.lower(lowering_platforms=("tpu",)).compiler_ir("hlo")
        computation = xb.computation_from_module_proto(
            "jax_callable", hlo.as_serialized_hlo_module_proto())
        return xb.xla_computation_as_func(computation, "jax_func")

    custom_kernel.trace_pallas = trace_pallas
    xb.JaxCallable.specialize = specialize


# --- Lightning -------------------------------------------------------------------------------


def wrap_closure(precision, model, optimizer, closure):
    """[lightning] The closure Lightning's precision plugins hand to ``optimizer.step`` (runs the
    training step's hooks around ours): ``Precision._wrap_closure``."""
    from functools import partial

    return partial(precision._wrap_closure, model, optimizer, closure)


def keep_signal_handlers(trainer) -> None:
    """[lightning] Lightning installs SIGTERM/SIGINT handlers of its own when fit starts
    (``trainer._signal_connector.register_signal_handlers``), composed with those in place. Its
    SIGTERM part broadcasts over torch.distributed inside the handler: a signal that arrives
    while the processes wait in a collective before training (a barrier of the loops' set-up)
    deadlocks them. xtrain's handler (xtrain/train/preemption.py) serves the whole fit, so this
    trainer skips Lightning's registration."""
    trainer._signal_connector.register_signal_handlers = lambda: None


def quiet_lightning_tpu_probe() -> None:
    """[lightning] Lightning's Trainer logs ``XLAAccelerator.is_available()`` on every construction;
    off-TPU that probe queries the GCE metadata server and, with some TPU_* variables set
    (jax/libtpu set them), raises instead of returning False. Answer it from the PCI bus.
    Process-wide and idempotent."""
    from lightning.pytorch.accelerators import XLAAccelerator

    if not getattr(XLAAccelerator.is_available, "_xtrain", False):
        def is_available() -> bool:
            return tpu_chips_on_pci() > 0

        is_available._xtrain = True
        XLAAccelerator.is_available = staticmethod(is_available)


# --- Hydra ------------------------------------------------------------------------------------


def report_refusals(is_refusal, refuse, masked=lambda report: report()) -> None:
    """[hydra-core] Hydra composes the config and runs the job inside ``run_and_report``, which
    prints a multi-line report and exits 1 for any error. Replace it so that refused input
    (``is_refusal``) goes to ``refuse`` (one line, xtrain's exit code); other exceptions keep Hydra's
    report, written through ``masked``, or raise (``HYDRA_FULL_ERROR=1``; a refusal then prints its
    traceback, through ``masked``, before its line and keeps its exit code). Process-wide,
    idempotent."""
    import traceback

    import hydra._internal.utils as hydra_utils

    original = getattr(hydra_utils.run_and_report, "_xtrain_original", hydra_utils.run_and_report)

    def run_and_report(func):
        try:
            return func()
        except Exception as ex:  # noqa: BLE001  (Hydra's contract: report any error)
            ex = _override_of_an_unset_node(ex) or ex
            if not is_refusal(ex):
                return masked(lambda: original(_raise(ex)))
            if hydra_utils._is_env_set("HYDRA_FULL_ERROR"):
                masked(lambda: traceback.print_exception(ex))
            refuse(ex)

    run_and_report._xtrain_original = original
    hydra_utils.run_and_report = run_and_report


def _override_of_an_unset_node(ex):
    """[hydra-core, omegaconf] An override below a null node (``logger.wandb.project=x`` while
    ``logger.wandb`` is not selected) fails in OmegaConf.update with a bare AssertionError from
    Hydra's ``_apply_overrides_to_config``; as a refusal naming the key (from that frame's
    ``key``), or None for any other error."""
    from xtrain.errors import ConfigError

    if not isinstance(ex, AssertionError):
        return None
    tb = ex.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "_apply_overrides_to_config":
        tb = tb.tb_next
    key = tb.tb_frame.f_locals.get("key") if tb is not None else None
    if not isinstance(key, str):
        return None
    parent = key.rsplit(".", 1)[0]
    hint = (f": select it first, e.g. logger=[jsonl,{parent.split('.')[1]}]"
            if parent.startswith("logger.") else "")
    return ConfigError(f"{key}: {parent} is not part of this config (null){hint}")


def _raise(ex):
    def again():
        raise ex

    return again


# --- jax (the TPU compiler child) ------------------------------------------------------------


def jax_compiler_internals():
    """[jax] What compiling a foreign StableHLO module for a compile-only TPU topology needs and
    jax exposes only privately: (ir, mlir, compiler, xla_client)."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    return ir, mlir, compiler, xla_client


# --- torch (AOTAutograd partitioning, used by the XLA engine's scan) --------------------------


def remat_partition(joint_module, joint_inputs, **kwargs):
    """[torch] A partition function for AOTAutograd (torch_xla's ``scan`` takes one) that
    recomputes every forward value in the backward graph, so the forward saves only its inputs:
    activation checkpointing of the whole traced function. Tags each forward node the way
    ``torch.utils.checkpoint`` does under ``torch.compile`` (``node.meta["recompute"]``, with
    the region id ``ac_graph_id`` that ``min_cut_rematerialization_partition`` reads), then lets
    that partitioner honour the tags."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    nodes = list(joint_module.graph.nodes)
    backward = {n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in nodes:  # graph order is topological: a node after a backward input is backward
        if node.op == "call_function" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    for node in nodes:
        if node.op == "call_function" and node not in backward:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
