"""Every place miles changes megatron-core, each tied to the source text that makes it needed.

megatron-core 0.16.1's GPTModel, schedules, DDP and optimizer run on CPU tensors under gloo
except for a handful of places that allocate on `torch.cuda.current_device()` or
`device="cuda"`, use the CUDA RNG, check for CUDA tensor type names, or name a Transformer
Engine symbol that is undefined without it. Each such place is one `Redirect` below: the
megatron-core function, the text in its source that is the assumption (so an upgrade that
changes the function is detected, see `stale()`), and why it matters. `install()` wraps
exactly those functions so that their bodies run inside `on_cpu()` when the work is placed on
the CPU: for the whole process (`install()`, the CPU training backend), or for the work inside
`cpu_placed()` (the checkpoint conversion and its logit check, on any machine, a GPU one
included). Outside that, and everywhere else in the process, megatron-core runs as it is.

`MISSING_SYMBOLS` are names megatron-core binds only when Transformer Engine imports and reads
elsewhere as "None means absent"; `bind_missing_te_names()` binds them to None on every device
(miles.megatron.te_names finds every read of a TE-only name and tests/unit/
test_megatron_te_only_names.py requires each to be guarded, bound here, or unreachable).

The other changes are `PATCHES`, each applied by one function here: the Transformer Engine
names of the layer-spec module bound to stand-ins while a spec is built without TE
(`te_stand_ins`), the MoE dispatcher's CUDA stream when the rank-grid proof builds a MoE
layer on CPU (`without_dispatcher_stream`), multi-latent attention's belief that TE is
installed (`mla_without_te`), the gated delta net's fla kernels where fla is absent
(`gdn_without_fla`), the process groups megatron-core's `destroy_model_parallel`
leaves behind (`forget_destroyed_groups`), and the checkpoint writer's result queue, served by
a manager that dies with the trainer (`writers_die_with_this_process`). Nothing outside this
module writes into megatron-core (the module is long for that reason: the entries and the
functions that apply them stay together), and `stale()` checks every entry against the
installed release, which must be the one they were written for (`KNOWN_RELEASE`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass

# The megatron-core release every entry below was written against; pyproject.toml's megatron
# extra and every lane's lock pin it (tests/unit/test_megatron_compat.py holds them together).
KNOWN_RELEASE = "0.16.1"


@dataclass(frozen=True)
class Redirect:
    target: str  # "module:Qualified.name" of the megatron-core function whose body runs on CPU
    marker: str  # the CUDA assumption, as it appears in that function's source
    why: str
    tensors_on_cuda: bool = False  # inside it, tensors answer is_cuda with True


REDIRECTS: tuple[Redirect, ...] = (
    Redirect(
        "megatron.core.utils:GlobalMemoryBuffer.get_tensor",
        "torch.cuda.current_device()",
        "the attention and TP-gather scratch buffer is allocated on the current CUDA device",
    ),
    Redirect(
        "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",
        "torch.cuda.current_device()",
        "rotary embeddings move inv_freq to the current CUDA device on the first forward",
    ),
    Redirect(
        "megatron.core.transformer.utils:get_default_causal_mask",
        'device="cuda"',
        "the causal mask of unfused attention (no explicit mask given) is built on the GPU",
    ),
    Redirect(
        "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add",
        "torch.cuda.get_rng_state()",
        "the model-parallel RNG streams are CUDA generator states",
    ),
    Redirect(
        "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        "_get_cuda_rng_state(",
        "core attention forks the CUDA RNG stream around its dropout",
    ),
    Redirect(
        "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed",
        "torch.cuda.manual_seed(",
        "seeding the model-parallel RNG streams seeds the CUDA generator",
    ),
    Redirect(
        "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
        "weight.data.cuda()",
        "with tied embeddings and pipeline stages, the first and last stage sync the shared weight on the GPU",
    ),
    Redirect(
        "megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",
        "pin_memory=True",
        "context parallelism picks each rank's rotary chunks with an index in pinned memory copied to the GPU",
    ),
    Redirect(
        "megatron.core.transformer.moe.router:Router.gating",
        "torch.cuda.current_device()",
        "the MoE router moves its weight to the current CUDA device on the first forward",
    ),
    Redirect(
        "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.__init__",
        "torch.cuda.Stream()",
        "the all-to-all MoE dispatcher creates a CUDA stream for its device-to-host copies",
    ),
    Redirect(
        "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        "torch.cuda.current_stream()",
        "the all-to-all MoE dispatcher copies its split sizes on that stream and waits for them",
    ),
    Redirect(
        "megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
        "tensor.is_cuda",
        "the dispatcher's split sizes become host numpy arrays only when they were on the GPU",
        tensors_on_cuda=True,
    ),
    Redirect(
        "megatron.core.tensor_parallel.mappings:_gather_along_last_dim",
        "torch.cuda.current_device()",
        "tensor-parallel gathers allocate their output on the current CUDA device",
    ),
    Redirect(
        "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
        "torch.cuda.current_device()",
        "sequence-parallel gathers allocate their output on the current CUDA device",
    ),
    Redirect(
        "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",
        "torch.cuda.current_device()",
        "sequence-parallel reduce-scatters allocate their output on the current CUDA device",
    ),
    Redirect(
        "megatron.core.tensor_parallel.mappings:_AllToAll.forward",
        "torch.cuda.current_device()",
        "expert-parallel all-to-all allocates its output on the current CUDA device",
    ),
    Redirect(
        "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
        'device="cuda"',
        "the token counter of a step is allocated on the GPU",
    ),
    Redirect(
        "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
        'device="cuda"',
        "the token counter of a step is allocated on the GPU",
    ),
    Redirect(
        "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
        'device="cuda"',
        "the token counter of a step is allocated on the GPU",
    ),
    Redirect(
        "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
        "torch.cuda.current_device()",
        "pipeline stages receive activations into buffers on the current CUDA device",
    ),
    Redirect(
        "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__",
        "torch.cuda.current_device()",
        "DDP's contiguous parameter and gradient buffers are allocated on the GPU",
    ),
    Redirect(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
        "torch.cuda.FloatTensor",
        "the distributed optimizer accepts parameters only by their CUDA tensor type names",
    ),
    Redirect(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict",
        "torch.cuda.current_device()",
        "loading optimizer state allocates its step and state buffers on the GPU",
    ),
    Redirect(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
        "torch.cuda.current_device()",
        "saving optimizer state gathers each data-parallel shard through a GPU buffer",
    ),
    Redirect(
        "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.preload_tensors",
        "torch.cuda.synchronize()",
        "checkpoint saving waits for the GPU after its device-to-host copies",
    ),
    Redirect(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver:verify_global_md_reuse",
        "device='cuda'",
        "ranks agree on reusing a cached save plan through a GPU tensor",
    ),
    Redirect(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver:save_state_dict_async_finalize",
        "torch.cuda.current_device()",
        "ranks learn of a failed checkpoint write through a GPU tensor",
    ),
    Redirect(
        "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__",
        "device='cuda'",
        "the distributed optimizer (a MixedPrecisionOptimizer) keeps its found-inf flag on the GPU",
    ),
    Redirect(
        "megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
        "device='cuda'",
        "gradient norms are reduced in GPU tensors",
    ),
    Redirect(
        "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        "torch.cuda.FloatTensor",
        "gradient clipping accepts gradients only by their CUDA tensor type name",
    ),
    Redirect(
        "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.__init__",
        "torch.cuda.current_device()",
        "multi-latent attention and the DSA indexer build their rotary tables on the current CUDA device",
    ),
    Redirect(
        "megatron.core.transformer.moe.router:TopKRouter.__init__",
        "device=torch.cuda.current_device()",
        "a router with expert bias allocates the bias and its token counts on the current CUDA device",
    ),
    Redirect(
        "megatron.core.ssm.gated_delta_net:GatedDeltaNet.__init__",
        "device=torch.cuda.current_device()",
        "the gated delta net (Qwen3.5's linear attention) allocates its conv1d, dt_bias and A_log on the GPU",
    ),
    Redirect(
        "megatron.core.transformer.multi_token_prediction:roll_tensor",
        "device=torch.cuda.current_device()",
        "MTP layers under context parallelism receive each chunk's boundary token from the next chunk's rank "
        "into buffers on the current CUDA device",
    ),
    Redirect(
        "megatron.core.ssm.gated_delta_net:GatedDeltaNet.reset_parameters",
        "device=torch.cuda.current_device()",
        "the gated delta net initialises dt_bias and A_log on the current CUDA device",
    ),
)


@dataclass(frozen=True)
class Lift:
    """A megatron-core function a redirected function calls whose body needs no redirect: the
    redirect's function mode is lifted while it runs. Under a mode every torch call goes through
    Python, so a schedule redirected for its one CUDA token counter would run the whole model's
    forward that way; the model's own CUDA assumptions are redirects of their own, which push
    the mode again where they are."""

    target: str  # "module:name" of the function run without the mode
    caller: str  # a redirected function that calls it (its source names it)
    why: str
    # the lines of its source that mention CUDA and do not allocate (checked by stale())
    cuda_lines: tuple[str, ...] = ()


_SCHEDULE = "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining"
LIFTS: tuple[Lift, ...] = (
    Lift(
        "megatron.core.pipeline_parallel.schedules:forward_step",
        _SCHEDULE,
        "one microbatch's forward: the model and the loss",
        cuda_lines=('context_manager = torch.autocast("cuda", dtype=config.autocast_dtype)',),
    ),
    Lift(
        "megatron.core.pipeline_parallel.schedules:backward_step",
        _SCHEDULE,
        "one microbatch's backward (autograd's engine)",
    ),
)

# Module-level names megatron-core only defines when Transformer Engine imports, each with the
# None test megatron-core reads it through. Without TE, te_general_gemm unbound makes every MoE
# router forward and backward raise NameError instead of taking its torch GEMM, and the fused
# permutation names unbound make TransformerConfig(moe_permute_fusion=True) raise ImportError
# instead of megatron-core's own ValueError ("Please install TE >= 2.1.0").
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MISSING_SYMBOLS: tuple[tuple[str, str, str], ...] = (
    (_MOE_UTILS, "te_general_gemm", "te_general_gemm is not None"),
    (_MOE_UTILS, "fused_permute", "fused_permute is None"),
    (_MOE_UTILS, "fused_permute_with_probs", "fused_permute_with_probs is None"),
    (_MOE_UTILS, "fused_sort_chunks_by_index", "fused_sort_chunks_by_index is None"),
    (_MOE_UTILS, "fused_sort_chunks_by_index_with_probs", "fused_sort_chunks_by_index_with_probs is None"),
    (_MOE_UTILS, "fused_unpermute", "fused_unpermute is None"),
)


@dataclass(frozen=True)
class Patch:
    """A change to megatron-core other than a redirect, and the source text that makes it needed:
    it must be in the target's source (`present`), or, for a workaround of something megatron-core
    leaves undone, must not be."""

    target: str  # "module:Qualified.name" whose source is checked
    marker: str
    why: str
    present: bool = True


PATCHES: tuple[Patch, ...] = (
    Patch(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_with_transformer_engine_spec",
        "TESpecProvider()",
        "te_stand_ins() binds the module's TESpecProvider to the TE-shaped local provider when TE is absent",
    ),
    Patch(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_decoder_block_spec",
        "layer_norm_impl = TENorm",
        "te_stand_ins() binds the module's TENorm (the final norm of a TE spec) to the local norm",
    ),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.__init__",
        "if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:",
        "without_dispatcher_stream() sets the class's shared stream so the dispatcher builds without CUDA",
    ),
    Patch(
        "megatron.core.parallel_state:destroy_model_parallel",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None",
        "forget_destroyed_groups() drops the intra-partial data-parallel groups destroy_model_parallel keeps",
        present=False,
    ),
    Patch(
        "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
        "_set_cuda_rng_state(",
        "on_cpu() swaps the module's _get_cuda_rng_state and _set_cuda_rng_state for the CPU generator's",
    ),
    Patch(
        "megatron.core.transformer.multi_latent_attention:MultiLatentAttention.__init__",
        "HAVE_TE\n            and isinstance(self.linear_proj, TELinear)",
        "mla_without_te() sets the module's HAVE_TE false without Transformer Engine: its extensions module "
        "imports anyway (TE bound to a MagicMock), so TELinear is no type and MLA's isinstance check raises",
    ),
    Patch(
        "megatron.core.jit:enable_jit_fuser",
        "jit_fuser = torch.compile",
        "eager_fusions_without_cuda() makes the module's jit_fuser the identity in a process without CUDA, "
        "before any fusion module decorates with it: torch.compile imports TorchInductor (about 4 s of CPU "
        "in every process that imports megatron-core) and compiles the router's, experts' and norms' "
        "fused functions to C++ with the system compiler on their first CPU call",
    ),
    Patch(
        "megatron.core.ssm.gated_delta_net:GatedDeltaNet.__init__",
        "if not HAVE_FLA:",
        "gdn_without_fla() binds the module's fla kernels (chunk_gated_delta_rule, l2norm) to megatron-core's own "
        "torch form of the gated delta rule and an fla-equal l2norm where fla (Triton) is not installed",
    ),
    Patch(
        "megatron.core.ssm.gated_delta_net:torch_chunk_gated_delta_rule",
        "Torch-native implementation of chunked gated delta rule",
        "gdn_without_fla() runs this, megatron-core's own torch form, in place of fla's chunk kernel",
    ),
    Patch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue",
        "if _results_queue is None:",
        "writers_die_with_this_process() sets the module's _results_queue, served by a manager that dies "
        "with the trainer, before megatron-core spawns one that would outlive it",
    ),
)


class _CpuStream:
    """A CUDA stream or event on a machine where every operation is already synchronous."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_lock = threading.RLock()
