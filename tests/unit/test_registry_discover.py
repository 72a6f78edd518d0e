"""Discovery reads registrations from real files and names file:line, value, rule and fix."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry import discover as discover_module
from miles.ci.registry.discover import Registration, disabled_reason_problem, discover

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
HEADER = (
    "from miles.ci.register import register_ci_gate, register_cpu_ci, register_cuda_ci, register_rocm_ci\n"
)


def _one(make_tree, body: str, path: str = "tests/e2e/test_x.py"):
    root = make_tree({path: HEADER + body})
    return discover(root)


def _problem(make_tree, body: str, path: str = "tests/e2e/test_x.py") -> str:
    result = _one(make_tree, body, path)
    assert len(result.problems) == 1, [str(p) for p in result.problems]
    return str(result.problems[0])


def test_reads_a_cuda_and_a_rocm_registration_with_their_lines(make_tree):
    result = _one(
        make_tree,
        'register_cuda_ci(est_time=300, suite="stage-c-4-gpu-h200", labels=["megatron"])\n'
        'register_rocm_ci(390, "stage-c-4-gpu-mi350", labels=["megatron", "amd"], nightly=True)\n',
    )
    assert not result.problems
    assert result.registrations == (
        Registration("cuda", "tests/e2e/test_x.py", 2, 300.0, "stage-c-4-gpu-h200", ("megatron",)),
        Registration(
            "rocm", "tests/e2e/test_x.py", 3, 390.0, "stage-c-4-gpu-mi350", ("megatron", "amd"), True
        ),
    )


def test_argument_that_is_not_a_literal_is_rejected(make_tree):
    message = _problem(make_tree, 'T = 10\nregister_cpu_ci(est_time=T * 2, suite="stage-b-cpu")\n')
    assert message.startswith("tests/e2e/test_x.py:3: register_cpu_ci: est_time=T * 2 is not a literal")


def test_only_est_time_and_suite_may_be_positional(make_tree):
    message = _problem(make_tree, 'register_cuda_ci(300, "stage-c-4-gpu-h200", ["megatron"])\n')
    assert "positional argument ['megatron'] (#3) is not allowed" in message
    assert "only est_time and suite may be positional" in message


def test_unknown_argument_is_rejected(make_tree):
    message = _problem(make_tree, 'register_cpu_ci(est_time=5, suite="stage-b-cpu", timeout=9)\n')
    assert "unknown argument 'timeout'" in message


def test_argument_given_twice_is_rejected(make_tree):
    message = _problem(make_tree, 'register_cpu_ci(5, "stage-b-cpu", est_time=6)\n')
    assert "'est_time' is given twice" in message


def test_starred_and_double_star_arguments_are_rejected(make_tree):
    result = _one(
        make_tree,
        'ARGS = (5, "stage-b-cpu")\nregister_cpu_ci(*ARGS)\nregister_cpu_ci(**{"est_time": 5})\n',
    )
    messages = " | ".join(str(p) for p in result.problems)
    assert ":3: register_cpu_ci(*ARGS): starred arguments cannot be read" in messages
    assert ":4: register_cpu_ci(**{'est_time': 5}): '**' arguments cannot be read" in messages


@pytest.mark.parametrize("value", ["0", "-5", "True", '"300"', "float('inf')"])
def test_est_time_must_be_a_positive_number(make_tree, value):
    result = _one(make_tree, f'register_cpu_ci(est_time={value}, suite="stage-b-cpu")\n')
    assert result.problems and not result.registrations


@pytest.mark.parametrize(
    ("marker", "suite", "backend"),
    [
        ("register_cpu_ci", "stage-z-cpu", "cpu"),
        ("register_cuda_ci", "stage-c-4-gpu-h20", "cuda"),
        ("register_rocm_ci", "stage-c-4-gpu-mi300x", "rocm"),
    ],
)
def test_unknown_suite_is_an_error_for_every_backend(make_tree, marker, suite, backend):
    message = _problem(make_tree, f'{marker}(est_time=5, suite="{suite}", labels=["amd"])\n')
    assert f"suite '{suite}' is not in the catalog for {backend}" in message
    assert "add the suite to miles/ci/catalog.toml" in message


def test_typo_suggests_the_nearest_suite(make_tree):
    message = _problem(
        make_tree, 'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi305", labels=["amd"])\n'
    )
    assert "did you mean 'stage-c-4-gpu-mi350'?" in message


def test_suite_of_another_backend_is_an_error(make_tree):
    message = _problem(
        make_tree, 'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-h200", labels=["amd"])\n'
    )
    assert "for rocm (it belongs to cuda)" in message


def test_unknown_label_is_rejected(make_tree):
    message = _problem(
        make_tree, 'register_cuda_ci(est_time=5, suite="stage-c-4-gpu-h200", labels=["megatrom"])\n'
    )
    assert "label 'megatrom' is not in the catalog; did you mean 'megatron'?" in message


@pytest.mark.parametrize(
    "marker,suite", [("register_cuda_ci", "stage-c-4-gpu-h200"), ("register_rocm_ci", "stage-c-4-gpu-mi350")]
)
def test_gpu_registration_needs_a_label(make_tree, marker, suite):
    message = _problem(make_tree, f'{marker}(est_time=5, suite="{suite}")\n')
    assert "needs at least one label" in message


def test_cpu_registration_may_have_no_label(make_tree):
    result = _one(make_tree, 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n')
    assert not result.problems and result.registrations[0].labels == ()


def test_nightly_must_be_a_bool(make_tree):
    message = _problem(make_tree, 'register_cpu_ci(est_time=5, suite="stage-b-cpu", nightly="yes")\n')
    assert "nightly='yes' must be True or False" in message


@pytest.mark.parametrize(
    "reason",
    [
        "Disable due to failure",
        "FIXME",
        "flaky",
        "",
        "   ",
        "FIXME: re-enable once this case passes on the MI350 runners.",
        "TODO: fix later",
    ],
)
def test_generic_disabled_reason_is_rejected(make_tree, reason):
    message = _problem(
        make_tree,
        f'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"], disabled={reason!r})\n',
    )
    assert "gives no diagnosis" in message and "tracking reference" in message


@pytest.mark.parametrize(
    "reason",
    [
        "Disable due to failure, see #2265",
        "flaky: https://github.com/example/repo/issues/12",
        "sgl-project/sglang#9876",
        "numba missing from the rocm720 image",
        "aiter fused MoE kernel aborts with HIP error 700 on gfx950",
    ],
)
def test_diagnosed_or_tracked_disabled_reason_is_accepted(make_tree, reason):
    result = _one(
        make_tree,
        f'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"], disabled={reason!r})\n',
    )
    assert not result.problems
    assert result.registrations[0].disabled == reason and not result.registrations[0].enabled


def test_disabled_reason_check_is_reusable_on_its_own():
    assert disabled_reason_problem("broken") is not None
    assert disabled_reason_problem("see #12") is None


def test_unit_file_without_registration_is_implicitly_stage_a_cpu(make_tree):
    root = make_tree({"tests/unit/test_fast.py": "def test_ok():\n    pass\n"})
    result = discover(root)
    assert not result.problems
    (reg,) = result.registrations
    assert (reg.backend, reg.suite, reg.implicit) == ("cpu", "stage-a-cpu", True)


def test_unit_file_with_explicit_registration_uses_it(make_tree):
    root = make_tree(
        {"tests/unit/test_slow.py": HEADER + 'register_cpu_ci(est_time=50, suite="stage-b-cpu")\n'}
    )
    (reg,) = discover(root).registrations
    assert (reg.suite, reg.implicit) == ("stage-b-cpu", False)


def test_other_test_file_without_registration_is_an_error(make_tree):
    root = make_tree({"tests/e2e/test_forgot.py": "def test_ok():\n    pass\n"})
    (problem,) = discover(root).problems
    assert str(problem).startswith("tests/e2e/test_forgot.py:1: no register_*_ci(...) call")


def test_aliased_marker_import_is_an_error(make_tree):
    root = make_tree(
        {
            "tests/unit/test_alias.py": "from miles.ci.register import register_rocm_ci as rr\n"
            'rr(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"])\n'
        }
    )
    result = discover(root)
    assert [str(p) for p in result.problems] == [
        "tests/unit/test_alias.py:1: 'register_rocm_ci' is imported as 'rr': discovery reads calls by "
        "the marker's own name; write 'from miles.ci.register import register_rocm_ci'"
    ]
    assert result.registrations == ()  # not silently turned into an implicit stage-a-cpu test


def test_attribute_call_is_an_error(make_tree):
    root = make_tree(
        {
            "tests/unit/test_attr.py": "import miles.ci.register as reg\n"
            'reg.register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"])\n'
        }
    )
    (problem,) = discover(root).problems
    assert "tests/unit/test_attr.py:2: 'reg.register_rocm_ci' is an attribute call" in str(problem)


def test_a_call_inside_a_function_is_not_a_registration_only_a_note(make_tree):
    message = _problem(
        make_tree,
        'def setup_module():\n    register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"])\n',
    )
    assert message.startswith("tests/e2e/test_x.py:1: no register_*_ci(...) call:")
    assert (
        "note: register_rocm_ci at line 3 is inside a function body, which is not a registration" in message
    )


def test_call_inside_an_if_is_an_error(make_tree):
    message = _problem(
        make_tree,
        'import os\nif os.getenv("MILES_HARDWARE_PLATFORM") == "rocm":\n'
        '    register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"])\n',
    )
    assert "test_x.py:4: register_rocm_ci is used inside a block" in message


def test_same_backend_and_suite_twice_is_an_error(make_tree):
    message = _problem(
        make_tree,
        'register_cpu_ci(est_time=5, suite="stage-b-cpu")\nregister_cpu_ci(est_time=9, suite="stage-b-cpu")\n',
    )
    assert "test_x.py:3: register_cpu_ci: (cpu, stage-b-cpu) is already registered at line 2" in message


def test_same_suite_name_on_two_backends_is_not_a_duplicate(make_tree):
    result = _one(
        make_tree,
        'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n'
        'register_cuda_ci(est_time=5, suite="stage-b-2-gpu-h200", labels=["short"])\n',
    )
    assert not result.problems and len(result.registrations) == 2


def test_gate_declarations_are_read(make_tree):
    result = _one(
        make_tree,
        'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n'
        'register_ci_gate(metric_key="train/grad_norm")\n'
        'register_ci_gate(metric_key="train/ppo_kl", steps=[0, 3], constraint={"rel_up": 0.5}, enforce=True)\n',
    )
    assert not result.problems
    first, second = result.gates
    assert (first.metric_key, first.steps, first.constraint, first.enforce) == (
        "train/grad_norm",
        "last",
        (),
        False,
    )
    assert (second.steps, second.constraint, second.enforce, second.line) == (
        (0, 3),
        (("rel_up", 0.5),),
        True,
        4,
    )


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ('register_ci_gate("train/grad_norm")', "only no argument may be positional"),
        ('register_ci_gate(metric_key="m", steps="first")', "steps='first' must be 'last', 'all'"),
        ('register_ci_gate(metric_key="m", constraint={"rel": 1})', "constraint key 'rel' is unknown"),
        ('register_ci_gate(metric_key="m", window=5)', "unknown argument 'window'"),
        (
            'register_ci_gate(metric_key="m")\nregister_ci_gate(metric_key="m")',
            "already has a gate in this file",
        ),
    ],
)
def test_bad_gate_declarations_are_rejected(make_tree, call, expected):
    message = _problem(make_tree, 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n' + call + "\n")
    assert expected in message


def test_marker_named_only_in_a_docstring_is_not_a_registration(make_tree):
    source = '''"""How to register:
