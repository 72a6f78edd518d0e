"""The fusions the Megatron backend turns on with Transformer Engine's layer spec, and what the
installed megatron-core requires of each, read from its source.

Megatron-LM turns five fusions on by default (its arguments.py); miles does the same with TE's
spec (miles.megatron.options.transformer_fields), each only where what it needs is there.
`FUSIONS` is miles' side: per TransformerConfig field, the extension modules the fusion runs
(it is turned on only where each imports) and how miles meets every check megatron-core's
constructors make of it. `scan()` is megatron-core's side, with the standard library's `ast`:

- **checks**: every `raise` or `assert` in a constructor (`__init__`, `__post_init__`) under a
  condition that reads the field (`config.<field>`, `self.<field>`, `self.config.<field>`);
- **modules**: the extension modules the fusion's code imports: a module imported in a
  `try`/`except ImportError` whose flag a check reads (ColumnParallelLinear's
  `_grad_accum_fusion_available`, bound by `import fused_weight_gradient_mlp_cuda`), and the
  modules imported inside functions of code that reads the field, or reads it under the
  keyword it is passed as (FusedScaleMaskSoftmax's `scaled_masked_softmax_fusion` imports
  `scaled_upper_triang_masked_softmax_cuda` when it runs), leaving out the standard library,
  torch, megatron and Transformer Engine (which TE's spec brings).

tests/unit/test_megatron_fusions.py requires the two sides to agree for the installed release:
an upgrade that adds a check or an extension fails there. Standard library only.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

CONSTRUCTORS = ("__init__", "__post_init__")
_NOT_EXTENSIONS = frozenset({"torch", "megatron", "transformer_engine", "numpy", "einops", "packaging"})


@dataclass(frozen=True)
class Fusion:
    """One fusion: its TransformerConfig field, the flag that turns it off, the extension
    modules it runs (all must import, or it stays off), and miles' answer to each constructor
    check megatron-core makes of it, keyed as `Check.key` names them."""

    field: str
    flag: str
    modules: tuple[str, ...] = ()
    answers: Mapping[str, str] = field(default_factory=dict)
    te_kernel: bool = False  # runs a Transformer Engine kernel megatron-core binds only when TE imports


_TC = "megatron.core.transformer.transformer_config:"
_SWIGLU = "miles' families compute SwiGLU (silu, gated)"

FUSIONS: tuple[Fusion, ...] = (
    Fusion("apply_rope_fusion", "--no-rope-fusion", (), {
        _TC + "TransformerConfig.__post_init__ (self.apply_rope_fusion) and (not self.multi_latent_attention) and "
        "(self.rotary_interleaved) and (not is_te_min_version('2.3.0'))": "no family miles maps sets rotary_interleaved",
        _TC + "TransformerConfig.__post_init__ (self.apply_rope_fusion) and (not self.multi_latent_attention) and "
        "(fused_apply_rotary_pos_emb is None and fused_apply_rotary_pos_emb_thd is None)": (
            "on only with TE's spec, where Transformer Engine (and so its fused rope) imports"
        ),
        _TC + "TransformerConfig.__post_init__ (self.experimental_attention_variant == 'dsa') and "
        "(not self.apply_rope_fusion)": "GLM-5.2's family (DSA) turns it off, and a family's off wins",
        _TC + "MLATransformerConfig.__post_init__ (self.multi_latent_attention and self.apply_rope_fusion and "
        "(self.rope_type != 'yarn'))": "the MLA family (GLM-5.2) turns it off, and a family's off wins",
        _TC + "MLATransformerConfig.__post_init__ (self.cache_mla_latents) and (self.apply_rope_fusion is False)": (
            "miles never sets cache_mla_latents"
        ),
    }, te_kernel=True),
    Fusion("bias_dropout_fusion", "--no-bias-dropout-fusion", (), {
        "megatron.core.transformer.moe.experts:TEGroupedMLP.__init__ "
        "(not (self.config.add_bias_linear and config.bias_dropout_fusion))": (
            "miles' families build no linear biases (add_bias_linear False)"
        ),
    }),
    # FusedScaleMaskSoftmax (megatron-core's own attention) imports these when it runs; they are
    # Apex's or Megatron-LM's compiled kernels, in neither image
    Fusion(
        "masked_softmax_fusion",
        "--no-masked-softmax-fusion",
        ("scaled_masked_softmax_cuda", "scaled_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
    ),
    Fusion("bias_activation_fusion", "--no-bias-swiglu-fusion", (), {
        _TC + "TransformerConfig.__post_init__ (self.bias_activation_fusion) and "
        "(self.activation_func not in [F.gelu, F.silu, quick_gelu])": _SWIGLU,
        _TC + "TransformerConfig.__post_init__ (self.bias_activation_fusion) and (self.activation_func == F.gelu "
        "and (not self.gated_linear_unit) and (not self.add_bias_linear))": _SWIGLU,
        _TC + "TransformerConfig.__post_init__ (self.bias_activation_fusion) and (self.activation_func == "
        "quick_gelu and (not self.gated_linear_unit))": _SWIGLU,
        _TC + "TransformerConfig.__post_init__ (self.bias_activation_fusion) and (self.glu_linear_offset != 0.0 "
        "and self.activation_func != quick_gelu)": "miles never sets glu_linear_offset",
        _TC + "TransformerConfig.__post_init__ (self.bias_activation_fusion) and (self.use_te_activation_func)": (
            "miles never sets use_te_activation_func"
        ),
    }),
    # Apex's extension: megatron-core's plain ColumnParallelLinear (GPTModel's output layer, with
    # TE's spec too) refuses to build without it (tensor_parallel/layers.py in 0.16.1)
    Fusion("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion", ("fused_weight_gradient_mlp_cuda",), {
        "megatron.core.model_parallel_config:ModelParallelConfig.__post_init__ "
        "(self.defer_embedding_wgrad_compute and (not self.gradient_accumulation_fusion))": (
            "miles never sets defer_embedding_wgrad_compute"
        ),
        "megatron.core.tensor_parallel.layers:ColumnParallelLinear.__init__ "
        "(config.gradient_accumulation_fusion and (not _grad_accum_fusion_available))": (
            "on only where fused_weight_gradient_mlp_cuda imports"
        ),
    }),
)  # fmt: skip
BY_FIELD: Mapping[str, Fusion] = {f.field: f for f in FUSIONS}


def module_imports(name: str) -> bool:
    """Whether `name` imports here (an extension that is installed but cannot load is a no)."""
    try:
        importlib.import_module(name)
    except Exception:  # an extension module fails in many ways (ImportError, OSError, RuntimeError)
        return False
    return True


def fusion_fields(
    turned_off: Mapping[str, bool], impl: str, imports: Callable[[str], bool] = module_imports
) -> dict[str, bool]:
    """field -> on, for every fusion: on with TE's spec (`impl`) unless its flag turned it off
    (`turned_off`: field -> the flag's value) or a module it runs does not import (Transformer
    Engine itself, for a TE kernel)."""
    te = impl == "transformer_engine"
    needs = {f.field: (*f.modules, *(("transformer_engine",) if f.te_kernel else ())) for f in FUSIONS}
    return {
        f.field: te and not turned_off.get(f.field, False) and all(imports(m) for m in needs[f.field])
        for f in FUSIONS
    }


# --- megatron-core's side -------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """A raise or assert in a constructor under a condition that reads a fusion's field.

    `condition` is every condition it sits under, outermost first, then an assert's own test,
    each in parentheses: the key miles' table answers it by."""

    field: str
    module: str
    function: str  # Qualified.name
    path: str  # relative to site-packages
    line: int
    condition: str

    @property
    def key(self) -> str:
        return f"{self.module}:{self.function} {self.condition}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.function} refuses {self.field} when {self.condition}"


