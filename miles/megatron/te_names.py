"""Names megatron-core binds only when Transformer Engine imports, and every place it reads them.

megatron-core imports Transformer Engine inside module-level `try:` blocks (and binds more
names under `if HAVE_TE...` / `is_te_min_version(...)` branches). A name bound there and not
in the `except` / `else` branch does not exist when TE is absent; reading it raises
NameError, importing it from another module raises ImportError. `scan()` finds, with the
standard library's `ast` alone, every such name of an installed megatron-core and every read
or import of it, with the conditions it sits under (enclosing `if` tests, the earlier
operands of an `and`/`or`, and `assert`s or `if ...: raise` before it in the same block).

`unhandled()` is what remains once the reads megatron-core itself guards (the condition names
TE, or a `None` check of a name miles binds to None without TE: `compat.MISSING_SYMBOLS`) and
the functions no miles flag reaches (`UNREACHED`, each with its reason) are set aside:
tests/unit/test_megatron_te_only_names.py requires it to be empty for the installed release.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TE_IMPORTS = ("transformer_engine", "megatron.core.extensions.transformer_engine")
# Condition text under which megatron-core only runs with TE: its own import flags and
# version checks, and the config switches that select TE code (each is refused by miles
# without TE, or never set: fp8/fp4 training, TE's op fuser, the TE spec itself).
TE_GUARDS = (
    "HAVE_TE", "is_te_min_version", "use_transformer_engine", "use_te", "transformer_impl",
    "fp8", "fp4", "te_rng_tracker", "use_kitchen", "HAVE_APEX_OR_TE",
)  # fmt: skip

# Reads of a TE-only name without a guard that no miles command reaches, keyed
# "module:Qualified.function name", each with the reason.
UNREACHED: Mapping[str, str] = {
    "megatron.core.transformer.attention:Attention.forward apply_fused_qkv_rotary_pos_emb": (
        "runs only when split_qkv is False, which Attention.forward forces to True unless "
        "HAVE_FUSED_QKV_ROPE (TE's fused rotary kernel imported)"
    ),
    "megatron.core.models.multimodal.llava_model:LLaVAModel.__init__ TEDotProductAttention": (
        "the LLaVA multimodal model; miles builds GPTModel only"
    ),
    "megatron.core.models.multimodal.llava_model:LLaVAModel.__init__ is_te_min_version": (
        "the LLaVA multimodal model; miles builds GPTModel only"
    ),
    "megatron.core.models.multimodal.llava_model:LLaVAModel._process_embedding_token_parallel HAVE_TEX": (
        "the LLaVA multimodal model; miles builds GPTModel only"
    ),
    "megatron.core.tensor_parallel.inference_layers:_te_rms_norm_kernel tex": (
        "the inference-optimized layers (transformer_impl='inference_optimized'), subclasses of TE's; "
        "miles builds transformer_engine or local"
    ),
    "megatron.core.tensor_parallel.inference_layers:_te_rms_norm_kernel TE_DType": (
        "the inference-optimized layers (transformer_impl='inference_optimized'), subclasses of TE's; "
        "miles builds transformer_engine or local"
    ),
    "megatron.core.transformer.cuda_graphs:_CudagraphGlobalRecord.create_cudagraphs te_set_capture_start": (
        "CUDA graphs of TE modules (cuda_graph_impl); miles passes no CUDA-graph flag to megatron-core"
    ),
    "megatron.core.transformer.cuda_graphs:_CudagraphGlobalRecord.create_cudagraphs te_set_capture_end": (
        "CUDA graphs of TE modules (cuda_graph_impl); miles passes no CUDA-graph flag to megatron-core"
    ),
    "megatron.core.transformer.cuda_graphs:TECudaGraphHelper.create_cudagraphs make_graphed_callables": (
        "TE's CUDA graphs (cuda_graph_impl='transformer_engine'); miles passes no CUDA-graph flag"
    ),
    "megatron.core.fp8_utils:_get_custom_recipe transformer_engine": (
        "a custom fp8 training recipe; miles has no fp8 training flag"
    ),
    "megatron.core.tensor_parallel.inference_layers:InferenceLayerNormColumnParallelLinear._all_gather "
    "gather_along_first_dim": (
        "the inference-optimized layers (transformer_impl='inference_optimized'), subclasses of TE's; "
        "miles builds transformer_engine or local"
    ),
    "megatron.core.tensor_parallel.inference_layers:InferenceRowParallelLinear._matmul_reduce_scatter "
    "reduce_scatter_along_first_dim": (
        "the inference-optimized layers (transformer_impl='inference_optimized'), subclasses of TE's; "
        "miles builds transformer_engine or local"
    ),
}


@dataclass(frozen=True)
class Use:
    """One read (or cross-module import) of a TE-only name."""

    module: str  # dotted module that reads it
    path: str  # its file, relative to the site-packages folder
    line: int
    name: str
    owner: str  # the module that binds it (only with TE)
    function: str  # "module:Qualified.name" of the enclosing function, or "module:<module>"
    guards: tuple[str, ...]  # condition texts it runs under
    none_checked: bool = False  # the read is an operand of `is None` / `is not None`
    kind: str = "read"  # read | import

    @property
    def key(self) -> str:
        """How UNREACHED names it: "module:Qualified.function name"."""
        return f"{self.function} {self.name}"

    def __str__(self) -> str:
        what = "imports" if self.kind == "import" else "reads"
        under = f" under {' and '.join(self.guards)}" if self.guards else " unguarded"
        return f"{self.path}:{self.line}: {self.function.split(':')[1]} {what} {self.name}{under}"


def _bound(statements: Iterable[ast.stmt]) -> set[str]:
    """Names the statements bind at their own scope level (not inside functions or classes)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
            return
        if isinstance(node, ast.Lambda):
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for statement in statements:
        visit(statement)
    return out


