"""The one module that adapts megatron-core to machines without CUDA (or without triton).

Two kinds of shims:

* the import stand-in for triton's MoE-only kernels (``ensure_megatron_importable``): defined in
  ``mimo_sft/parallel/__init__.py`` and registered once when the package is imported, because it
  must run before any module imports megatron and must stay torch-free (``validate``'s imports
  reach ``mimo_sft.parallel``);
* ``apply_cpu_shims()``: the CUDA-only call sites megatron reaches during MIMO training, bridged
  for gloo on CPU. Applied by ``runtime.use_device`` when the process's device is the CPU (also on
  a machine with GPUs: export builds on the CPU), so CPU and GPU runs go through the same megatron
  code. Every shim names the megatron call site it serves. Shims only replace CUDA-only calls:
  what megatron needs initialised (memory buffer, RNG tracker) is set up by
  ``runtime.init_megatron`` on every device.

Never edit installed megatron files; patch here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

# ---------------------------------------------------------------------------------------------
# torchvision beside a torch whose ABI its C++ library was not built for.
# ---------------------------------------------------------------------------------------------

_TORCHVISION_FAKE_OPS = ("nms", "qnms")
_torchvision_lib = None  # the Library that holds the two schemas (dropping it would remove them)


def torchvision_compat() -> None:
    """Let torchvision's Python side import where its ``_C`` library cannot load (idempotent).

    PyPI's torchvision 0.28.0 (the release paired with torch 2.13.0) ships a CUDA ``_C.so``; beside
    the CPU torch wheel it does not load, and ``torchvision/_meta_registrations.py`` then fails at
    import on ``torch.library.register_fake("torchvision::nms")`` (and ``"torchvision::qnms"``):
    "operator torchvision::nms does not exist". transformers believes torchvision is installed and
    imports it for its torchvision image backend and every video processor. Defining the two
    schemas first is all that import needs; the C++ ops (nms, roi_align, decoders) stay unavailable,
    and nothing in mimo-sft calls them. Where ``_C`` loads (a CUDA machine) nothing is defined.
    Called by the import hook ``mimo_sft/__init__.py`` installs, right before torchvision's first import.
    """
    global _torchvision_lib
    if _torchvision_lib is not None:
        return
    import glob
    import importlib.util
    import os

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        return
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C.*"))
    if libs:
        try:
            torch.ops.load_library(libs[0])
            return
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for name in _TORCHVISION_FAKE_OPS:
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_lib = lib


# ---------------------------------------------------------------------------------------------
# CPU shims: megatron-core 0.19.2 call sites that assume CUDA, bridged for gloo on CPU.
# ---------------------------------------------------------------------------------------------

# Modules whose literal ``device="cuda"`` allocations (and ``torch.cuda.*`` lookups) are
# redirected to the CPU by replacing their module-level ``torch`` name with a proxy. Each entry
# names the call sites it serves.
_CUDA_LITERAL_MODULES = {
    # get_default_causal_mask / get_sliding_window_causal_mask: torch.ones(..., device="cuda")
    "megatron.core.transformer.utils": "default causal mask",
    # found_inf / _dummy_overflow_buf / _scale_one / _scale / mixed-precision flag tensors
    "megatron.core.optimizer.optimizer": "optimizer state tensors",
    # get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32: device='cuda'
    "megatron.core.optimizer.clip_grads": "grad-norm and clipping buffers",
    # distributed optimizer: gather buffers (torch.cuda.current_device(), .cuda())
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer buffers",
    # MimoOptimizer: norm_sq / found_inf / success / loss-scale / module_counts on "cuda"
    "megatron.core.models.mimo.optimizer": "MIMO optimizer reductions",
    # forward_backward_*: total_num_tokens = torch.zeros([], device="cuda")
    "megatron.core.pipeline_parallel.schedules": "schedules' token counter",
    # P2PCommunicator._communicate_shapes / _communicate: torch.cuda.synchronize() after the
    # batched send/recv (language pipeline stages with variable_seq_lengths)
    "megatron.core.pipeline_parallel.p2p_communication": "pipeline p2p synchronize",
    # NCCL warm-up tensor (device="cuda"), torch.cuda.current_stream() waits
    "megatron.core.distributed.param_and_grad_buffer": "grad buffer",
    # torch.cuda.Stream(device=torch.cuda.current_device()) for overlapped grad reduce
    "megatron.core.distributed.distributed_data_parallel": "DDP communication stream",
    # GlobalMemoryBuffer.get_tensor, l2-norm helpers (device="cuda"), param-hash .cuda()
    "megatron.core.utils": "global memory buffer and utils",
    # FileSystemWriterAsync.preload_tensors: torch.cuda.synchronize() after the host copy
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "checkpoint save preload",
    # AsyncCallsQueue / sync_all_async_calls: device=torch.cuda.current_device() (--async-save)
    "megatron.core.dist_checkpointing.strategies.async_utils": "async checkpoint writer",
    # CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed: torch.cuda.get_rng_state() and
    # torch.cuda.manual_seed(); on the CPU the tracked streams are CPU generator states
    "megatron.core.tensor_parallel.random": "model-parallel RNG tracker",
    # MoEAlltoAllTokenDispatcher: its class-level DtoH torch.cuda.Stream(), the stream switch and the
    # event it records there for the tokens-per-expert copies (mixture-of-experts layers)
    "megatron.core.transformer.moe.token_dispatcher": "MoE alltoall dispatcher's DtoH stream",
}

# Modules that create process groups with backend='nccl' hard-coded; their module-level ``dist``
# is replaced by a proxy whose group constructors force gloo.
_NCCL_GROUP_MODULES = {
    # BridgeCommunicator._get_or_create_broadcast_pg / _get_or_create_bridge_pg
    "megatron.core.pipeline_parallel.bridge_communicator": "bridge communicator groups",
    # ColocatedBridgeCommunicator.__init__: gather_pg for fan-in / fan-out
    "megatron.core.models.mimo.comm.colocated_communicator": "colocated communicator groups",
}


#: the device that stands in for CUDA: the CPU, or the device audit's stand-in (``testing.device_audit``,
#: whose tensors report another device while their bytes stay in host memory)
_TARGET = torch.device("cpu")


def _cpu_device(device):
    """Map a CUDA device spec ("cuda", "cuda:0", 0, torch.device("cuda")) to the CPU (:data:`_TARGET`)."""
    if device is None:
        return None
    if isinstance(device, int):
        return _TARGET
    if isinstance(device, str) and device.startswith("cuda"):
        return _TARGET
    if isinstance(device, torch.device) and device.type == "cuda":
        return _TARGET
    return device


class _NullEvent:
    """Stands in for a CUDA event: on the CPU the work it marks has already happened."""

    def synchronize(self):
        return None

    def query(self):
        return True

    def wait(self, *a, **k):
        return None


class _NullStream:
    """Stands in for a CUDA stream: every wait/record/synchronize is a no-op on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        return None

    def wait_event(self, *a, **k):
        return None

    def record_event(self, *a, **k):
        # MoEAlltoAllTokenDispatcher synchronizes the event its DtoH stream records
        return _NullEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuCudaNamespace(types.ModuleType):
    """``torch.cuda`` as seen by the proxied megatron modules: device/stream calls go to the CPU."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _TARGET

    @staticmethod
    def current_stream(*a, **k):
        return _NullStream()

    Stream = _NullStream

    @staticmethod
    def stream(*a, **k):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(*a, **k):
        return None

    @staticmethod
    def empty_cache():
        return None

    # the RNG tracker's streams: the CPU generator stands in for the CUDA one
    @staticmethod
    def get_rng_state(*a, **k):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *a, **k):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)


def _device_redirect(name: str):
    """``torch.<name>`` with a CUDA ``device`` sent to :data:`_TARGET` (looked up per call, so that whatever
    stands behind ``torch.<name>`` at the time -- the device audit's -- makes the tensor)."""

    @functools.wraps(getattr(torch, name))
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return getattr(torch, name)(*args, **kwargs)

    return wrapper


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace")


class _CpuTorchProxy(types.ModuleType):
    """A module-level ``torch`` for one megatron module: factories ignore ``device="cuda"``."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCudaNamespace()
        for name in _FACTORIES:
            setattr(self, name, _device_redirect(name))

    def __getattr__(self, name):
        return getattr(torch, name)


def _gloo_new_group(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs.get("backend") == "nccl":  # gloo, for the stand-in device's tensors too
            kwargs["backend"] = "gloo" if _TARGET.type == "cpu" else f"cpu:gloo,{_TARGET.type}:gloo"
        return fn(*args, **kwargs)

    return wrapper


class _GlooDistProxy(types.ModuleType):
    """A module-level ``torch.distributed`` whose group constructors turn 'nccl' into 'gloo'."""

    def __init__(self):
        import torch.distributed as dist

        super().__init__("torch.distributed")
        self._dist = dist
        self.new_group = _gloo_new_group(dist.new_group)
        self.new_subgroups_by_enumeration = _gloo_new_group(dist.new_subgroups_by_enumeration)

    def __getattr__(self, name):
        return getattr(self._dist, name)


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cuda_type_names():
    """Inside, ``t.type()`` of a CPU float tensor reports the CUDA type name megatron asserts on.

    Scoped to the wrapped megatron functions only (see ``_patch_type_assertions``); the training
    thread is the only caller of those functions, so no other code observes the patch.
    """
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type in ("cpu", _TARGET.type) and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs) if dtype is not None else original(self)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    if getattr(fn, "_mimo_cpu_shim", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper._mimo_cpu_shim = True
    return wrapper


def _patch_type_assertions() -> None:
    """Gap 4: ``param.grad.type() == 'torch.cuda.FloatTensor'`` checks."""
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    opt = importlib.import_module("megatron.core.optimizer.optimizer")
    dist_opt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    mimo_opt = importlib.import_module("megatron.core.models.mimo.optimizer")
    # clip_grads.clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor';
    # it is imported by name into optimizer.py and models/mimo/optimizer.py, so patch all three.
    wrapped = _with_cuda_type_names(clip.clip_grad_by_total_norm_fp32)
    for mod in (clip, opt, mimo_opt):
        mod.clip_grad_by_total_norm_fp32 = wrapped
    # Float16OptimizerWithFloat16Params.__init__: fp32 params must be 'torch.cuda.FloatTensor'.
    cls = opt.Float16OptimizerWithFloat16Params
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    # DistributedOptimizer._build_model_and_main_param_groups: same check on model params.
    dcls = dist_opt.DistributedOptimizer
    inner = dcls.__dict__["_build_model_and_main_param_groups"].__func__
    dcls._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(inner))


def _patch_cuda_namespace() -> None:
    """Gaps 2 and 5, everywhere megatron calls them (tensor_parallel layers and mappings, attention,
    mRoPE ``MultimodalRotaryEmbedding``, bridge communicator, MIMO ``_empty_encoder_output``,
    p2p communication, grad buffer): ``torch.cuda.current_device()`` gives the CPU device and
    ``torch.cuda.current_stream()`` a no-op stream. Without CUDA both would raise, so nothing
    that worked before changes.
    """
    if getattr(torch.cuda.current_device, "_mimo_cpu_shim", False):
        return

    def current_device():
        return _TARGET

    def current_stream(*a, **k):
        return _NullStream()

    current_device._mimo_cpu_shim = True
    torch.cuda.current_device = current_device
    torch.cuda.current_stream = current_stream


def _patch_tensor_cuda() -> None:
    """Gap 3 (``.cuda()`` calls): ``Tensor.cuda()`` returns the tensor itself when CUDA is absent.

    Call sites: utils.check_param_hashes_across_dp_replicas (``torch.stack(...).cuda()``),
    MegatronOptimizer state loading (``p.data.cuda()``, ``v.cuda()``), distrib_optimizer's
    gloo send buffers (``send_tensor.cuda()``). Without CUDA these would raise.
    """
    if getattr(torch.Tensor.cuda, "_mimo_cpu_shim", False):
        return

    def cuda(self, *a, **k):
        return self.to(_TARGET)

    cuda._mimo_cpu_shim = True
    torch.Tensor.cuda = cuda


def _patch_module_globals() -> None:
    """Gaps 3 and 6: module-scoped ``torch`` / ``dist`` proxies (see the two tables above)."""
    for name in _CUDA_LITERAL_MODULES:
        mod = importlib.import_module(name)
        if not isinstance(mod.__dict__.get("torch"), _CpuTorchProxy):
            mod.torch = _CpuTorchProxy()
    for name in _NCCL_GROUP_MODULES:
        mod = importlib.import_module(name)
        if not isinstance(mod.__dict__.get("dist"), _GlooDistProxy):
            mod.dist = _GlooDistProxy()


def _patch_rng_state_functions() -> None:
    """Gap 7: ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and write
    ``torch.cuda.default_generators``; the tracker's ``fork`` calls them. On the CPU they read and
    write the CPU generator, so forked regions draw from the tracked stream as they do on a GPU."""
    mrandom = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(mrandom._get_cuda_rng_state, "_mimo_cpu_shim", False):
        return

    def get_state(*a, clone: bool = False, **k):
        return torch.get_rng_state()

    def set_state(new_state, *a, **k):
        torch.set_rng_state(new_state)

    get_state._mimo_cpu_shim = True
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state


def _patch_moe_host_splits() -> None:
    """Gap 9: ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` turns its split sizes into numpy
    arrays through ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only a CUDA
    tensor; on the CPU the splits stayed tensors, which gloo's ``all_to_all_single`` refuses as split
    sizes. Here a host tensor asked for as numpy becomes numpy too, as a copied-back one would."""
    mod = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = mod.maybe_move_tensor_to_cpu
    if getattr(original, "_mimo_cpu_shim", False):
        return

    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and tensor.device == _TARGET and _TARGET.type != "cpu":
            moved = tensor.to("cpu", non_blocking=True)  # the device audit's stand-in: what CUDA does (no stream)
            return moved.numpy() if as_numpy else moved
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._mimo_cpu_shim = True
    mod.maybe_move_tensor_to_cpu = move


def _uneven_all_gather(fn):
    """``all_gather(outputs, input)`` with outputs of different first dims, as NCCL takes them: gloo needs
    equal sizes, so every rank's rows are padded to the longest and cut back after."""

    @functools.wraps(fn)
    def wrapper(output_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] for t in output_list]
        if len(set(rows)) <= 1:
            return fn(output_list, tensor, group=group, async_op=async_op)
        assert not async_op, "uneven all_gather shim: synchronous calls only"
        longest = max(rows)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in rows]
        fn(parts, padded, group=group)
        for out, part, n in zip(output_list, parts, rows):
            out.copy_(part[:n])
        return None

    return wrapper


def _uneven_reduce_scatter(fn):
    """``reduce_scatter(output, inputs)`` with inputs of different first dims (NCCL takes them, gloo does
    not): the inputs, padded to the longest, are summed by one all_reduce and each rank keeps its part."""
    import torch.distributed as dist

    @functools.wraps(fn)
    def wrapper(output, input_list, op=None, group=None, async_op=False):
        rows = [t.shape[0] for t in input_list]
        if len(set(rows)) <= 1:
            kwargs = {} if op is None else {"op": op}
            return fn(output, input_list, group=group, async_op=async_op, **kwargs)
        assert not async_op and op in (None, dist.ReduceOp.SUM), "uneven reduce_scatter shim: synchronous sums only"
        longest = max(rows)
        stacked = input_list[0].new_zeros((len(rows), longest, *input_list[0].shape[1:]))
        for i, t in enumerate(input_list):
            stacked[i, : t.shape[0]] = t
        dist.all_reduce(stacked, group=group)
        me = dist.get_rank(group)
        output.copy_(stacked[me, : rows[me]])
        return None

    return wrapper


class _UnevenDistProxy(types.ModuleType):
    """``torch.distributed`` as ``tensor_parallel.mappings`` sees it on the CPU: uneven all_gather and
    reduce_scatter (the MoE alltoall dispatcher's token gather/scatter over the tp group) work on gloo."""

    def __init__(self):
        import torch.distributed as dist

        super().__init__("torch.distributed")
        self._dist = dist
        self.all_gather = _uneven_all_gather(dist.all_gather)
        self.reduce_scatter = _uneven_reduce_scatter(dist.reduce_scatter)

    def __getattr__(self, name):
        return getattr(self._dist, name)


class _MappingsTorchProxy(types.ModuleType):
    """A module-level ``torch`` for ``megatron.core.tensor_parallel.mappings`` whose ``distributed`` is
    :class:`_UnevenDistProxy`; everything else is torch's."""

    def __init__(self):
        super().__init__("torch")
        self.distributed = _UnevenDistProxy()

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_uneven_tp_collectives() -> None:
    """Gap 10: ``tensor_parallel.mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``
    with split sizes (``MoEAlltoAllTokenDispatcher.dispatch_postprocess`` / ``combine_preprocess`` at tp
    > 1: each tp rank routed a different number of tokens to this rank's experts) call the list forms of
    all_gather / reduce_scatter with tensors of different sizes, which gloo refuses."""
    mod = importlib.import_module("megatron.core.tensor_parallel.mappings")
    if not isinstance(mod.__dict__.get("torch"), _MappingsTorchProxy):
        mod.torch = _MappingsTorchProxy()


def apply_cpu_shims(target: torch.device = torch.device("cpu")) -> None:
    """Bridge megatron-core's CUDA-only call sites for CPU + gloo. Idempotent.

    Called by ``runtime.use_device`` for a device other than CUDA, before process groups, models, DDP,
    optimizers or schedules exist. ``target`` is where megatron's CUDA allocations go: the CPU, or the
    device audit's stand-in device (``testing.device_audit``), so that what megatron puts on "the GPU"
    is told apart from host tensors there as on a GPU.
    """
    global _TARGET
    _TARGET = torch.device(target)
    _patch_cuda_namespace()
    _patch_tensor_cuda()
    _patch_module_globals()
    _patch_type_assertions()
    _patch_rng_state_functions()
    _patch_moe_host_splits()
    _patch_uneven_tp_collectives()