_depth = 0
_installed: dict[str, object] = {}  # target -> the original function
_process_on_cpu = False  # install(): every megatron-core call of the process is CPU work
_scope = threading.local()  # cpu_placed(): this thread's enclosed calls are


def _placed_on_cpu() -> bool:
    return _process_on_cpu or getattr(_scope, "depth", 0) > 0


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, int):
        return True  # what torch.cuda.current_device() returns
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _function_mode(tensors_on_cuda: bool = False):
    import torch
    from torch.overrides import TorchFunctionMode

    is_cuda = torch.Tensor.is_cuda.__get__

    class CudaToCpu(TorchFunctionMode):
        """Inside a redirected function: CUDA placements become CPU ones."""

        placement = True  # lifted for the duration of a LIFTS function

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False  # page-locked host memory needs an accelerator
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.record_stream:
                return None
            if tensors_on_cuda and func == is_cuda:
                return True
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE.get(name, name)
            return func(*args, **kwargs)

    return CudaToCpu()


@contextlib.contextmanager
def on_cpu(tensors_on_cuda: bool = False) -> Iterator[None]:
    """Run megatron-core code that assumes CUDA on the CPU: the current device, the CUDA RNG and
    `device="cuda"` allocations all resolve to the CPU for the duration."""
    global _depth
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    with _lock:
        _depth += 1
        outermost = _depth == 1
    if not outermost:  # already inside a redirected call
        try:
            # autograd's backward (where recomputation reruns a layer's forward) runs without
            # the outer call's function mode: the placements need it again there
            if tensors_on_cuda or torch._C._len_torch_function_stack() == 0:
                with _function_mode(tensors_on_cuda):
                    yield
            else:
                yield
        finally:
            with _lock:
                _depth -= 1
        return
    saved = {
        (torch.cuda, "current_device"): torch.cuda.current_device,
        (torch.cuda, "get_rng_state"): torch.cuda.get_rng_state,
        (torch.cuda, "manual_seed"): torch.cuda.manual_seed,
        (torch.cuda, "synchronize"): torch.cuda.synchronize,
        (torch.cuda, "Stream"): torch.cuda.Stream,
        (torch.cuda, "current_stream"): torch.cuda.current_stream,
        (torch.cuda, "stream"): torch.cuda.stream,
        (mp_random, "_get_cuda_rng_state"): mp_random._get_cuda_rng_state,
        (mp_random, "_set_cuda_rng_state"): mp_random._set_cuda_rng_state,
    }
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda device="cpu": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = lambda *a, **k: _CpuStream()
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    try:
        with _function_mode(tensors_on_cuda):
            yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
        with _lock:
            _depth -= 1