def _imports_te(statements: Iterable[ast.stmt]) -> bool:
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.Import) and any(a.name.startswith(TE_IMPORTS[0]) for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(TE_IMPORTS):
                return True
    return False


def _te_branch(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return "HAVE_TE" in text or "is_te_min_version" in text


def te_only_names(tree: ast.Module) -> tuple[dict[str, int], set[int]]:
    """(TE-only name -> line of the block binding it, ids of those top-level blocks)."""
    only: dict[str, int] = {}
    blocks: set[int] = set()
    for statement in tree.body:
        if isinstance(statement, ast.Try) and _imports_te(statement.body):
            fallback = _bound(s for h in statement.handlers for s in h.body)
            for name in (_bound(statement.body) | _bound(statement.orelse)) - fallback:
                only[name] = statement.lineno
            blocks.add(id(statement))
        elif isinstance(statement, ast.If) and _te_branch(statement.test):
            for name in _bound(statement.body) - _bound(statement.orelse):
                only[name] = statement.lineno
            blocks.add(id(statement))
    elsewhere = _bound(s for s in tree.body if id(s) not in blocks)
    return {k: v for k, v in only.items() if k not in elsewhere}, blocks


def _locals(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    a = fn.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    if isinstance(fn, ast.Lambda):
        return names
    names |= _bound(fn.body)
    declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global | ast.Nonlocal) for n in node.names}
    return names - declared


def _stops(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Raise | ast.Return)


class _Reads(ast.NodeVisitor):
    def __init__(self, module: str, path: str, names: Mapping[str, str]):
        self.module, self.path, self.names = module, path, names  # name -> owner module
        self.shadow: set[str] = set()
        self.guards: list[str] = []
        self.scope: list[str] = []
        self.none_checked: set[int] = set()
        self.found: list[Use] = []

    def _function(self) -> str:
        return f"{self.module}:{'.'.join(self.scope) or '<module>'}"

    def _block(self, statements: list[ast.stmt]) -> None:
        """Statements in order; an `assert X` or `if X: raise/return` guards the ones after it."""
        depth = len(self.guards)
        for statement in statements:
            self.visit(statement)
            if isinstance(statement, ast.Assert):
                self.guards.append(ast.unparse(statement.test))
            elif isinstance(statement, ast.If) and _stops(statement.body) and not statement.orelse:
                self.guards.append(f"not ({ast.unparse(statement.test)})")
        del self.guards[depth:]

    def _scoped(self, node, name: str | None, body: list[ast.stmt], shadow: set[str]) -> None:
        saved = (self.shadow, self.guards)
        self.shadow, self.guards = self.shadow | shadow, list(self.guards)
        if name:
            self.scope.append(name)
        self._block(body)
        if name:
            self.scope.pop()
        self.shadow, self.guards = saved

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in (*node.decorator_list, *node.args.defaults, *node.args.kw_defaults):
            if expr is not None:
                self.visit(expr)
        self._scoped(node, node.name, node.body, _locals(node))

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in (*node.decorator_list, *node.bases):
            self.visit(expr)
        # class-level names do not shadow inside its methods (Python's scoping)
        self._scoped(node, node.name, node.body, set())

    def visit_Lambda(self, node: ast.Lambda) -> None:
        saved = self.shadow
        self.shadow = self.shadow | _locals(node)
        self.visit(node.body)
        self.shadow = saved

    def _branch(self, test: ast.expr, body, orelse) -> None:
        self.visit(test)
        text = ast.unparse(test)
        for guard, part in ((text, body), (f"not ({text})", orelse)):
            self.guards.append(guard)
            if isinstance(part, list):
                self._block(part)
            else:
                self.visit(part)
            self.guards.pop()

    def visit_If(self, node: ast.If) -> None:
        self._branch(node.test, node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._branch(node.test, node.body, node.orelse)

    def visit_While(self, node: ast.While) -> None:
        self._branch(node.test, node.body, node.orelse)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        negate = isinstance(node.op, ast.Or)  # a later operand of `or` runs only when the earlier are false
        for i, value in enumerate(node.values):
            earlier = [ast.unparse(v) for v in node.values[:i]]
            self.guards += [f"not ({t})" if negate else t for t in earlier]
            self.visit(value)
            del self.guards[len(self.guards) - len(earlier) :]

    def visit_Compare(self, node: ast.Compare) -> None:
        if (
            isinstance(node.left, ast.Name)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Is | ast.IsNot)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value is None
        ):
            self.none_checked.add(id(node.left))
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
            self._block(part)

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            self.visit(item)
        self._block(node.body)

    visit_AsyncWith = visit_With

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self._block(node.body)
        self._block(node.orelse)

    visit_AsyncFor = visit_For

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and node.id in self.names and node.id not in self.shadow:
            self.found.append(
                Use(
                    self.module, self.path, node.lineno, node.id, self.names[node.id], self._function(),
                    tuple(self.guards), id(node) in self.none_checked,
                )
            )  # fmt: skip


def _module_name(path: Path, site: Path) -> str:
    return ".".join(path.relative_to(site).with_suffix("").parts).removesuffix(".__init__")


def _catches_import_error(node: ast.Try) -> bool:
    return any(
        h.type is None or any(k in ast.unparse(h.type) for k in ("ImportError", "Exception"))
        for h in node.handlers
    )


def scan(megatron_core: Path) -> tuple[dict[str, dict[str, int]], list[Use]]:
    """(module -> {TE-only name: line}, every read or cross-module import of one) for the
    megatron-core package at `megatron_core` (the `megatron/core` folder)."""
    site = megatron_core.parents[1]
    trees = {}
    for path in sorted(megatron_core.rglob("*.py")):
        try:
            trees[path] = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:
            continue
    only: dict[str, dict[str, int]] = {}
    blocks_of: dict[Path, set[int]] = {}
    for path, tree in trees.items():
        names, blocks = te_only_names(tree)
        blocks_of[path] = blocks
        if names:
            only[_module_name(path, site)] = names
    uses: list[Use] = []
    for path, tree in trees.items():
        module, shown = _module_name(path, site), path.relative_to(site).as_posix()
        own = {name: module for name in only.get(module, {})}
        if own:
            visitor = _Reads(module, shown, own)
            for statement in tree.body:
                if id(statement) not in blocks_of[path]:
                    visitor.visit(statement)
            uses += visitor.found
        uses += _imports(tree, module, shown, only)
    return only, uses


def _imports(tree: ast.Module, module: str, shown: str, only: Mapping[str, Mapping[str, int]]) -> list[Use]:
    """`from <module> import <TE-only name>` outside a try that catches ImportError."""
    protected: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and _catches_import_error(node):
            protected |= {id(x) for statement in node.body for x in ast.walk(statement)}
    out = []
    scopes = _function_of(tree, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in only and id(node) not in protected:
            for alias in node.names:
                if alias.name in only[node.module]:
                    out.append(
                        Use(module, shown, node.lineno, alias.name, node.module, scopes.get(id(node), f"{module}:<module>"),
                            (), kind="import")
                    )  # fmt: skip
    return out


def _function_of(tree: ast.Module, module: str) -> dict[int, str]:
    """id(node) -> "module:Qualified.name" of its innermost function or class."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = [*scope, node.name]
        for child in ast.iter_child_nodes(node):
            out[id(child)] = f"{module}:{'.'.join(scope) or '<module>'}"
            visit(child, scope)

    visit(tree, [])
    return out


def handled(use: Use, fallbacks: Mapping[str, Iterable[str]]) -> bool:
    """Whether the use is safe without TE: guarded by TE's own conditions, a None check of a name
    miles binds to None (`fallbacks`: module -> names), or in a function no miles flag reaches."""
    bound = use.name in set(fallbacks.get(use.owner, ()))
    if use.kind == "import":
        return bound or use.key in UNREACHED
    if use.key in UNREACHED:
        return True
    if any(marker in guard for guard in use.guards for marker in TE_GUARDS):
        return True
    if bound and (use.none_checked or any(f"{use.name} is not None" in g for g in use.guards)):
        return True
    return False


def unhandled(megatron_core: Path, fallbacks: Mapping[str, Iterable[str]]) -> list[Use]:
    """Every use of a TE-only name of the installed megatron-core that `handled` does not accept."""
    _, uses = scan(megatron_core)
    return [use for use in uses if not handled(use, fallbacks)]


def installed_megatron_core() -> Path:
    """The `megatron/core` folder of the installed megatron-core (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("megatron-core is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "core"