@dataclass(frozen=True)
class Scan:
    checks: tuple[Check, ...]
    modules: Mapping[str, tuple[str, ...]]  # field -> extension modules its code imports


def _reads(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in names for n in ast.walk(node))


def _module_name(path: Path, site: Path) -> str:
    return ".".join(path.relative_to(site).with_suffix("").parts).removesuffix(".__init__")


def _top(name: str) -> str:
    return name.split(".")[0]


def _extension(name: str) -> bool:
    top = _top(name)
    return bool(top) and top not in sys.stdlib_module_names and top not in _NOT_EXTENSIONS


def _guarded_imports(tree: ast.Module) -> dict[str, str]:
    """name bound by a module-level try/except ImportError -> the module the try imports."""
    out: dict[str, str] = {}
    for stmt in tree.body:
        if not isinstance(stmt, ast.Try):
            continue
        imported = [
            a.name if isinstance(n, ast.Import) else (n.module or "")
            for n in ast.walk(ast.Module(stmt.body, []))
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in n.names
        ]
        if not imported:
            continue
        for node in ast.walk(ast.Module([*stmt.body, *(s for h in stmt.handlers for s in h.body)], [])):
            for target in getattr(node, "targets", ()):
                if isinstance(target, ast.Name):
                    out[target.id] = imported[0]
    return out