def _resolve(target: str):
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


class _EnterExitOnCpu:
    """A context manager whose own enter and exit run on the CPU; the body inside it does not."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        with on_cpu():
            return self.inner.__enter__()

    def __exit__(self, *exc):
        with on_cpu():
            return self.inner.__exit__(*exc)


def _wrap(fn, tensors_on_cuda: bool = False):
    # A @contextmanager function runs its body at __enter__, not when called.
    makes_context = inspect.isgeneratorfunction(getattr(fn, "__wrapped__", None))

    @functools.wraps(fn)
    def on_cpu_call(*args, **kwargs):
        if not _placed_on_cpu():  # GPU work: megatron-core's own code, as it is
            return fn(*args, **kwargs)
        if makes_context:
            return _EnterExitOnCpu(fn(*args, **kwargs))
        with on_cpu(tensors_on_cuda):
            return fn(*args, **kwargs)

    on_cpu_call.__miles_cpu_redirect__ = True
    return on_cpu_call


def install() -> None:
    """Place every megatron-core call of this process on the CPU (idempotent): the CPU training
    backend and CPU workers. A process that also runs megatron-core on a GPU uses `cpu_placed()`
    for its CPU work instead."""
    global _process_on_cpu
    _install_redirects()
    bind_missing_te_names()
    _process_on_cpu = True


@contextlib.contextmanager
def cpu_placed() -> Iterator[None]:
    """Run the enclosed megatron-core work (of this thread) on the CPU, whatever GPUs are
    visible: models built, loaded and run on CPU tensors. Outside it the redirected functions
    run as megatron-core wrote them."""
    _install_redirects()
    bind_missing_te_names()
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1


def _lift(fn):
    @functools.wraps(fn)
    def lifted_call(*args, **kwargs):
        from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

        if not getattr(_get_current_function_mode(), "placement", False):
            return fn(*args, **kwargs)
        with _pop_mode_temporarily():
            return fn(*args, **kwargs)

    lifted_call.__miles_cpu_lift__ = True
    return lifted_call


def _install_redirects() -> None:
    """Wrap every entry (idempotent); a wrapped function redirects only CPU-placed calls.

    A module-level function is also replaced wherever megatron-core imported it by name
    (`from ... import get_grad_norm_fp32`), so every caller gets the redirected one. Each of
    LIFTS is wrapped to run without the redirect's function mode.
    """
    with _lock:
        for redirect in REDIRECTS:
            if redirect.target in _installed:
                continue
            owner, name = _resolve(redirect.target)
            original = inspect.getattr_static(owner, name)
            if isinstance(original, (staticmethod, classmethod)):
                wrapped = type(original)(_wrap(original.__func__, redirect.tensors_on_cuda))
            else:
                wrapped = _wrap(original, redirect.tensors_on_cuda)
            _replace(owner, name, original, wrapped)
            _installed[redirect.target] = original
        for lift in LIFTS:
            if lift.target in _installed:
                continue
            owner, name = _resolve(lift.target)
            original = inspect.getattr_static(owner, name)
            _replace(owner, name, original, _lift(original))
            _installed[lift.target] = original


def _replace(owner, name: str, original, wrapped) -> None:
    """`owner.name` = `wrapped`, and wherever megatron-core imported a module-level `original` by name."""
    import sys

    setattr(owner, name, wrapped)
    if inspect.ismodule(owner):
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("megatron.") and getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def bind_missing_te_names() -> None:
    """Bind each of MISSING_SYMBOLS to None where Transformer Engine did not define it (on any
    device; with TE installed every name exists and nothing changes)."""
    for module_name, symbol, _ in MISSING_SYMBOLS:
        module = importlib.import_module(module_name)
        if not hasattr(module, symbol):
            setattr(module, symbol, None)


@contextlib.contextmanager
def te_stand_ins(provider, norm) -> Iterator[object]:
    """megatron-core's gpt_layer_specs module with the TE names its TE spec functions use
    (TESpecProvider, TENorm) bound to `provider` and `norm` for the duration."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    missing = object()
    saved = {name: getattr(specs, name, missing) for name in ("TESpecProvider", "TENorm")}
    specs.TESpecProvider, specs.TENorm = provider, norm
    try:
        yield specs
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(specs, name)
            else:
                setattr(specs, name, value)


