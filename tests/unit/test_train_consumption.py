"""Which flags a run acts on follows from what its trainer, backend and engine declare they consume."""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from miles.train import consumption
from miles.train.args import parse_config
from miles.train.config import FLAGS, SECTIONS, Section

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = [("backend", c) for c in consumption.BACKENDS] + [("engine", c) for c in consumption.ENGINES]
COMPONENTS += [("remote", c) for c in consumption.REMOTE_ENGINES]
DECLARED = {
    "backend": consumption.BACKENDS,
    "engine": consumption.ENGINES,
    "remote": consumption.REMOTE_ENGINES,
}


def _config(*flags: str):
    return parse_config(["--hf-checkpoint", "m", *flags])


@pytest.mark.parametrize(("kind", "choice"), COMPONENTS)
def test_the_declaration_read_from_source_is_the_class_attribute(kind, choice):
    cls = consumption.component_class(kind, choice)
    module, name = DECLARED[kind][choice]
    assert consumption.declared(module, name) == consumption.checked_declaration(cls.CONSUMES, name)


def test_the_trainers_declaration_reads_from_its_module():
    from miles.train import trainer

    assert consumption.declared(*consumption.TRAINER) == consumption.checked_declaration(
        trainer.CONSUMES, "t"
    )


@pytest.mark.parametrize(("kind", "choice"), COMPONENTS)
def test_a_component_is_built_from_exactly_the_sections_it_declares(kind, choice):
    cls = consumption.component_class(kind, choice)
    factory = getattr(cls, "from_sections", cls)
    params = inspect.signature(factory).parameters.values()
    required = {p.name for p in params if p.default is inspect.Parameter.empty and p.name != "self"}
    assert required == {*cls.CONSUMES, "dist_info"}
    section_types = {s.__name__: s.name for s in SECTIONS} | {"ParallelLayout": "layout"}
    annotated = {p.name: section_types.get(str(p.annotation)) for p in params if p.name in cls.CONSUMES}
    assert annotated == {name: name for name in cls.CONSUMES}  # each takes its section's type


def _sources(module: str) -> list[Path]:
    """A component's module, the miles modules it imports (where its helpers read fields, in
    miles.megatron too) and the sections' own derivations (sampling, loss and optimizer settings)."""
    path = consumption.source_file(module)
    tree = ast.parse(path.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 for a in n.names}  # fmt: skip
    found = {consumption.source_file(m) for m in {*imported, "miles.train.config"} if m.startswith("miles.")}
    return sorted({path} | {f for f in found if f.is_file()})


def _unread(uses, module: str) -> list[str]:
    """Declared fields no attribute read in the component's sources names (a Namespace's excepted)."""
    read = {
        node.attr
        for path in _sources(module)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and not (isinstance(node.value, ast.Name) and node.value.id == "args")
    }
    return sorted(
        f"{s}.{f}" for s, fields in uses.items() if fields != consumption.ALL for f in fields if f not in read
    )


@pytest.mark.parametrize(
    ("module", "name"),
    [
        consumption.TRAINER,
        *consumption.BACKENDS.values(),
        *consumption.ENGINES.values(),
        *consumption.REMOTE_ENGINES.values(),
    ],
)
def test_every_field_a_component_declares_is_read_by_it(module, name):
    assert _unread(consumption.declared(module, name), module) == []


def test_a_declared_field_the_component_never_reads_is_caught():
    assert _unread({"logging": ("use_wandb",)}, "miles.train.backends.torch_dp") == ["logging.use_wandb"]


def test_a_declaration_naming_a_missing_section_or_field_is_refused():
    with pytest.raises(consumption.DeclarationError, match="no section 'optimiser'"):
        consumption.checked_declaration({"optimiser": "*"}, "X.CONSUMES")
    with pytest.raises(consumption.DeclarationError, match=r"section 'rollout' has no field\(s\) \['lr'\]"):
        consumption.checked_declaration({"rollout": ("lr",)}, "X.CONSUMES")


def test_a_megatron_flag_on_the_data_parallel_backend_is_refused():
    config = _config("--recompute-granularity", "full", "--sequence-parallel", "--num-layers", "4")
    assert consumption.flags_without_effect(config, "torch") == [
        "--sequence-parallel",
        "--num-layers",
        "--recompute-granularity",
    ]
    assert consumption.refusal(config, "torch") == (
        "--sequence-parallel --num-layers --recompute-granularity (read by --train-backend megatron): no effect "
        "on --train-backend fsdp with the torch rollout engine, so refused; drop them, or run with the backend "
        "or engine that reads them"
    )