register_cuda_ci(est_time=1, suite="stage-c-4-gpu-h200", labels=["megatron"])
"""
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-b-cpu")


def test_ok():
    """Also mentions register_rocm_ci in passing."""
'''
    root = make_tree({"tests/e2e/test_doc.py": source})
    result = discover(root)
    assert not result.problems
    assert [(r.backend, r.line) for r in result.registrations] == [("cpu", 6)]


def test_partial_parse_agrees_with_a_full_parse_on_tricky_layouts(make_tree):
    """The prefix shortcut must never change what is read; compare it with ast.parse of the file."""
    layouts = [
        HEADER + 'register_cpu_ci(\n    est_time=5,\n    suite="stage-b-cpu",\n)\nX = 1\n',
        HEADER + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\nS = """\ntext\n"""\n',
        HEADER
        + 'register_cpu_ci(est_time=5, suite="""stage-b-cpu""")\ntry:\n    pass\nexcept Exception:\n    pass\n',
        HEADER + 'if True:\n    register_cpu_ci(est_time=5, suite="stage-b-cpu")\nelse:\n    pass\n',
        HEADER
        + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n@decorator\ndef test_a():\n    register_cpu_ci\n',
    ]
    for index, source in enumerate(layouts):
        tree, _ = discover_module._parse_marker_region(source, "x.py")
        full = ast.parse(source)
        marker_nodes = lambda t: sorted(  # noqa: E731
            (n.lineno, n.id) for n in ast.walk(t) if isinstance(n, ast.Name) and n.id.startswith("register_")
        )
        assert marker_nodes(tree) == marker_nodes(full), f"layout {index}"


def test_syntax_error_is_reported_with_its_line(make_tree):
    root = make_tree(
        {"tests/e2e/test_broken.py": HEADER + 'register_cpu_ci(est_time=5, suite="stage-b-cpu"\n'}
    )
    (problem,) = discover(root).problems
    assert problem.file == "tests/e2e/test_broken.py" and "syntax error" in problem.message


def test_hidden_and_cache_directories_are_skipped(make_tree):
    root = make_tree(
        {
            "tests/unit/test_a.py": "",
            "tests/.venv/test_b.py": "",
            "tests/unit/__pycache__/test_c.py": "",
            "tests/unit/helper.py": "",
        }
    )
    assert [f.path for f in discover(root).files] == ["tests/unit/test_a.py"]


# Test files as the seeds' framework writes them, with only the import line pointed at
# miles.ci.register: they must parse unchanged.
SEED_STYLE_FILES = {
    "tests/e2e/fsdp/test_qwen3_0.6B_fsdp_distributed.py": """
        from miles.ci.register import register_cuda_ci, register_rocm_ci

        register_cuda_ci(est_time=600, suite="stage-c-4-gpu-h200", labels=["fsdp", "long"])
        register_rocm_ci(
            est_time=780,
            suite="nightly-stage-c-4-gpu-mi350",
            labels=["fsdp", "long", "amd"],
        )


        def test_fsdp_distributed():
            pass
        """,
    "tests/e2e/megatron/test_amd_r3_mtp.py": """
        import os

        from miles.ci.register import register_rocm_ci
        from miles.ci.register import register_ci_gate

        register_rocm_ci(
            est_time=3900,
            suite="stage-c-4-gpu-mi350",
            labels=["megatron", "amd"],
        )
        register_ci_gate(metric_key="train/grad_norm")
        register_ci_gate(metric_key="train/ppo_kl")
        register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
        register_ci_gate(metric_key="train/train_rollout_kl")
        register_ci_gate(metric_key="rollout/raw_reward")

        EP_SIZE = 2  # PP2 x EP4 x ETP1 = 8 does not divide 4 GPUs


        def test_r3_mtp():
            assert os.environ is not None
        """,
    "tests/e2e/megatron/model_scripts/test_glm5_2_744b_a40b_5layer_ci.py": """
        from miles.ci.register import register_cuda_ci, register_rocm_ci

        register_cuda_ci(est_time=1800, suite="stage-c-8-gpu-h200", labels=["megatron", "model-scripts", "long"])
        register_rocm_ci(
            est_time=900,
            suite="stage-c-4-gpu-mi350",
            labels=["megatron", "model-scripts", "amd"],
            disabled="sglang nsa decode backend crashes on gfx950, see sgl-project/sglang#10211",
        )
        """,
    "tests/e2e/test_nightly_only.py": """
        from miles.ci.register import register_cuda_ci

        register_cuda_ci(3000, "stage-c-8-gpu-h100", labels=["megatron", "precision"], nightly=True)
        """,
}


def test_seed_style_files_parse_unchanged(make_tree):
    root = make_tree(SEED_STYLE_FILES)
    result = discover(root)
    assert not result.problems, [str(p) for p in result.problems]
    summary = sorted(
        (r.file.rsplit("/", 1)[-1], r.backend, r.suite, r.nightly, r.enabled) for r in result.registrations
    )
    assert summary == [
        ("test_amd_r3_mtp.py", "rocm", "stage-c-4-gpu-mi350", False, True),
        ("test_glm5_2_744b_a40b_5layer_ci.py", "cuda", "stage-c-8-gpu-h200", False, True),
        ("test_glm5_2_744b_a40b_5layer_ci.py", "rocm", "stage-c-4-gpu-mi350", False, False),
        ("test_nightly_only.py", "cuda", "stage-c-8-gpu-h100", True, True),
        ("test_qwen3_0.6B_fsdp_distributed.py", "cuda", "stage-c-4-gpu-h200", False, True),
        ("test_qwen3_0.6B_fsdp_distributed.py", "rocm", "nightly-stage-c-4-gpu-mi350", False, True),
    ]
    assert [g.metric_key for g in result.gates] == [
        "train/grad_norm",
        "train/ppo_kl",
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_kl",
        "rollout/raw_reward",
    ]


def test_every_test_file_of_this_repository_parses_cleanly():
    result = discover(ROOT)
    assert not result.problems, "\n".join(str(p) for p in result.problems)
    paths = {f.path for f in result.files}
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if "__pycache__" not in p.parts
    }
    assert paths == on_disk
    assert all(f.registrations for f in result.files)


def _age(path: Path, seconds: float = 60) -> None:
    stamp = path.stat().st_mtime - seconds
    os.utime(path, (stamp, stamp))


def test_unchanged_file_is_read_from_the_cache(make_tree, monkeypatch):
    source = (
        HEADER
        + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n'
        + 'register_rocm_ci(est_time=7.5, suite="nightly-stage-c-2-gpu-mi350", labels=["amd", "fsdp"], nightly=True,'
        + ' disabled="rccl hangs in all_gather at 2 ranks, see #12")\n'
        + 'register_ci_gate(metric_key="train/ppo_kl", steps=[0, 3], constraint={"rel_up": 0.5}, enforce=True)\n'
        + 'register_ci_gate(metric_key="rollout/raw_reward")\n'
    )
    root = make_tree({"tests/e2e/test_x.py": source})
    _age(root / "tests/e2e/test_x.py")
    first = discover(root)
    assert (root / ".miles/cache/discover.json").is_file()

    def parse_again(*args, **kwargs):
        raise AssertionError("an unchanged file was parsed again")

    monkeypatch.setattr(discover_module, "parse_test_file", parse_again)
    assert discover(root).files == first.files
    assert len(first.registrations) == 2 and len(first.gates) == 2


def test_edited_file_is_parsed_again(make_tree):
    root = make_tree({"tests/e2e/test_x.py": HEADER + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n'})
    path = root / "tests/e2e/test_x.py"
    _age(path, 120)
    discover(root)
    path.write_text(HEADER + 'register_cpu_ci(est_time=50, suite="stage-b-cpu")\n')
    _age(path, 60)
    assert discover(root).registrations[0].est_time == 50


def test_file_modified_just_now_is_not_cached(make_tree):
    root = make_tree({"tests/e2e/test_x.py": HEADER + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n'})
    discover(root)
    cached = (
        (root / ".miles/cache/discover.json").read_text()
        if (root / ".miles/cache/discover.json").exists()
        else ""
    )
    assert "tests/e2e/test_x.py" not in cached


def test_cached_problems_are_reported_again(make_tree):
    root = make_tree(
        {
            "tests/e2e/test_x.py": HEADER
            + 'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi300x", labels=["amd"])\n'
        }
    )
    _age(root / "tests/e2e/test_x.py")
    first = discover(root)
    second = discover(root)
    assert first.problems == second.problems and len(second.problems) == 1


def test_a_different_catalog_does_not_reuse_the_cache(make_tree, tmp_path_factory):
    from miles.ci.registry.catalog import CATALOG_PATH, load_catalog

    root = make_tree(
        {
            "tests/e2e/test_x.py": HEADER
            + 'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi350", labels=["amd"])\n'
        }
    )
    _age(root / "tests/e2e/test_x.py")
    assert not discover(root).problems
    renamed = tmp_path_factory.mktemp("catalog") / "catalog.toml"
    renamed.write_text(CATALOG_PATH.read_text().replace('\namd = "', '\namd-gpu = "'))
    result = discover(root, catalog=load_catalog(renamed))
    assert "label 'amd' is not in the catalog" in str(result.problems[0])


def test_a_marker_imported_but_never_called_at_top_level_is_no_registration(make_tree):
    message = _problem(make_tree, "def test_x():\n    pass\n")
    assert message.startswith("tests/e2e/test_x.py:1: no register_*_ci(...) call")


def test_a_unit_file_that_calls_markers_only_in_its_tests_is_implicit(make_tree):
    root = make_tree(
        {"tests/unit/test_api.py": HEADER + "def test_noop():\n    assert register_cpu_ci(1, 'x') is None\n"}
    )
    result = discover(root)
    assert result.problems == ()
    assert [(r.suite, r.implicit) for r in result.registrations] == [("stage-a-cpu", True)]


def _catalog_with(tmp_path, implicit: str):
    from miles.ci.registry.catalog import CATALOG_PATH, load_catalog

    text = CATALOG_PATH.read_text()
    start = text.index("[implicit.")
    end = text.index("# Suites.")
    path = tmp_path / "catalog.toml"
    path.write_text(text[:start] + implicit + "\n" + text[end:])
    return load_catalog(path)


def test_the_catalog_says_which_directories_register_implicitly_and_where(make_tree, tmp_path_factory):
    catalog = _catalog_with(
        tmp_path_factory.mktemp("catalog"),
        '[implicit."tests/fast"]\nsuite = "stage-a-cpu"\nest_time = 1\n'
        '[implicit."tests/fast/slow"]\nsuite = "stage-b-cpu"\nest_time = 30\n',
    )
    root = make_tree(
        {
            "tests/fast/test_a.py": "def test_a():\n    pass\n",
            "tests/fast/slow/test_b.py": "def test_b():\n    pass\n",
            "tests/unit/test_c.py": "def test_c():\n    pass\n",
        }
    )
    result = discover(root, catalog=catalog, cache=False)
    assert [(r.file, r.suite, r.est_time, r.implicit) for r in result.registrations] == [
        ("tests/fast/slow/test_b.py", "stage-b-cpu", 30.0, True),
        ("tests/fast/test_a.py", "stage-a-cpu", 1.0, True),
    ]
    (problem,) = result.problems
    assert str(problem).startswith("tests/unit/test_c.py:1: no register_*_ci(...) call")
    assert "implicit directories (tests/fast/, tests/fast/slow/)" in str(problem)


def test_the_cache_fingerprint_covers_every_module_discovery_reads_with():
    """An edit to any module whose code decides a file's records must mean a fresh parse."""
    from miles.ci.registry.discover_cache import _CODE

    package = ROOT / "miles"
    needed, todo = set(), ["ci/registry/discover.py"]
    while todo:
        rel = todo.pop()
        if rel in needed:
            continue
        needed.add(rel)
        for node in ast.walk(ast.parse((package / rel).read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("miles.")
                and node.level == 0
            ):
                path = node.module.removeprefix("miles.").replace(".", "/") + ".py"
                if (package / path).is_file() and "cache" not in path:
                    todo.append(path)
    assert needed <= set(_CODE), sorted(needed - set(_CODE))
