"""The layer spec every miles GPTModel is built with: Transformer Engine's, with or without TE.

GPU jobs train with megatron-core's Transformer Engine spec, whose modules fuse the input
norm into `linear_qkv` and the dense MLP's norm into `linear_fc1`, while an MoE layer keeps a
separate `pre_mlp_layernorm`. Those choices decide a checkpoint's keys. The stand-in spec
("local": the CPU lane, GPU machines without TE, and every checkpoint conversion, whose logit
check runs on the CPU) calls the same spec function of megatron-core with a provider whose
modules are plain PyTorch/megatron-core ones with TE's parameter names, so the module tree,
and therefore every state-dict and sharded key, is the one a TE job builds and loads.
Numerically they are the unfused operations TE fuses: a norm, then the linear.

Which one a run builds is decided once (`choose_impl`): `--transformer-impl` as Megatron-LM
reads it, else TE where megatron-core's own import of it succeeded (`te_status`) and the run
is on a GPU. `built_spec_line` reads the classes actually built, for the run's first line.

Experts: with `--moe-grouped-gemm` TE builds TEGroupedMLP, whose sharded state dict
megatron-core defines to be interchangeable with SequentialMLP's (the stand-in here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TE = "transformer_engine"
LOCAL = "local"


class SpecRefused(ValueError):
    """The requested layer spec cannot be built here; the message names the flag and the fix."""


@dataclass(frozen=True)
class TEStatus:
    ok: bool
    version: str | None
    reason: str  # why not, when not ok
    broken: bool = False  # installed, and importing it raises what megatron-core does not catch


def te_status() -> TEStatus:
    """Whether megatron-core's Transformer Engine layers can be built here: megatron-core's own
    import of TE (`HAVE_TE`). A TE that is installed but broken (no cuDNN, mismatched versions,
    an extension built for another torch) raises other errors than ImportError at import,
    which megatron-core does not catch; they are a reason here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from megatron.core.extensions import transformer_engine as mte
    except Exception as exc:  # RuntimeError (cuDNN), AssertionError (versions), OSError (the .so)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return TEStatus(False, None, f"importing it failed: {type(exc).__name__}: {first}", broken=True)
    if not mte.HAVE_TE:
        return TEStatus(False, None, "transformer_engine is not installed")
    try:
        found = version("transformer-engine")
    except PackageNotFoundError:
        found = None
    return TEStatus(True, found, "")


def core_te_usage() -> dict[str, bool]:
    """What megatron-core does with the Transformer Engine installed here: builds its TE layer
    spec (its own HAVE_TE), and steps with TE's FusedAdam rather than torch's AdamW."""
    from megatron.core import optimizer
    from megatron.core.extensions import transformer_engine as mte

    return {"megatron_te": bool(mte.HAVE_TE), "fused_adam": not optimizer.USING_PYTORCH_OPTIMIZER}


def choose_impl(requested: str | None, device: str, status: TEStatus | None = None) -> tuple[str, str]:
    """(spec, why) for `--transformer-impl requested` on `device` ("cpu", "cuda:0", ...), as
    Megatron-LM reads the flag (transformer_engine or local); unset: TE where it loads on a GPU.
    Raises SpecRefused for a spec that cannot be built here."""
    on_cpu = device == "cpu"
    if requested not in (None, TE, LOCAL):
        raise SpecRefused(
            f"--transformer-impl {requested}: the Megatron backend builds 'transformer_engine' or 'local' "
            "(megatron-core's TE spec or its stand-in with the same keys)"
        )
    status = status or te_status()
    if status.broken:  # megatron-core's other modules would fail to import with it, whatever the spec
        raise SpecRefused(
            f"Transformer Engine is installed but does not load here ({status.reason}), and megatron-core's "
            "modules fail to import with it: run in the lane's image (docker/Dockerfile, docker/Dockerfile.rocm "
            "build it), or uninstall transformer-engine to train with the stand-in spec"
        )
    if requested == LOCAL:
        return LOCAL, "--transformer-impl local"
    if on_cpu:
        if requested == TE:
            raise SpecRefused(
                "--transformer-impl transformer_engine: Transformer Engine's layers run on CUDA or ROCm GPUs "
                "and this run is on the CPU; pass --transformer-impl local or leave the flag out"
            )
        return LOCAL, "on the CPU"
    if status.ok:
        return TE, f"transformer-engine {status.version or '(version unknown)'}"
    if requested == TE:
        raise SpecRefused(
            f"--transformer-impl transformer_engine: Transformer Engine does not load here ({status.reason}); "
            "run in the lane's image (docker/Dockerfile, docker/Dockerfile.rocm build it) or pass "
            "--transformer-impl local"
        )
    return LOCAL, f"no Transformer Engine: {status.reason}"


