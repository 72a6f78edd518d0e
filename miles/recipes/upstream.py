"""Read the command the seed framework's launcher passes to its trainer, from its source at a commit.

A reference recipe (miles/recipes/references/) quotes radixark/miles's command for one
configuration of one launcher script (`Upstream`: script, commit, entry function, the
ScriptArgs fields as its command line would set them, the hardware they describe).
`read_launch(mirror, source)` reads that command again from a local mirror of the
repository: the launcher script, the launcher library it calls
(`command_utils.execute_train`), the model script it loads and whatever they import from
the repository are evaluated as data by `miles.recipes.pysource` at the cited commit.
Nothing is imported or executed. The launcher's side effects are modelled, each in one
place below: shell commands are recorded (the last `ray job submit` is the job), the
NVLink probe answers what the reading's hardware has, `os.environ` starts as the reading's
declared environment, files do not exist, `create_run_id()` is `{run_id}`, starting a Mooncake
master does nothing, and a model script is loaded where the launcher would import it.

The job's environment is the runtime environment the launcher hands Ray, less the
variables that say where this checkout and the Ray head are (`MACHINE_ENV`), plus what the
script itself writes to os.environ before it starts Ray (Ray's processes inherit it).
"""

from __future__ import annotations

import ast
import base64
import json
import posixpath
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.recipes.pysource import Evaluator, Module, Namespace, SourceError, parse

UPSTREAM_REPO = "radixark/miles"
LAUNCHER = "miles/utils/external_utils/command_utils.py"
MODEL_ARGS_UTILS = "miles/utils/external_utils/model_args_utils.py"
MODEL_SCRIPTS = "scripts/models"
REPO_ROOT = "{repo}"  # where the launcher's checkout is, as the readings write it
# Where the launcher's checkout and the Ray head are: not facts of a recipe.
MACHINE_ENV = ("PYTHONPATH", "MASTER_ADDR", "no_proxy")
MAX_SOURCE_CHARS = 4 << 20  # the launchers and model scripts are a few KB each


class MirrorError(ValueError):
    """The mirror lacks the cited commit or file, or is not a git repository."""


@dataclass(frozen=True)
class Upstream:
    """How one reference command is read: which launcher, at which commit, configured how."""

    script: str  # path in the repository, e.g. scripts/run_qwen3_4b.py
    commit: str  # 40 hex digits, on the repository's main branch
    entry: str  # the function that builds and submits the command (execute, _train, ...)
    settings: tuple[tuple[str, Any], ...]  # ScriptArgs fields as its command line sets them
    hardware: str  # what the settings describe, in words ("one node of 8 H200s")
    nvlink: bool  # the answer the launcher's NVLink probe (nvidia-smi topo) gets there
    environ: tuple[tuple[str, str], ...] = ()  # the launching shell's variables the script reads
    repo: str = UPSTREAM_REPO

    def cite(self) -> str:
        return f"{self.repo} {self.script}@{self.commit[:12]}"

    def command_line(self) -> str:
        """The reading as its launcher's own flags, e.g. `_train() of scripts/run_x.py with --num-nodes 1`."""
        parts = []
        for name, value in self.settings:
            flag = "--" + name.replace("_", "-")
            if value is True:
                parts.append(flag)
            elif value is False:
                parts.append("--no-" + name.replace("_", "-"))
            else:
                parts.append(f"{flag} {value}")
        environ = "".join(f"{k}={v} " for k, v in self.environ)
        return f"{environ}{self.entry}() of {self.script} with {' '.join(parts) or 'its defaults'}"


@dataclass(frozen=True)
class Launch:
    """What the launcher runs: the trainer's argv (model flags first) and the job's variables."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


class Mirror:
    """A local git repository (bare or not) holding the upstream history."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.exists():
            raise MirrorError(
                f"{self.path}: no such directory; give the path of a git mirror of {UPSTREAM_REPO}"
            )
        self._git("rev-parse", "--git-dir")

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["git", "-C", str(self.path), *args], capture_output=True, text=True, timeout=120, check=False
        )
        if check and done.returncode:
            raise MirrorError(f"{self.path}: git {' '.join(args)}: {done.stderr.strip() or done.returncode}")
        return done

    def commit(self, rev: str) -> str | None:
        """The full sha of `rev`, or None when the mirror does not have it."""
        done = self._git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
        return done.stdout.strip() or None

    def on_branch(self, commit: str, branch: str) -> bool:
        if self.commit(branch) is None:
            raise MirrorError(f"{self.path}: has no branch {branch}")
        return self._git("merge-base", "--is-ancestor", commit, branch, check=False).returncode == 0

    def show(self, commit: str, path: str) -> str | None:
        done = self._git("show", f"{commit}:{path}", check=False)
        return done.stdout if done.returncode == 0 else None