def test_an_option_the_data_parallel_backend_alone_acts_on_is_refused_on_megatron(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2}')
    config = parse_config(
        ["--hf-checkpoint", str(tmp_path), "--train-backend", "megatron", "--gradient-checkpointing"]
    )
    assert consumption.flags_without_effect(config, "torch") == ["--gradient-checkpointing"]
    assert consumption.refusal(config, "torch").startswith(
        "--gradient-checkpointing (read by --train-backend fsdp/ddp): no effect on --train-backend megatron"
    )


def test_a_megatron_option_is_acted_on_by_megatron_and_refused_elsewhere(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2}')
    flags = ["--moe-grouped-gemm", "--balance-data", "--use-distributed-optimizer"]
    megatron = parse_config(["--hf-checkpoint", str(tmp_path), "--train-backend", "megatron", *flags])
    assert consumption.flags_without_effect(megatron, "sglang") == []
    assert consumption.refusal(megatron, "sglang") is None
    fsdp = consumption.refusal(_config(*flags), "sglang")
    assert fsdp.startswith(
        "--moe-grouped-gemm --use-distributed-optimizer (read by --train-backend megatron): no effect on "
        "--train-backend fsdp"
    ), fsdp


def test_the_engine_that_reads_a_flag_decides_whether_it_has_effect():
    config = _config("--sglang-mem-fraction-static", "0.7", "--sglang-dp-size", "2")
    assert consumption.flags_without_effect(config, "sglang") == []
    assert consumption.flags_without_effect(config, "torch") == [
        "--sglang-mem-fraction-static",
        "--sglang-dp-size",
    ]


def test_colocate_and_offload_are_refused_on_the_built_in_engine_with_why():
    config = _config("--colocate", "--offload-train", "--use-wandb", "--train-backend", "ddp")
    assert consumption.refusal(config, "torch") == (
        "--colocate (the built-in engine samples inside the trainer's processes and holds no GPU memory of its "
        "own to place or release, read by the sglang rollout engine); --offload-train (no backend moves its "
        "weights or optimizer state off the GPU between steps yet); --use-wandb (read by no component): no "
        "effect on --train-backend ddp with the torch rollout engine, so refused; drop them, or run with the "
        "backend or engine that reads them"
    )


def test_the_sglang_engine_acts_on_colocate_and_offload_rollout():
    """It frees its memory while the trainer steps with either (untested on GPU here)."""
    assert consumption.refusal(_config("--colocate", "--offload-rollout"), "sglang") is None
    assert consumption.refusal(_config("--offload-train"), "sglang").startswith("--offload-train (no backend")


def test_flags_set_to_their_default_are_not_reported():
    assert (
        consumption.flags_without_effect(_config("--micro-batch-size", "8", "--log-interval", "1"), "torch")
        == []
    )


def test_the_flags_no_component_acts_on_yet_are_these():
    """The missing features and the options accepted for the seeds' recipes; implementing one
    means declaring it where it is consumed, and this list shrinks."""
    everyone = [consumption.trainer()] + [consumption.backend(b) for b in consumption.BACKENDS]
    everyone += [consumption.engine(e) for e in consumption.ENGINES]
    everyone += [consumption.remote_engine(e) for e in consumption.REMOTE_ENGINES]
    unread = {f.option for f in FLAGS if not any(c.consumes(f) for c in everyone)}
    refused = {"--rm-url", "--kl-coef", "--optimizer"}  # refused unless left at their default
    planned = {
        "--offload", "--offload-train", "--partial-rollout",
        "--over-sampling-batch-size", "--dynamic-sampling-filter-path", "--rollout-function-path", "--num-epoch",
        "--tool-key", "--fp16", "--ckpt-format", "--keep-old-actor", "--finetune",
        "--debug-train-only", "--log-interval", "--log-passrate", "--use-wandb", "--wandb-project",
        "--wandb-group", "--wandb-key", "--wandb-host", "--wandb-mode", "--wandb-team",
        "--disable-wandb-random-suffix", "--use-tensorboard",
    }  # fmt: skip
    megatron_options = {f.option for f in FLAGS if f.section == "megatron"}
    read_by_megatron = {f"--{n.replace('_', '-')}" for n in consumption.backend("megatron").uses["megatron"]}
    assert unread == refused | planned | (megatron_options - read_by_megatron)