class _Constructors(ast.NodeVisitor):
    """Raises and asserts in __init__/__post_init__ under a condition reading a field."""

    def __init__(self, module: str, path: str, fields: set[str]):
        self.module, self.path, self.fields = module, path, fields
        self.scope: list[str] = []
        self.conditions: list[ast.expr] = []
        self.found: list[tuple[str, ast.AST, str]] = []  # field, node, its conditions
        self.under: dict[int, ast.Module] = {}  # id(node) -> its conditions, for the flags they read

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved = self.conditions
        self.scope.append(node.name)
        self.conditions = []
        self.generic_visit(node)
        self.scope.pop()
        self.conditions = saved

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self.conditions.append(node.test)
        for stmt in node.body:
            self.visit(stmt)
        self.conditions.pop()
        self.conditions.append(ast.UnaryOp(ast.Not(), node.test))
        for stmt in node.orelse:
            self.visit(stmt)
        self.conditions.pop()

    def _record(self, node: ast.AST, own: ast.expr | None) -> None:
        if not self.scope or self.scope[-1] not in CONSTRUCTORS:
            return
        for name in sorted(self.fields):
            tests = [c for c in self.conditions if _reads(c, {name})]
            if own is not None and _reads(own, {name}):
                tests.append(own)
            if tests:
                self.found.append((name, node, _condition(self.conditions, own, name)))
                parts = [*self.conditions, *([own] if own is not None else [])]
                self.under[id(node)] = ast.Module([ast.Expr(c) for c in parts], [])

    def visit_Raise(self, node: ast.Raise) -> None:
        self._record(node, None)

    def visit_Assert(self, node: ast.Assert) -> None:
        self._record(node, node.test)


def _condition(conditions: list[ast.expr], own: ast.expr | None, name: str) -> str:
    """Every condition the check sits under, outermost first, then the assert's own test."""
    parts = [*conditions, *([own] if own is not None else [])]
    return " and ".join(f"({ast.unparse(c)})" for c in parts)


def _keyword_aliases(trees: Mapping[Path, ast.Module], field_name: str) -> set[str]:
    """Keywords a call passes the field as (`scaled_masked_softmax_fusion=config.masked_softmax_fusion`)."""
    out = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg and node.arg != field_name:
                if _reads(node.value, {field_name}):
                    out.add(node.arg)
    return out


def _function_imports(tree: ast.Module, names: set[str]) -> set[str]:
    """Extension modules imported inside a function: of a function reading `names`, or of any
    function when the module reads `names` as its own attribute (`self.<name>`)."""
    whole = any(
        isinstance(n, ast.Attribute)
        and n.attr in names
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        for n in ast.walk(tree)
    )
    out = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        if not (whole or _reads(fn, names)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if _extension(a.name)}
            elif isinstance(node, ast.ImportFrom) and not node.level and _extension(node.module or ""):
                out.add(node.module or "")
    return out


def scan(megatron_core: Path, fields: tuple[str, ...] | None = None) -> Scan:
    """megatron-core's constructor checks of each fusion field and the extension modules the
    fusion's code imports, for the package at `megatron_core` (the `megatron/core` folder)."""
    fields = fields or tuple(BY_FIELD)
    site = megatron_core.parents[1]
    trees: dict[Path, ast.Module] = {}
    for path in sorted(megatron_core.rglob("*.py")):
        try:
            trees[path] = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue
    checks: list[Check] = []
    modules: dict[str, set[str]] = {f: set() for f in fields}
    aliases = {f: _keyword_aliases(trees, f) for f in fields}
    for path, tree in trees.items():
        module, shown = _module_name(path, site), path.relative_to(site).as_posix()
        visitor = _Constructors(module, shown, set(fields))
        visitor.visit(tree)
        guarded = _guarded_imports(tree)
        node_conditions = visitor.under
        for name, node, condition in visitor.found:
            where = _qualified(tree, node)
            checks.append(Check(name, module, where, shown, node.lineno, condition))
            flags = {n.id for n in ast.walk(node_conditions[id(node)]) if isinstance(n, ast.Name)}
            modules[name] |= {guarded[f] for f in flags if f in guarded and _extension(guarded[f])}
        for name in fields:
            modules[name] |= _function_imports(tree, {name} | aliases[name])
    return Scan(tuple(checks), {f: tuple(sorted(m)) for f, m in modules.items()})


def _qualified(tree: ast.Module, target: ast.AST) -> str:
    """Class.function enclosing `target`."""

    def find(node: ast.AST, scope: list[str]) -> list[str] | None:
        for child in ast.iter_child_nodes(node):
            inner = [*scope, child.name] if isinstance(child, ast.ClassDef | ast.FunctionDef) else scope
            if child is target:
                return inner
            found = find(child, inner)
            if found is not None:
                return found
        return None

    return ".".join(find(tree, []) or ["<module>"])


def unanswered(result: Scan) -> list[Check]:
    """The constructor checks miles' table does not answer."""
    return [c for c in result.checks if c.key not in BY_FIELD[c.field].answers]