def without_dispatcher_stream() -> None:
    """Without CUDA, let the all-to-all MoE dispatcher be built: it makes a CUDA side stream when
    first built, which only its forward's copies use (the rank-grid proof stops before those)."""
    import torch
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not torch.cuda.is_available() and MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on CPU"


def mla_without_te() -> None:
    """Without Transformer Engine, let multi-latent attention be built: megatron-core's
    transformer_engine extensions import without TE (binding `te` to a MagicMock), so the MLA
    module believes TE is there and tests `isinstance(self.linear_proj, TELinear)` against a mock."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _l2norm(x, dim: int = -1, eps: float = 1e-6):
    """fla.modules.l2norm's value: x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    import torch

    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gdn_without_fla() -> None:
    """Without flash-linear-attention (fla: Triton kernels, absent on CPU and from some images), let
    megatron-core's GatedDeltaNet be built and run: its module refuses to build without fla and calls
    fla's chunk kernel and l2norm. The chunk rule is bound to megatron-core's own torch form (what
    its deterministic mode runs), l2norm to fla's formula. With fla installed nothing changes."""
    import importlib.util

    from megatron.core.ssm import gated_delta_net

    if gated_delta_net.HAVE_FLA or importlib.util.find_spec("fla") is not None:
        return
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    gated_delta_net.l2norm = _l2norm
    gated_delta_net.HAVE_FLA = True


