"""Run a CheckpointPlan: fetch, validate, trim, fp8, torch_dist, stage, each at most once.

Every step that writes does so through `atomic_dir` (temp sibling, manifest last, rename),
and records a fingerprint of its input. A rerun skips a step whose output's manifest
matches its current input and redoes one whose input changed or that was interrupted;
a downstream step sees the change through its input's fingerprint. One run per plan at a
time (a lock beside the model dir); `dry=True` reports what would run and touches nothing.

Directories (DESIGN.md): <model_dir>/<model_name> (HF), <model_name>_fp8,
<model_name>_torch_dist, and <model_dir>/.miles-ckpt/ for locks and validation records.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from miles import phases
from miles.ckpt.datasets import fetch_for_plan
from miles.ckpt.errors import (
    CheckpointError,
    StepFailed,
    describe_os_error,
    free_space_at_failure,
    os_error_in,
)
from miles.ckpt.families import layers_in_name, num_layers
from miles.ckpt.hub import Source, materialize, parse_source, resolve_hub, resolve_local
from miles.ckpt.manifest import (
    HF_STEPS,
    MANIFEST_NAME,
    Manifest,
    atomic_dir,
    clean_stale,
    fingerprint,
    json_safe,
    plan_lock,
    read_manifest,
    write_manifest,
)
from miles.ckpt.plan import STEPS, CheckpointPlan
from miles.ckpt.progress import Progress, say
from miles.ckpt.shards import MAX_JSON_BYTES, read_json_file
from miles.ckpt.tiny import DEFAULT_SHARD_BYTES, TINY_STEP, make_tiny_checkpoint, tiny_params
from miles.ckpt.verify import file_problems
from miles.files import FileRefused, overlap, read_regular, refuse_overlap, replace_file

STATE_DIR = ".miles-ckpt"
DEFAULT_TINY_LAYERS = 4


@dataclass(frozen=True)
class StepResult:
    step: str
    status: str  # "ran" | "skipped" | "not applicable" | "would run"
    detail: str = ""
    output: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class PrepareResult:
    plan: CheckpointPlan
    steps: tuple[StepResult, ...] = field(default_factory=tuple)

    @property
    def ran(self) -> tuple[str, ...]:
        return tuple(s.step for s in self.steps if s.status == "ran")

    def table(self) -> str:
        width = max(len(s) for s in STEPS)
        lines = [f"{self.plan.model_name} ({self.plan.family}, source {self.plan.source})"]
        for s in self.steps:
            where = f" -> {s.output}" if s.output else ""
            took = f" [{s.seconds:.1f}s]" if s.status == "ran" else ""
            lines.append(f"  {s.step:<{width}}  {s.status:<14} {s.detail}{where}{took}".rstrip())
        return "\n".join(lines)


def prepare(
    plan: CheckpointPlan,
    *,
    steps: Sequence[str] | None = None,
    dry: bool = False,
    progress: bool = True,
    workers: int | None = None,
    scan_fraction: float = 1.0,
    tiny_cache: str | Path | None = None,
) -> PrepareResult:
    """Run the plan's steps (or the subset `steps`, which must belong to the plan) in order.

    scan_fraction: share of every float tensor validate reads for NaN/Inf (1 = all, 0 = none).
    tiny_cache: for a tiny source, a cache folder (miles.ckpt.tiny_cache) whose tiny checkpoint and
    torch_dist form the fetch and torch_dist steps copy instead of building them again.
    Every failure, a full or read-only disk included, is a StepFailed with a one-line message.
    """
    chosen = _chosen_steps(plan, steps)
    run = _Run(
        plan, dry=dry, progress=progress, workers=workers, scan_fraction=scan_fraction, tiny_cache=tiny_cache
    )
    run.check_model_dir()
    if dry:
        return PrepareResult(plan, tuple(run.step(step) for step in chosen))
    with phases.phase(phases.CHECKPOINT):
        return _run_locked(plan, chosen, run)


def _run_locked(plan: CheckpointPlan, chosen: list[str], run: _Run) -> PrepareResult:
    lock = run.state / f"{plan.model_name}.lock"
    try:
        held = plan_lock(lock)
        held.__enter__()
    except OSError as exc:
        return _without_lock(plan, chosen, run, exc)
    try:
        for path in (run.hf, run.fp8, run.torch_dist):
            clean_stale(path)
        return PrepareResult(plan, tuple(run.step(step) for step in chosen))
    finally:
        held.__exit__(None, None, None)


def _without_lock(plan: CheckpointPlan, chosen: list[str], run: _Run, exc: OSError) -> PrepareResult:
    """The lock cannot even be created (a read-only or foreign model dir): a plan whose steps
    are all done still answers, since nothing needs writing; anything else stops in one line."""
    looked = _Run(plan, dry=True, progress=False, workers=run.workers, scan_fraction=run.scan_fraction)
    results = tuple(looked.step(step) for step in chosen)
    pending = [r.step for r in results if r.status not in ("skipped", "not applicable")]
    if not pending:
        return PrepareResult(plan, results)
    raise StepFailed(
        f"{', '.join(pending)} of {plan.model_name} cannot run: {describe_os_error(exc, run.state)}"
    ) from exc


def _chosen_steps(plan: CheckpointPlan, steps: Sequence[str] | None) -> list[str]:
    if steps is None:
        return list(plan.steps)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise CheckpointError(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}")
    outside = [s for s in steps if s not in plan.steps]
    if outside:
        raise CheckpointError(
            f"step(s) {outside} do not apply to {plan.model_name}; its plan has {', '.join(plan.steps)}"
        )
    return [s for s in plan.steps if s in steps]


class _Run:
    def __init__(
        self,
        plan: CheckpointPlan,
        *,
        dry: bool,
        progress: bool,
        workers,
        scan_fraction: float = 1.0,
        tiny_cache: str | Path | None = None,
    ):
        self.plan = plan
        self.dry = dry
        self.show = progress
        self.workers = workers
        self.scan_fraction = scan_fraction
        self.hf = Path(plan.hf_dir)
        self.fp8 = Path(plan.fp8_dir)
        self.torch_dist = Path(plan.torch_dist_dir)
        self.state = Path(plan.model_dir) / STATE_DIR
        self.source: Source = parse_source(plan.source)
        self.layers = plan.num_layers or layers_in_name(plan.model_name)
        self._source_dir: Path | None = None
        self._downloaded = False
        self.tiny_cache = None if tiny_cache is None else Path(tiny_cache)

    # -- helpers -------------------------------------------------------------------------

    def check_model_dir(self) -> None:
        """Before anything is written (the plan's lock included): the model's folders must not lie
        inside a local source (the source may be the HF folder itself: then nothing is fetched)."""
        if self.source.kind != "local":
            return
        src = Path(self.source.value)
        how = overlap(self.hf, src)
        if how in ("lies inside", "contains"):
            raise StepFailed(
                f"fetch of {self.plan.model_name}: its output {self.hf} {how} the input {src}; writing it would "
                "change the source it reads: choose a --model-dir outside the source"
            )

    def _with_progress(self, label: str, fn: Callable, *args, **kwargs):
        """Call fn(*args, progress=...) with a progress line closed when it returns."""
        with Progress(f"{label} {self.plan.model_name}", 0, 0, enabled=self.show) as progress:
            return fn(*args, progress=progress, **kwargs)

    def source_dir(self, download: bool = True) -> Path | None:
        """The fetched checkpoint before any trim (the HF dir itself for tiny sources)."""
        if self._source_dir is None:
            if self.source.kind == "tiny":
                self._source_dir = self.hf
            elif self.source.kind == "local":
                self._source_dir = resolve_local(self.source)
            else:
                keep = self.layers if "trim" in self.plan.steps else None
                self._source_dir, self._downloaded = resolve_hub(
                    self.source, keep_layers=keep, download=download and not self.dry
                )
        return self._source_dir

    def trim_applies(self, src: Path | None) -> bool:
        if (
            "trim" not in self.plan.steps
            or self.layers is None
            or src is None
            or not (src / "config.json").is_file()
        ):
            return False
        total = num_layers(read_json_file(src / "config.json"))
        return total is not None and total > self.layers

    def writes(self, step: str) -> Path:
        """Where `step` writes: its output dir (the validate step only records a result)."""
        return {
            "fetch": self.hf, "trim": self.hf, "validate": self.state, "fp8": self.fp8,
            "torch_dist": self.torch_dist, "stage": Path(self.plan.stage_dir or self.hf),
        }[step]  # fmt: skip

    def step(self, name: str) -> StepResult:
        start = time.monotonic()
        try:
            result = getattr(self, f"_{name}")()
            if name == "fetch" and self.plan.datasets:  # the recipe's prompt data, beside the model
                data = fetch_for_plan(
                    result.status, result.detail, self.plan.datasets, str(self.plan.data_dir), dry=self.dry
                )
                result = replace(result, **data)
        except StepFailed:
            raise
        except CheckpointError as exc:
            raise StepFailed(f"{name} of {self.plan.model_name}: {exc}") from exc
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # torch.distributed.checkpoint wraps I/O errors in a BaseException
            cause = os_error_in(exc)
            if cause is None:
                raise
            note = "nothing was marked done and the inputs are untouched"
            raise StepFailed(
                f"{name} of {self.plan.model_name}: "
                + describe_os_error(cause, self.writes(name), note=note, free=free_space_at_failure(exc))
            ) from exc
        if result.status == "ran":
            result = StepResult(
                result.step, result.status, result.detail, result.output, time.monotonic() - start
            )
        if self.show and not self.dry:
            say(f"[ckpt] {name}: {result.status} {result.detail}".rstrip())
        return result

    def _produce(
        self,
        step: str,
        out: Path,
        reads: Path,
        inputs: str,
        params: dict,
        make: Callable[[Path], dict | None],
        check: Callable[[Path], list[str]] | None = None,
    ):
        """Skip when `out` already holds this step's result for these inputs and its files are
        still the ones written (and pass `check`), else build it atomically from `reads`."""
        _separate(out, reads)
        damaged = self._damaged(out, step, inputs, params, check)
        if damaged is None:
            return StepResult(step, "skipped", "up to date, files verified", str(out))
        if self.dry:
            reason = damaged or ("missing" if read_manifest(out) is None else "inputs or parameters changed")
            return StepResult(step, "would run", reason, str(out))
        say(f"[ckpt] {step}: writing {out}" + (f" ({damaged})" if damaged else ""), self.show)
        replaces = HF_STEPS if out == self.hf else (step,)
        with atomic_dir(out, reads=[reads], replaces=replaces) as tmp:
            records = make(tmp)
            write_manifest(tmp, step, inputs, params, records)
        return StepResult(step, "ran", f"redone: {damaged}" if damaged else "", str(out))

    def _damaged(
        self,
        out: Path,
        step: str,
        inputs: str,
        params: dict,
        check: Callable[[Path], list[str]] | None = None,
    ) -> str | None:
        """None when `out` is this step's finished output with every file as its manifest records
        (and `check` finds nothing); "" when it is not finished; else what is wrong with it."""
        manifest = read_manifest(out)
        if manifest is None or (manifest.step, manifest.inputs, manifest.params) != (
            step,
            inputs,
            json_safe(params),
        ):
            return ""
        problems = file_problems(out, manifest) + (check(out) if check else [])
        return (
            f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}"
            if problems
            else None
        )

    def _need(self, path: Path, step: str) -> str:
        if not (path / "config.json").is_file():
            if self.dry:
                return "pending"
            raise StepFailed(
                f"{step} needs {path}, which does not exist yet; run the fetch (and trim) steps first"
            )
        return fingerprint(path)

    # -- steps ---------------------------------------------------------------------------

    def _fetch(self) -> StepResult:
        if self.source.kind == "tiny":
            layers = self.layers or DEFAULT_TINY_LAYERS
            params = tiny_params(self.source.value, layers, 0, "bfloat16", DEFAULT_SHARD_BYTES, {})
            damaged = self._damaged(self.hf, TINY_STEP, self.plan.source, params)
            if damaged is None:
                return StepResult(
                    "fetch", "skipped", "tiny checkpoint up to date, files verified", str(self.hf)
                )
            if self.dry:
                return StepResult(
                    "fetch",
                    "would run",
                    damaged or f"build a tiny {self.source.value} ({layers} layers)",
                    str(self.hf),
                )
            redone = f" (redone: {damaged})" if damaged else ""
            if self.tiny_cache is not None:
                from miles.ckpt.tiny_cache import tiny_checkpoint

                _copy_into(tiny_checkpoint(self.source.value, layers, root=self.tiny_cache).hf, self.hf)
                return StepResult(
                    "fetch", "ran", f"copied tiny {self.source.value} from the cache{redone}", str(self.hf)
                )
            make_tiny_checkpoint(self.source.value, layers, self.hf, progress=self.show)
            return StepResult("fetch", "ran", f"built tiny {self.source.value}{redone}", str(self.hf))
        src = self.source_dir()
        if src is None:
            return StepResult("fetch", "would run", f"download {self.source.value}", None)
        if self.trim_applies(src):
            status = "ran" if self._downloaded else "skipped"
            return StepResult(
                "fetch",
                status,
                "downloaded; trim reads it in place" if self._downloaded else "trim reads it in place",
                str(src),
            )
        if src.resolve() == self.hf.resolve():
            return StepResult("fetch", "skipped", "the source is the model dir", str(src))
        return self._produce(
            "fetch",
            self.hf,
            src,
            fingerprint(src),
            {},
            lambda tmp: self._with_progress("fetch", materialize, src, tmp),
        )

    def _validate(self) -> StepResult:
        from miles.ckpt.validate import validate_checkpoint

        src = self.source_dir(download=False) if self.source.kind != "tiny" else self.hf
        target = src if src is not None and self.trim_applies(src) else self.hf
        inputs = self._need(target, "validate")
        trimming = target != self.hf
        params = {
            "family": self.plan.family,
            "layers": self.layers,
            "trimming": trimming,
            "allow_auto_map": self.plan.allow_auto_map,
            "scan": self.scan_fraction,
        }
        record = self.state / f"{self.plan.model_name}.validate.json"
        old = _read_record(record)
        if old is not None and (old.inputs, old.params) == (inputs, json_safe(params)):
            return StepResult("validate", "skipped", "already validated", str(target))
        if self.dry:
            return StepResult("validate", "would run", "", str(target))
        report = validate_checkpoint(
            target,
            self.plan.family,
            expect_layers=None if trimming else self.layers,
            min_layers=self.layers if trimming else None,
            allow_auto_map=self.plan.allow_auto_map,
            scan_fraction=self.scan_fraction,
        )
        _write_record(record, Manifest("validate", inputs, json_safe(params)))
        return StepResult(
            "validate", "ran", f"{report.tensors} tensors in {report.shards} shards", str(target)
        )

    def _trim(self) -> StepResult:
        from miles.ckpt.trim import trim_checkpoint
        from miles.ckpt.validate import validate_checkpoint

        src = self.source_dir(download=False) if self.source.kind != "tiny" else self.hf
        if not self.trim_applies(src):
            return StepResult(
                "trim", "not applicable", f"the source already has {self.layers or 'the planned'} layers"
            )

        def make(tmp: Path):
            records = self._with_progress("trim", trim_checkpoint, src, tmp, self.layers)
            validate_checkpoint(  # the values are the source's, which validate scanned
                tmp,
                self.plan.family,
                expect_layers=self.layers,
                allow_auto_map=self.plan.allow_auto_map,
                scan_fraction=0,
            )
            return records

        return self._produce("trim", self.hf, src, fingerprint(src), {"layers": self.layers}, make)

    def _fp8(self) -> StepResult:
        from miles.ckpt.fp8 import BLOCK, convert_to_fp8
        from miles.ckpt.validate import validate_checkpoint

        def make(tmp: Path):
            records = self._with_progress("fp8", convert_to_fp8, self.hf, tmp, workers=self.workers)
            validate_checkpoint(  # conversion refuses non-finite input, so the values need no scan
                tmp,
                self.plan.family,
                expect_layers=self.layers,
                allow_auto_map=self.plan.allow_auto_map,
                scan_fraction=0,
            )
            return records

        return self._produce("fp8", self.fp8, self.hf, self._need(self.hf, "fp8"), {"block": BLOCK}, make)

    def _torch_dist(self) -> StepResult:
        from miles.ckpt.torch_dist import convert_to_torch_dist

        def make(tmp: Path):
            cached = self._cached_torch_dist()
            if cached is not None:
                shutil.copytree(cached, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST_NAME))
                _writable(tmp)
                return None
            self._with_progress("torch_dist", convert_to_torch_dist, self.hf, tmp, self.plan.family)
            return None

        def same_model(out: Path) -> list[str]:
            from miles.ckpt.torch_dist import shape_problems

            return shape_problems(out, self.hf)

        return self._produce(
            "torch_dist",
            self.torch_dist,
            self.hf,
            self._need(self.hf, "torch_dist"),
            {"vocab_multiple": 1},
            make,
            check=same_model,
        )

    def _cached_torch_dist(self) -> Path | None:
        """The tiny cache's torch_dist form of exactly this plan's HF checkpoint, when there is one
        (a tiny source whose family converts under its own name, the HF copy unchanged)."""
        if self.tiny_cache is None or self.source.kind != "tiny" or self.source.value != self.plan.family:
            return None
        from miles.ckpt.tiny_cache import tiny_checkpoint

        layers = self.layers or DEFAULT_TINY_LAYERS
        entry = tiny_checkpoint(self.source.value, layers, torch_dist=True, root=self.tiny_cache)
        return entry.torch_dist if fingerprint(entry.hf) == fingerprint(self.hf) else None

    def _stage(self) -> StepResult:
        from miles.ckpt.stage import stage_dir

        assert self.plan.stage_dir is not None  # CheckpointPlan requires it with the stage step
        dirs = [self.hf] + [
            d for s, d in (("fp8", self.fp8), ("torch_dist", self.torch_dist)) if s in self.plan.steps
        ]
        pending = [d for d in dirs if read_manifest(d) is None]
        if pending:
            if self.dry:
                return StepResult("stage", "would run", "after the steps above", self.plan.stage_dir)
            raise StepFailed(
                f"stage needs finished {[str(d) for d in pending]}; run the steps that make them first"
            )
        targets = [(d, Path(self.plan.stage_dir) / d.name) for d in dirs]
        for _, target in targets:  # a stage dir inside (or around) what it copies
            _separate(target, dirs)
        if all(_staged(d, t) for d, t in targets):
            return StepResult(
                "stage", "skipped", "staged copies up to date, files verified", self.plan.stage_dir
            )
        if self.dry:
            return StepResult("stage", "would run", f"{len(targets)} dirs", self.plan.stage_dir)
        copied = sum(self._with_progress("stage", stage_dir, d, t) for d, t in targets)
        return StepResult("stage", "ran", f"copied {copied} bytes", self.plan.stage_dir)


def _copy_into(entry: Path, final: Path) -> None:
    """A writable copy of a cached folder at `final`, replacing it atomically."""
    with atomic_dir(final, reads=[entry], replaces=HF_STEPS) as tmp:
        shutil.copytree(entry, tmp, dirs_exist_ok=True)
        _writable(tmp)


def _writable(folder: Path) -> None:
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _separate(out: Path, sources: Path | Sequence[Path]) -> None:
    """A CheckpointError when a step would write `out` over, into or around one of its inputs."""
    try:
        refuse_overlap(out, [sources] if isinstance(sources, Path) else sources, what="its output")
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None


def _staged(source: Path, copy: Path) -> bool:
    """`copy` is a staged copy of the finished `source` whose files are verified as written."""
    manifest = read_manifest(copy)
    return manifest is not None and manifest == read_manifest(source) and not file_problems(copy, manifest)


def _read_record(path: Path) -> Manifest | None:
    try:
        return Manifest.from_json(read_regular(path, MAX_JSON_BYTES).decode())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(path: Path, record: Manifest) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, record.to_json().encode())
