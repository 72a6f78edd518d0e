"""Which flags a run acts on follows from what its trainer, backend and engine declare they consume."""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.train import consumption
from miles.train.args import parse_config
from miles.train.config import FLAGS, SECTIONS, Section

register_cpu_ci(est_time=4, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = [("backend", c) for c in consumption.BACKENDS] + [("engine", c) for c in consumption.ENGINES]
COMPONENTS += [("remote", c) for c in consumption.REMOTE_ENGINES]


def _config(*flags: str):
    return parse_config(["--hf-checkpoint", "m", *flags])


def _consumer(kind: str, choice: str) -> consumption.Consumer:
    return consumption.consumer(kind, choice)


def test_a_flag_naming_an_unknown_component_is_refused_where_it_is_declared():
    from miles.train.config import flag

    with pytest.raises(ValueError, match=r"no component \['fsdp2'\]; components: trainer, fsdp, ddp"):
        flag(by=("trainer", "fsdp2"), type=int)


def test_a_sections_default_consumers_apply_to_the_fields_that_name_none():
    by = {f.dest: f.by for f in FLAGS}
    assert by["tensor_model_parallel_size"] == {"megatron"}  # ParallelFlags.used_by
    assert by["gradient_checkpointing"] == {"fsdp", "ddp"}  # TorchDPConfig.used_by
    assert by["eval_interval"] == {"trainer"}
    assert by["hf_checkpoint"] == {
        "trainer", "fsdp", "ddp", "megatron", "torch", "sglang", "torch-servers", "sglang-servers",
    }  # fmt: skip
    assert by["use_wandb"] == frozenset()  # nothing acts on it yet: refused when set


@pytest.mark.parametrize(("kind", "choice"), COMPONENTS)
def test_a_component_is_built_from_exactly_the_sections_of_the_flags_it_acts_on(kind, choice):
    cls = consumption.component_class(kind, choice)
    sections = _consumer(kind, choice).sections
    factory = getattr(cls, "from_sections", cls)
    params = inspect.signature(factory).parameters.values()
    required = {p.name for p in params if p.default is inspect.Parameter.empty and p.name != "self"}
    assert required == {*sections, "dist_info"}
    section_types = {s.__name__: s.name for s in SECTIONS} | {"ParallelLayout": "layout"}
    annotated = {p.name: section_types.get(str(p.annotation)) for p in params if p.name in sections}
    assert annotated == {name: name for name in sections}  # each takes its section's type


# The modules where each component reads the sections it is given: the trainer's loop and the
# machinery it pushes into helpers, each backend's and engine's own modules.
COMPONENT_MODULES = {
    "trainer": (
        "miles.train.trainer", "miles.train.runtime", "miles.train.checkpoint", "miles.train.evaluation",
        "miles.train.inputs", "miles.train.async_rollout",
        "miles.rollout.on_policy_distillation",  # --use-opd's reward functions, which the trainer loads
    ),
    "fsdp": ("miles.train.backends.torch_dp",),
    "ddp": ("miles.train.backends.torch_dp",),
    "megatron": ("miles.train.backends.megatron", "miles.megatron.options"),
    "torch": ("miles.train.rollout",),
    "sglang": ("miles.train.sglang_engine", "miles.train.sglang_server"),
    "torch-servers": ("miles.train.remote.engine",),
    # its base class (miles.train.remote.engine) reads the engines and sglang sections for both; the
    # torch servers' own constructor there reads --bf16, which SGLang's servers do not
    "sglang-servers": ("miles.train.remote.sglang",),
}  # fmt: skip
SECTION_FIELDS = {s.name: {f.dest for f in s.flags()} for s in SECTIONS if s.name != "layout"}
SECTION_FIELDS["sglang"].add("server_args")
SECTION_TYPES = {s.__name__: s.name for s in SECTIONS}


def _file(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _derived_reads() -> dict[str, set[str]]:
    """'section.method' -> the fields a section's own method or property reads (self.<field>)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "miles/train/config").glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if isinstance(cls, ast.ClassDef) and cls.name in SECTION_TYPES:
                section = SECTION_TYPES[cls.name]
                for fn in cls.body:
                    if isinstance(fn, ast.FunctionDef) and section in SECTION_FIELDS:
                        read = {
                            n.attr for n in ast.walk(fn)
                            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                        }  # fmt: skip
                        out[f"{section}.{fn.name}"] = read & SECTION_FIELDS[section]
    return out


def _section_of(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The section an expression is: `<x>.checkpoint`, or a name bound to a section."""
    if isinstance(node, ast.Attribute) and node.attr in SECTION_FIELDS:
        return node.attr
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _aliases(fn: ast.AST) -> dict[str, str]:
    """Names a function binds to a section: parameters named or typed as one, and assignments
    from one (`ckpt = run.config.checkpoint`, `cfg, checked = run.config, run.config.checks`)."""
    found: dict[str, str] = {}
    args = fn.args.args + fn.args.kwonlyargs if isinstance(fn, ast.FunctionDef) else []
    for a in args:
        typed = SECTION_TYPES.get(ast.unparse(a.annotation)) if a.annotation is not None else None
        if typed or a.arg in SECTION_FIELDS:
            found[a.arg] = typed or a.arg
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (
                    zip(target.elts, node.value.elts, strict=False)
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                    else [(target, node.value)]
                )
                for name, value in pairs:
                    section = _section_of(value, found)
                    if isinstance(name, ast.Name) and section:
                        found[name.id] = section
    return found


def _reads(module: str) -> set[str]:
    """'section.field' for every field of a section the module reads: `<section>.<field>`, or a
    section method or property that reads fields (found statically: a section kept on `self`
    under another name is not seen, so this finds a subset of the reads)."""
    derived = _derived_reads()
    read: set[str] = set()
    tree = ast.parse(_file(module).read_text())
    for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
        aliases = _aliases(fn)
        for node in ast.walk(fn):
            if not isinstance(node, ast.Attribute):
                continue
            section = _section_of(node.value, aliases)
            if section is None:
                continue
            if node.attr in SECTION_FIELDS[section]:
                read.add(f"{section}.{node.attr}")
            read |= {f"{section}.{f}" for f in derived.get(f"{section}.{node.attr}", ())}
    return read


def _declared(component: str) -> set[str]:
    return {f"{s}.{f}" for s, fields in consumption.fields_used_by(component).items() for f in fields}


@pytest.mark.parametrize("component", sorted(COMPONENT_MODULES))
def test_every_field_a_component_reads_is_declared_as_acted_on_by_it(component):
    read = set().union(*(_reads(m) for m in COMPONENT_MODULES[component]))
    assert sorted(read - _declared(component)) == []


def _sources(module: str) -> list[Path]:
    """A component's module, the miles modules it imports (where its helpers read fields, in
    miles.megatron too) and the sections' own derivations (sampling, loss and optimizer settings)."""
    path = _file(module)
    tree = ast.parse(path.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 for a in n.names}  # fmt: skip
    found = {_file(m) for m in imported if m.startswith("miles.")}
    config = sorted((ROOT / "miles/train/config").glob("*.py"))
    return sorted({path, *config} | {f for f in found if f.is_file()})


# Sections a component reads as a whole, not field by field: the layout flags become one
# ParallelLayout, and the megatron backend checks every model-shape flag against config.json by
# its option string (check_model_flags).
WHOLE = ("layout", "model")


def _unread(uses, modules) -> list[str]:
    """Declared fields no attribute read in the components' sources names (a Namespace's excepted)."""
    read = {
        node.attr
        for module in modules
        for path in _sources(module)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and not (isinstance(node.value, ast.Name) and node.value.id == "args")
    }
    return sorted(f"{s}.{f}" for s, fields in uses.items() if s not in WHOLE for f in fields if f not in read)


@pytest.mark.parametrize("component", sorted(COMPONENT_MODULES))
def test_every_field_declared_as_acted_on_is_read_by_the_component(component):
    assert _unread(consumption.fields_used_by(component), COMPONENT_MODULES[component]) == []


def test_a_declared_field_the_component_never_reads_is_caught():
    assert _unread({"logging": ("use_wandb",)}, ["miles.train.backends.torch_dp"]) == ["logging.use_wandb"]


def test_a_field_read_but_not_declared_is_caught():
    source = (
        "def step(run, job: JobConfig):\n"
        "    checked = run.config.checks\n"
        "    return job.seed, checked.ci_test, run.config.algorithm.loss_config(1.0), run.config.rollout.samples\n"
    )
    tree = ast.parse(source)
    fn = tree.body[0]
    aliases = _aliases(fn)
    assert aliases == {"job": "job", "checked": "checks"}
    derived = _derived_reads()
    assert {"eps_clip", "kl_loss_coef", "calculate_per_token_loss"} <= derived["algorithm.loss_config"]
    assert derived["rollout.samples"] == {"rollout_batch_size", "n_samples_per_prompt"}


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


def test_colocate_and_offload_rollout_are_refused_on_the_built_in_engine_with_why():
    config = _config("--colocate", "--offload-rollout", "--use-wandb", "--train-backend", "ddp")
    assert consumption.refusal(config, "torch") == (
        "--colocate --offload-rollout (the built-in engine samples inside the trainer's processes and holds no "
        "GPU memory of its own to place or release, read by the sglang rollout engine); --use-wandb (read by no "
        "component): no effect on --train-backend ddp with the torch rollout engine, so refused; drop them, or "
        "run with the backend or engine that reads them"
    )


def test_the_sglang_engine_acts_on_colocate_and_offload_rollout():
    """It frees its memory while the trainer steps with either (untested on GPU here)."""
    assert consumption.refusal(_config("--colocate", "--offload-rollout"), "sglang") is None


def test_every_backend_acts_on_offload_train_with_either_engine():
    for backend in consumption.BACKENDS:
        for engine in consumption.ENGINES:
            config = _config("--train-backend", backend, "--offload", "--offload-train")
            assert consumption.refusal(config, engine) is None, (backend, engine)


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
    refused = {"--kl-coef", "--optimizer"}  # refused unless left at their default
    # R2 (the old-logprob forward's routing replayed in training) is not built; R3 is
    refused.add("--use-routing-replay")
    # no rollout engine dumps its tensors, and nothing runs SGLang's source patcher in the trainer
    refused |= {
        "--dumper-inference",
        "--dumper-source-patcher-config-train",
        "--dumper-source-patcher-config-inference",
    }
    planned = {
        "--partial-rollout",
        "--over-sampling-batch-size", "--dynamic-sampling-filter-path", "--rollout-function-path", "--num-epoch",
        "--tool-key", "--fp16", "--ckpt-format", "--keep-old-actor", "--finetune",
        "--log-interval", "--log-passrate", "--use-wandb", "--wandb-project",
        "--wandb-group", "--wandb-key", "--wandb-host", "--wandb-mode", "--wandb-team",
        "--disable-wandb-random-suffix", "--use-tensorboard",
    }  # fmt: skip
    megatron_options = {f.option for f in FLAGS if f.section == "megatron"}
    read_by_megatron = {f"--{n.replace('_', '-')}" for n in consumption.backend("megatron").uses["megatron"]}
    assert unread == refused | planned | (megatron_options - read_by_megatron)


def test_asking_which_flags_have_no_effect_imports_no_heavy_package():
    code = (
        "import sys; from miles.train.args import parse_config; from miles.train.consumption import "
        "flags_without_effect; print(flags_without_effect(parse_config(['--hf-checkpoint', 'm', '--use-wandb']), "
        "'sglang')); print(sorted(m for m in ('torch', 'transformers', 'megatron', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["['--use-wandb']", "[]"]


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
    built_from = {name for c in COMPONENTS for name in _consumer(*c).sections}
    assert built_from | {"trainer"} <= {s.name for s in SECTIONS} | {"trainer"}