def test_asking_which_flags_have_no_effect_imports_no_heavy_package():
    code = (
        "import sys; from miles.train.args import parse_config; from miles.train.consumption import "
        "flags_without_effect; print(flags_without_effect(parse_config(['--hf-checkpoint', 'm', '--offload']), "
        "'sglang')); print(sorted(m for m in ('torch', 'transformers', 'megatron', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["['--offload']", "[]"]


# --- no module reads argparse's internals or tells components apart by class name ----------


def _modules():
    for path in sorted((ROOT / "miles").rglob("*.py")):
        yield path.relative_to(ROOT), ast.parse(path.read_text(), filename=str(path))


def _argparse_private_names() -> set[str]:
    """The private attributes of argparse's parser and argument group objects, from argparse itself."""
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("g")
    names = {n for obj in (parser, group) for n in vars(obj) if n.startswith("_") and not n.startswith("__")}
    names |= {n for cls in (argparse.ArgumentParser, argparse._ArgumentGroup) for n in dir(cls)}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_argparse_private_attributes():
    private = _argparse_private_names()
    assert {"_actions", "_action_groups", "_group_actions", "_option_string_actions"} <= private
    found = [
        f"{path}:{node.lineno}: .{node.attr}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in private
    ]
    assert found == []


def _component_class_names() -> set[str]:
    from miles.train.backends import TrainBackend
    from miles.train.rollout import RolloutEngine

    classes = {consumption.component_class(kind, choice) for kind, choice in COMPONENTS}
    return {c.__name__ for c in classes} | {RolloutEngine.__name__, TrainBackend.__name__}


def _names_a_component(node: ast.AST) -> bool:
    """`type(x).__name__` or `x.__class__.__name__` where x is an engine or a backend."""
    if not (isinstance(node, ast.Attribute) and node.attr == "__name__"):
        return False
    inner = node.value
    if (
        isinstance(inner, ast.Call)
        and isinstance(inner.func, ast.Name)
        and inner.func.id == "type"
        and inner.args
    ):
        inner = inner.args[0]
    elif isinstance(inner, ast.Attribute) and inner.attr == "__class__":
        inner = inner.value
    else:
        return False
    text = ast.unparse(inner).lower()
    return "engine" in text or "backend" in text


def _compares_a_class_name(node: ast.AST, names: set[str]) -> bool:
    """`x == "SGLangRolloutEngine"`, `x.startswith("SGLang")`, `isinstance(x, TorchRolloutEngine)`."""

    def matches(value: object) -> bool:
        return isinstance(value, str) and bool(value) and any(n.startswith(value) for n in names)

    if isinstance(node, ast.Compare):
        return any(isinstance(c, ast.Constant) and matches(c.value) for c in [node.left, *node.comparators])
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith"):
        return any(isinstance(c, ast.Constant) and matches(c.value) for a in node.args for c in ast.walk(a))
    if isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass") and node.args[1:]:
        return bool({n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & names)
    return False


def test_no_module_tells_engines_or_backends_apart_by_class():
    names = _component_class_names()
    found = [
        f"{path}:{node.lineno}: {ast.unparse(node)}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if _names_a_component(node) or _compares_a_class_name(node, names)
    ]
    assert found == []


def test_the_class_name_checks_would_be_found():
    names = _component_class_names()
    for line in (
        'kind = "sglang" if type(engine).__name__.startswith("SGLang") else "torch"',
        "exact = isinstance(run.engine, TorchRolloutEngine)",
        'megatron = backend.__class__.__name__ == "MegatronBackend"',
    ):
        nodes = list(ast.walk(ast.parse(line)))
        assert any(_names_a_component(n) or _compares_a_class_name(n, names) for n in nodes), line


def test_every_section_is_one_a_component_can_name():
    assert all(issubclass(s, Section) for s in SECTIONS)
    assert {name for c in COMPONENTS for name in consumption.component_class(*c).CONSUMES} <= {
        s.name for s in SECTIONS
    }