def forget_destroyed_groups() -> None:
    """After `destroy_model_parallel`: forget the process groups megatron-core 0.16.1 keeps (the
    intra-partial data-parallel ones); a stale group's destructor, run later (in a forked child
    it waits forever on threads that were not forked), must not be left."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)


_writer_manager: list = []  # the manager serving megatron-core's writer queue, kept for the process's life


def writers_die_with_this_process() -> None:
    """No checkpoint writer outlives this process. megatron-core's writer forks its processes
    (covered by miles.children.arm) and reports through a queue served by a manager it spawns on
    first use (filesystem_async's module-level `_results_queue`, made by
    `_get_write_results_queue` only when unset); a spawned server runs no fork hook, so the queue
    is made here, by a manager started with miles.children.die_with_parent as its initializer.

    Where torch sees no CUDA device the manager is forked instead of spawned, as the CPU ranks
    themselves are (miles.train.forked_ranks): the server unpickles each write result, which
    imports torch.distributed.checkpoint, and a spawned one pays that import (1.5-1.9 s a saving
    rank by `-X importtime` on the 2-core machines) where a forked one has it already. With a
    GPU it is spawned, as megatron-core does: nothing is forked from a process that holds a
    CUDA context."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from miles import children

    children.arm()
    if filesystem_async._results_queue is not None:
        return
    method = "spawn" if torch.cuda.is_available() else "fork"
    manager = SyncManager(ctx=multiprocessing.get_context(method))
    manager.start(initializer=children.die_with_parent)
    _writer_manager.append(manager)
    filesystem_async._results_queue = manager.Queue()