def _norm_fn(config, x: torch.Tensor, weight: torch.Tensor, bias, eps: float) -> torch.Tensor:
    if config.layernorm_zero_centered_gamma:  # --apply-layernorm-1p: the weight is stored minus 1, as TE's
        weight = weight + 1
    if config.normalization == "RMSNorm":
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class Norm(torch.nn.Module):
    """TENorm's stand-in: RMSNorm or LayerNorm by config.normalization, `weight` (and `bias`).

    Under sequence parallelism each tensor-parallel rank normalises its own slice of the
    sequence, so the weight is marked for the gradient all-reduce megatron-core's
    finalize_model_grads does for such parameters (as TE's and Apex's norms mark theirs).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.config = config
        self.eps = eps
        start = torch.zeros if config.layernorm_zero_centered_gamma else torch.ones  # 1 + w starts at 1
        self.weight = torch.nn.Parameter(start(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if config.normalization != "RMSNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm_fn(self.config, x, self.weight, self.bias, self.eps)


def _column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        """TELayerNormColumnParallelLinear's stand-in: `layer_norm_weight` (and `layer_norm_bias`)
        applied to the input, then megatron-core's ColumnParallelLinear."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            start = torch.zeros if config.layernorm_zero_centered_gamma else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(start(input_size, dtype=config.params_dtype))
            self.layer_norm_bias = None
            if config.normalization != "RMSNorm":
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            for param in (self.layer_norm_weight, self.layer_norm_bias):
                if param is not None:
                    param.sequence_parallel = config.sequence_parallel

        def forward(self, input_, weight=None, runtime_gather_output=None):
            normed = _norm_fn(
                self.config,
                input_,
                self.layer_norm_weight,
                self.layer_norm_bias,
                self.config.layernorm_epsilon,
            )
            return super().forward(normed, weight=weight, runtime_gather_output=runtime_gather_output)

    return NormColumnParallelLinear


class TEShapedSpecProvider:
    """megatron-core's BackendSpecProvider protocol, answered with TE-shaped local modules."""

    def linear(self):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        return ColumnParallelLinear

    def column_parallel_linear(self):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        return ColumnParallelLinear

    def row_parallel_linear(self):
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        global _NORM_LINEAR
        if _NORM_LINEAR is None:
            _NORM_LINEAR = _column_parallel_linear()
        return _NORM_LINEAR

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
        return Norm

    def core_attention(self):
        return core_attention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP

        return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def activation_func(self):
        return None


_NORM_LINEAR = None


def core_attention(config, **kwargs):
    """megatron-core's DotProductAttention, or with context parallelism (which it does not support,
    and which TE's attention does with its own communication) the all-gather form below."""
    if config.context_parallel_size > 1:
        from miles.megatron.attention import AllGatherContextParallelAttention

        return AllGatherContextParallelAttention(config, **kwargs)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention(config, **kwargs)


def decoder_block_spec(config, *, impl: str = LOCAL, vp_stage: int | None = None, pp_rank: int | None = None):
    """The TransformerBlock spec of this pipeline stage (and virtual stage): megatron-core's
    Transformer Engine spec with TE's modules (`impl` "transformer_engine") or the stand-in ones."""
    from miles.megatron.compat import bind_missing_te_names

    bind_missing_te_names()
    if impl == TE:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, vp_stage=vp_stage, pp_rank=pp_rank
        )
    global _NORM_LINEAR
    from miles.megatron.compat import te_stand_ins

    if _NORM_LINEAR is None:
        _NORM_LINEAR = _column_parallel_linear()
    with te_stand_ins(TEShapedSpecProvider, Norm) as specs:
        return specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, vp_stage=vp_stage, pp_rank=pp_rank
        )


def _class(obj) -> str:
    return type(obj).__name__


def built_spec_line(chunks, optimizer, impl: str, why: str, attention_backend=None) -> str:
    """What was built, read off the modules themselves: the spec, its attention, fused linear,
    expert and optimizer classes (the run's first line)."""
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    parts = []
    if layers:
        attention = layers[0].self_attention
        backend = f" [{attention_backend.name}]" if impl == TE and attention_backend is not None else ""
        # a family's own attention (Inkling's, DeepSeek-V4's) may be its own core, with no fused qkv
        parts.append(f"attention {_class(getattr(attention, 'core_attention', attention))}{backend}")
        # MLA (GLM-5.2) has no linear_qkv: its query up-projection is the norm-fused linear
        names = ("linear_qkv", "linear_q_up_proj", "linear_q_proj")
        qkv = next((n for n in names if hasattr(attention, n)), None)
        if qkv is not None:
            parts.append(f"{qkv} {_class(getattr(attention, qkv))}")
        experts = sorted({_class(layer.mlp.experts) for layer in layers if hasattr(layer.mlp, "experts")})
        if experts:
            parts.append(f"experts {'/'.join(experts)}")
    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    names = sorted({f"{type(o).__module__.split('.')[0]} {_class(o)}" for o in inner if o is not None})
    if names:
        parts.append(f"optimizer {', '.join(names)}")
    spec = "Transformer Engine layer spec" if impl == TE else "stand-in layer spec"
    model = type(chunks[0]) if chunks else None
    if model is not None and model.__name__ != "GPTModel":  # a family's own model (its mapping's build_model)
        spec = f"{model.__module__}.{model.__name__}"
    return f"megatron {spec} ({why}): {', '.join(parts)}"


def layer_provider(impl: str = "local"):
    """The modules of the Transformer Engine layer spec: TE's own (`impl` "transformer_engine"),
    or the TE-shaped local ones (ready once `decoder_block_spec` has run)."""
    if impl == TE:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    from miles.megatron.compat import mla_without_te

    mla_without_te()
    return TEShapedSpecProvider()