class _Path:
    """pathlib.Path on the reading machine: names compose, nothing exists there."""

    PUBLIC = (
        "exists",
        "is_file",
        "is_dir",
        "resolve",
        "parent",
        "parents",
        "name",
        "stem",
        "suffix",
        "read_text",
    )

    def __init__(self, *parts: object):
        self.text = posixpath.join(*(str(p) for p in parts)) if parts else "."

    def __truediv__(self, other: object) -> _Path:
        return _Path(self.text, other)

    def __str__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Path) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def exists(self) -> bool:
        return False

    is_file = is_dir = exists

    def resolve(self) -> _Path:
        return self

    @property
    def parent(self) -> _Path:
        return _Path(posixpath.dirname(self.text))

    @property
    def parents(self) -> tuple[_Path, ...]:
        out, path = [], self.parent
        while path.text not in ("", "/", "."):
            out.append(path)
            path = path.parent
        return tuple(out)

    @property
    def name(self) -> str:
        return posixpath.basename(self.text)

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    def read_text(self) -> str:
        raise FileNotFoundError(self.text)


class _Environ(dict):
    """os.environ of the launching process; remembers what the script writes."""

    def __init__(self, initial: dict[str, str]):
        super().__init__(initial)
        self.written: dict[str, str] = {}

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        self.written[key] = value

    def setdefault(self, key: str, value: str | None = None):
        if key not in self:
            self[key] = value
        return self[key]

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class _Reading:
    """One evaluation of a launcher at a commit."""

    def __init__(self, mirror: Mirror, source: Upstream):
        self.mirror, self.source = mirror, source
        self.environ = _Environ(dict(source.environ))
        self.commands: list[str] = []
        self.modules: dict[str, Module] = {}
        self.evaluator = Evaluator(self.importer)
        self.namespaces = self._namespaces()

    def _namespaces(self) -> dict[str, Namespace]:
        env = self.environ
        path = Namespace(
            "os.path",
            {
                "isabs": lambda p: str(p).startswith(("/", REPO_ROOT)), "abspath": str, "join": posixpath.join,
                "dirname": posixpath.dirname, "basename": posixpath.basename, "exists": lambda p: False,
                "expanduser": str,
            },
        )  # fmt: skip
        record = Namespace("exec_command", {n: self._record for n in ("exec_command_cpu", "exec_command_gpu",
                                                                       "exec_command_multi_node", "exec_command")})  # fmt: skip
        return {
            "os": Namespace(
                "os", {"environ": env, "getenv": env.get, "path": path, "pathsep": ":", "sep": "/"}
            ),
            "re": Namespace(
                "re", {n: getattr(re, n) for n in ("search", "match", "fullmatch", "sub", "findall")}
            ),
            "json": Namespace("json", {"dumps": json.dumps, "loads": json.loads}),
            "shlex": Namespace("shlex", {"quote": shlex.quote, "split": shlex.split, "join": shlex.join}),
            "base64": Namespace("base64", {"b64encode": base64.b64encode}),
            "pathlib": Namespace("pathlib", {"Path": _Path}),
            "miles.utils.external_utils.exec_command": record,
        }

    def _record(self, command: str, *args, **kwargs) -> str:
        self.commands.append(str(command))
        return ""

    def read(self, path: str, natives: dict[str, Any] | None = None) -> Module:
        if path not in self.modules:
            text = self.mirror.show(self.source.commit, path)
            if text is None:
                raise MirrorError(f"{self.mirror.path}: {path} is not in commit {self.source.commit[:12]}")
            if len(text) > MAX_SOURCE_CHARS:
                raise SourceError(
                    f"{path}: {len(text)} characters, over the {MAX_SOURCE_CHARS} a launcher file has"
                )
            self.modules[path] = parse(path, text, natives)
        return self.modules[path]

    def importer(self, name: str) -> Module | Namespace:
        if name in self.namespaces:
            return self.namespaces[name]
        if name == "model_args_utils":  # the name the launcher registers it under for model scripts
            name = MODEL_ARGS_UTILS.removesuffix(".py").replace("/", ".")
        path = name.replace(".", "/")
        natives = self._natives(path + ".py")
        for candidate in (f"{path}.py", f"{path}/__init__.py"):
            if self.mirror.show(self.source.commit, candidate) is not None:
                return self.read(candidate, natives)
        return Namespace(name, {})  # a package this reading never uses (typer, typing, ...)

    def _natives(self, path: str) -> dict[str, Any]:
        """The launcher functions that touch the machine, answered as the reading's hardware would."""
        if path == LAUNCHER:
            return {
                "check_has_nvlink": lambda: self.source.nvlink,
                "create_run_id": lambda: "{run_id}",
                "repo_base_dir": _Path(REPO_ROOT),
                # the hook a Mooncake test runs before submitting: it starts a store on the machine and
                # changes nothing of the command
                "start_mooncake_master": lambda *args, **kwargs: None,
            }
        if path == MODEL_ARGS_UTILS:
            return {"load_model_args": self.load_model_args}
        return {}

    def load_model_args(self, model_type: str, model_script_dir: object = None, **kwargs: object) -> str:
        """What the launcher's load_model_args does: import scripts/models/<type>.py and call its
        model_args(**kwargs), collapsed to one line."""
        folder = MODEL_SCRIPTS if model_script_dir is None else str(model_script_dir)
        folder = folder.removeprefix(REPO_ROOT + "/")
        module = self.read(f"{folder}/{model_type}.py")
        module.natives.setdefault("__file__", f"{REPO_ROOT}/{folder}/{model_type}.py")
        text = self.evaluator.call(self.evaluator.lookup(module, "model_args", module.tree), [], dict(kwargs))
        return " ".join(str(text).split())

    def launch(self) -> Launch:
        with self.evaluator.bounded(self.source.cite()):  # a crafted launcher ends in one line
            script = self.read(self.source.script)
            script.natives.setdefault("__file__", f"{REPO_ROOT}/{self.source.script}")
            if self.source.entry == "__main__":  # a test file run as a script: its main block
                if self.source.settings:
                    raise SourceError(f"{self.source.script}: a main block takes no settings")
                self.evaluator.block(script, {}, _main_block(script, self.source.script))
                return self._job()
            entry = self.evaluator.lookup(script, self.source.entry, script.tree)
            if not _defines(script, "ScriptArgs"):  # a test file: its entry reads the module's own constants
                if self.source.settings:
                    raise SourceError(
                        f"{self.source.script}: no ScriptArgs to take the settings {dict(self.source.settings)}"
                    )
                self.evaluator.call(entry, [], {})
                return self._job()
            config = self.evaluator.lookup(script, "ScriptArgs", script.tree)
            args = self.evaluator.instantiate(config, dict(self.source.settings))
            self.evaluator.call(entry, [args], {})
        return self._job()

    def _job(self) -> Launch:
        submits = [c for c in self.commands if "ray job submit" in c]
        if not submits:
            raise SourceError(
                f"{self.source.script}: {self.source.entry}() submitted no `ray job submit` command "
                f"(it ran: {'; '.join(c[:60] for c in self.commands) or 'nothing'})"
            )
        tokens = shlex.split(submits[-1])
        env_json = next((t.partition("=")[2] for t in tokens if t.startswith("--runtime-env-json=")), None)
        if env_json is None or "--" not in tokens:
            raise SourceError(f"{self.source.script}: the job command has no --runtime-env-json or no `--`")
        job = tokens[tokens.index("--") + 1 :]
        argv = tuple(job[2:])  # after `python3 <train script>`
        env = {k: str(v) for k, v in json.loads(env_json)["env_vars"].items() if k not in MACHINE_ENV}
        for key, value in self.environ.written.items():
            env.setdefault(key, str(value))
        return Launch(argv, tuple(sorted(env.items())))


def _defines(module: Module, name: str) -> bool:
    return any(isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == name for n in module.tree.body)


def read_launch(mirror: Mirror, source: Upstream) -> Launch:
    """The trainer argv and job environment `source`'s launcher produces at its commit."""
    if mirror.commit(source.commit) is None:
        raise MirrorError(f"{mirror.path}: has no commit {source.commit}")
    return _Reading(mirror, source).launch()


def _main_block(module: Module, script: str) -> list[ast.stmt]:
    """The body of the module's `if __name__ == "__main__":` (the entry "__main__")."""
    for node in module.tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and [getattr(c, "value", None) for c in test.comparators] == ["__main__"]
        ):
            return node.body
    raise SourceError(f'{script}: no `if __name__ == "__main__":` block to run')