_JIT_MODULE = "megatron.core.jit"


class _EagerJitLoader:
    """The loader of megatron.core.jit, then `disable_jit_fuser()` when torch sees no CUDA device."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        import torch  # megatron.core.jit has just imported it

        if not torch.cuda.is_available():
            module.disable_jit_fuser()


class _EagerJitFinder:
    """Finds megatron.core.jit as the other finders do and wraps its loader (_EagerJitLoader)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != _JIT_MODULE:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _EagerJitLoader(spec.loader)
        return spec


def eager_fusions_without_cuda() -> None:
    """From now on, a megatron-core imported in this process without CUDA runs its fusions
    eagerly (PATCHES: megatron.core.jit). Standard library only, idempotent; installed by
    miles/__init__.py so that it comes before any import of megatron-core. Where megatron-core is
    already imported it changes nothing (its fusions are decorated by then)."""
    import sys

    if not any(isinstance(f, type) and f is _EagerJitFinder for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerJitFinder)


def _source_of(target: str) -> str:
    owner, name = _resolve(target)
    fn = _installed.get(target) or inspect.getattr_static(owner, name)
    fn = getattr(fn, "__func__", fn)
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "__miles_cpu_redirect__", False) else fn
    return inspect.getsource(fn)


def stale() -> list[str]:
    """Entries that no longer describe megatron-core: another release than the one they were
    written for, a target that is gone, or a source that no longer holds the assumption an entry
    works around (so the entry may be unneeded or too narrow)."""
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    try:
        installed = version("megatron-core")
    except PackageNotFoundError:
        installed = "not installed"
    if installed != KNOWN_RELEASE:
        problems.append(
            f"megatron-core {installed} is installed; every entry here was written for {KNOWN_RELEASE}: "
            "check each one against the new release, then move KNOWN_RELEASE and the pins together"
        )
    for patch in PATCHES:
        try:
            source = _source_of(patch.target)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{patch.target}: not found in this megatron-core ({exc})")
            continue
        if (patch.marker in source) != patch.present:
            state = "no longer contains" if patch.present else "now contains"
            problems.append(f"{patch.target}: its source {state} {patch.marker!r} ({patch.why})")
    for redirect in REDIRECTS:
        try:
            source = _source_of(redirect.target)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{redirect.target}: not found in this megatron-core ({exc})")
            continue
        if redirect.marker not in source:
            problems.append(
                f"{redirect.target}: its source no longer contains {redirect.marker!r} ({redirect.why})"
            )
    for lift in LIFTS:
        try:
            source, caller = _source_of(lift.target), _source_of(lift.caller)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{lift.target}: not found in this megatron-core ({exc})")
            continue
        name = lift.target.rpartition(":")[2].rpartition(".")[2]
        if f"{name}(" not in caller:
            problems.append(f"{lift.target}: {lift.caller} no longer calls it ({lift.why})")
        cuda = [line.strip() for line in source.splitlines() if "cuda" in line.lower()]
        unexpected = [line for line in cuda if line not in lift.cuda_lines]
        if unexpected:
            problems.append(
                f"{lift.target}: its source now mentions CUDA ({unexpected[0]!r}); it runs without the CPU "
                f"placement's function mode ({lift.why}): redirect what it allocates or drop the lift"
            )
    for module_name, symbol, marker in MISSING_SYMBOLS:
        source = inspect.getsource(importlib.import_module(module_name))
        if marker not in source:
            problems.append(f"{module_name}.{symbol}: the module no longer tests {marker!r}")
    return problems
