"""Each family's config.json schema, from the command a user runs: a hostile config.json (or
weight) written into a tiny checkpoint is refused by `python -m miles.ckpt validate` in one line
naming the file, the key (or tensor), its value and the rule, exit 1 (the validate step's
refusal), before any arithmetic or meta-model build; every shipped tiny checkpoint and every
recipe model's published config passes.

The rules are the models' own (transformers 5.24's configuration_*.py and modelling code: a
layer list has one entry per layer, top-k picks among the routed experts, KV heads divide the
query heads, DeepSeek-V4's o_groups split the heads, local_layer_ids index layers), and
DeepSeek-V4's hash-routing table tid2eid holds expert ids in [0, n_routed_experts), distinct per
row (a routing map cannot send a token to one expert twice), as int64 (transformers' buffer) or
int32 (SGLang's HashTopK parameter).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.cli import main
from miles.families import family, names
from miles.families.schema import ConfigRefused

register_cpu_ci(est_time=3, suite="stage-a-cpu")

LAYERS = 2  # each family's tiny checkpoint, built once for the module
NEW = ("glm_moe_dsa", "glm4_moe_lite", "inkling", "deepseek_v4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_checkpoint(name, LAYERS, root / name, progress=False)
        return made[name]

    return get


def _copy(src: Path, dst: Path) -> Path:
    """dst with src's files (shards hard-linked: the tensors cases rewrite their shard anew)."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.is_file():
            os.link(entry, dst / entry.name)
    return dst


def _with_config(src: Path, dst: Path, edit) -> Path:
    out = _copy(src, dst)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


def _validate(path: Path, name: str, capsys) -> tuple[int, list[str]]:
    rc = main(["validate", str(path), "--family", name, "--scan-nan", "0"])
    return rc, capsys.readouterr().err.strip().splitlines()


def _set(key, value):
    def edit(config):
        config[key] = value

    return edit


def _drop(key):
    def edit(config):
        config.pop(key)

    return edit


def _short(key):
    def edit(config):
        config[key] = config[key][:-1]

    return edit


def _unknown(key):
    def edit(config):
        config[key] = ["mystery", *config[key][1:]]

    return edit


def _experts(name: str) -> str:
    return "num_experts" if name == "qwen3_moe" else "n_routed_experts"


# (case, edit, what the one line says after "config.json: [schema] ") for each new family
def _common(name: str) -> list:
    experts = _experts(name)
    return [
        ("hidden_size a string", _set("hidden_size", "128"), "hidden_size = '128': must be a whole number >= 1"),
        ("hidden_size negative", _set("hidden_size", -128), "hidden_size = -128: must be a whole number >= 1"),
        ("hidden_size a float", _set("hidden_size", 128.0), "hidden_size = 128.0: must be a whole number"),
        ("hidden_size a bool", _set("hidden_size", True), "hidden_size = True: must be a whole number"),
        ("no layers", _set("num_hidden_layers", 0), "num_hidden_layers = 0: must be a whole number >= 1"),
        ("1e9 layers", _set("num_hidden_layers", 1e9), "num_hidden_layers = 1000000000.0: must be a whole number"),
        ("10**9 layers", _set("num_hidden_layers", 10**9), "entries for num_hidden_layers = 1000000000"),
        ("experts null", _set(experts, None), f"{experts} = (missing): is required"),
        ("experts a string", _set(experts, "8"), f"{experts} = '8': must be a whole number"),
        ("top-k above the experts", _set("num_experts_per_tok", 9), f"num_experts_per_tok = 9: exceeds {experts} = 8"),
        ("top-k zero", _set("num_experts_per_tok", 0), "num_experts_per_tok = 0: must be a whole number >= 1"),
        ("no vocab_size", _drop("vocab_size"), "vocab_size = (missing): is required"),
        ("vocab_size null", _set("vocab_size", None), "vocab_size = (missing): is required"),
        ("heads zero", _set("num_attention_heads", 0), "num_attention_heads = 0: must be a whole number >= 1"),
        ("rms_norm_eps negative", _set("rms_norm_eps", -1e-6), "rms_norm_eps = -1e-06: must be a finite number > 0"),
        ("rms_norm_eps a string", _set("rms_norm_eps", "1e-6"), "rms_norm_eps = '1e-6': must be a finite number"),
        ("config a list", None, "is not a JSON object"),
    ]  # fmt: skip


LISTS = {
    "glm_moe_dsa": ("layer_types", "mlp_layer_types", "indexer_types"),
    "glm4_moe_lite": ("mlp_layer_types",),
    "inkling": ("layer_types", "mlp_layer_types"),
    "deepseek_v4": ("layer_types", "mlp_layer_types"),
}


def _lists(name: str) -> list:
    out = []
    for key in LISTS[name]:
        out.append((f"{key} short", _short(key), f"{key} = "))
        out.append((f"{key} unknown", _unknown(key), "entry 'mystery' is not a layer kind of this model"))
        out.append((f"{key} a string", _set(key, "hybrid"), f"{key} = 'hybrid': must be a list"))
    return out


def _local_ids(config, ids):
    config.pop("layer_types")  # InklingTextConfig derives layer_types from local_layer_ids
    config["local_layer_ids"] = ids


OWN = {
    "glm_moe_dsa": [
        ("no kv_lora_rank", _drop("kv_lora_rank"), "kv_lora_rank = (missing): is required"),
        ("kv_lora_rank negative", _set("kv_lora_rank", -32), "kv_lora_rank = -32: must be a whole number >= 1"),
        ("index_topk zero", _set("index_topk", 0), "index_topk = 0: must be a whole number >= 1"),
        ("first_k_dense_replace negative", _set("first_k_dense_replace", -1), "first_k_dense_replace = -1"),
        ("topk_group above n_group", lambda c: c.update(n_group=1, topk_group=2), "topk_group = 2: exceeds n_group = 1"),
    ],
    "glm4_moe_lite": [
        ("no kv_lora_rank", _drop("kv_lora_rank"), "kv_lora_rank = (missing): is required"),
        ("v_head_dim zero", _set("v_head_dim", 0), "v_head_dim = 0: must be a whole number >= 1"),
        ("topk_group above n_group", lambda c: c.update(n_group=1, topk_group=2), "topk_group = 2: exceeds n_group = 1"),
    ],
    "inkling": [
        ("local_layer_ids out of range", lambda c: _local_ids(c, [5]), "local_layer_ids = [5]: names layer 5, outside 0..1"),
        ("local_layer_ids negative", lambda c: _local_ids(c, [-1]), "local_layer_ids = [-1]: names layer -1, outside 0..1"),
        ("local_layer_ids twice", lambda c: _local_ids(c, [0, 0]), "local_layer_ids = [0, 0]: names layer 0 twice"),
        ("local_layer_ids strings", lambda c: _local_ids(c, ["0"]), "must be a list of layer indices"),
        ("negative window", _set("sliding_window_size", -512), "sliding_window_size = -512: must be a whole number >= 1"),
        ("negative window under its alias", lambda c: (c.pop("sliding_window_size", None), c.update(sliding_window=-1)), "sliding_window_size = -1"),
        ("kv heads do not divide", _set("num_key_value_heads", 3), "num_attention_heads = 4: is not a multiple of num_key_value_heads = 3"),
        ("no intermediate_size", _drop("intermediate_size"), "intermediate_size = (missing): is required"),
    ],
    "deepseek_v4": [
        ("negative window", _set("sliding_window", -128), "sliding_window = -128: must be a whole number >= 1"),
        ("o_groups do not divide the heads", _set("o_groups", 3), "num_attention_heads = 4: is not a multiple of o_groups = 3"),
        ("no head_dim", _drop("head_dim"), "head_dim = (missing): is required"),
        ("hc_mult zero", _set("hc_mult", 0), "hc_mult = 0: must be a whole number >= 1"),
    ],
}  # fmt: skip

CASES = [
    pytest.param(name, edit, said, id=f"{name}: {case}")
    for name in NEW
    for case, edit, said in [*_common(name), *_lists(name), *OWN[name]]
]


@pytest.mark.parametrize("name, edit, said", CASES)
def test_a_hostile_config_is_refused_in_one_line_before_any_arithmetic(
    tiny, tmp_path, capsys, name, edit, said
):
    src = tiny(name)
    if edit is None:  # not an object at all
        out = _copy(src, tmp_path / "ckpt")
        (out / "config.json").unlink()
        (out / "config.json").write_text("[1, 2]")
    else:
        out = _with_config(src, tmp_path / "ckpt", edit)
    rc, lines = _validate(out, name, capsys)
    assert rc == 1, lines
    (line,) = lines
    assert line.startswith(f"error: {out} is not a valid {name} checkpoint: {out / 'config.json'}: "), line
    assert said in line, line
    if edit is not None:
        assert "[schema]" in line and "; " in line.split(said, 1)[1], line  # the rule, then the fix


@pytest.mark.parametrize("name", ["qwen3", *NEW])
def test_a_config_deeper_than_its_shards_is_refused_before_the_meta_model(tiny, tmp_path, capsys, name):
    """A 2-layer checkpoint whose config claims 1,000,000 layers (and writes no per-layer lists,
    as configs before transformers 5 do): refused from the shards' own layer indices, not by
    building a million layers on the meta device (which hung validate)."""

    def deep(config):
        config["num_hidden_layers"] = 1_000_000
        for key in ("layer_types", "mlp_layer_types", "indexer_types", "local_layer_ids"):
            config.pop(key, None)

    out = _with_config(tiny(name), tmp_path / "ckpt", deep)
    rc, lines = _validate(out, name, capsys)
    assert rc == 1, lines
    (line,) = lines
    held = LAYERS + (name in ("glm_moe_dsa", "glm4_moe_lite"))  # GLM's MTP layer follows as model.layers.2
    assert (
        f"{out / 'config.json'}: [schema] num_hidden_layers = 1000000: the shards hold no tensors of layer "
        f"{held} ({held} of the 1000000 layers it declares); write the weights' depth, or fetch the missing shards"
    ) in line, line


def _rewrite(src: Path, dst: Path, pick, change) -> tuple[Path, str]:
    """dst: src with the first tensor `pick(name)` accepts replaced by `change(tensor)`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = _copy(src, dst)
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            hit = next((n for n in f.keys() if pick(n)), None)
            if hit is None:
                continue
            tensors = {n: f.get_tensor(n) for n in f.keys()}
            metadata = f.metadata()
        tensors[hit] = change(tensors[hit])
        shard.unlink()
        save_file(tensors, str(shard), metadata=metadata)
        return out, hit
    raise AssertionError("no such tensor")


PROJECTIONS = {
    "glm_moe_dsa": "q_a_proj.weight",
    "glm4_moe_lite": "q_a_proj.weight",
    "inkling": "q_proj.weight",
    "deepseek_v4": "wq_a.weight",
}


@pytest.mark.parametrize("name", NEW)
def test_a_projection_with_one_extra_row_is_refused_naming_the_tensor(tiny, tmp_path, capsys, name):
    import torch

    def grow(t):
        return torch.cat([t, t[:1]])

    out, hit = _rewrite(tiny(name), tmp_path / "ckpt", lambda n: n.endswith(PROJECTIONS[name]), grow)
    rc, lines = _validate(out, name, capsys)
    assert rc == 1, lines
    (line,) = lines
    assert f"tensor {hit}: [shape] has shape" in line and "but this config.json implies" in line, line


def _route(table_of):
    def change(t):
        import torch

        return table_of(t.clone()).to(torch.int64)

    return change


def _first(value):
    def edit(t):
        t[0, 0] = value
        return t

    return edit


def _twice(t):
    t[3, 1] = t[3, 0]
    return t


TID2EID = [
    ("expert 100 of 8", _route(_first(100)), None, "row 0 names 100, outside 0..7 (n_routed_experts = 8)"),
    ("expert -1", _route(_first(-1)), None, "row 0 names -1, outside 0..7"),
    ("one expert twice", _route(_twice), None, "row 3 names an expert twice"),
    ("int32 naming expert 100", _route(_first(100)), "int32", "row 0 names 100, outside 0..7"),
    ("int32 naming one expert twice", _route(_twice), "int32", "row 3 names an expert twice"),
    ("stored as float", _route(lambda t: t), "float32", "[dtype] is F32"),
    ("stored as int8", _route(lambda t: t), "int8", "[dtype] is I8; an id table is I64 or I32"),
]


@pytest.mark.parametrize("case, change, dtype, said", TID2EID, ids=[c[0] for c in TID2EID])
def test_deepseek_v4_tid2eid_is_checked_for_dtype_range_and_repeats(
    tiny, tmp_path, capsys, case, change, dtype, said
):
    import torch

    def cast(t):
        t = change(t)
        return t.to(getattr(torch, dtype)) if dtype else t

    out, hit = _rewrite(tiny("deepseek_v4"), tmp_path / "ckpt", lambda n: n.endswith("gate.tid2eid"), cast)
    rc, lines = _validate(out, "deepseek_v4", capsys)
    assert rc == 1, lines
    (line,) = lines
    assert f"tensor {hit}: " in line and said in line, line


def test_an_int32_tid2eid_in_range_is_accepted(tiny, tmp_path, capsys):
    """SGLang holds tid2eid as int32: a table of that dtype with valid rows passes."""
    import torch

    out, _ = _rewrite(
        tiny("deepseek_v4"),
        tmp_path / "ckpt",
        lambda n: n.endswith("gate.tid2eid"),
        lambda t: t.to(torch.int32),
    )
    rc, lines = _validate(out, "deepseek_v4", capsys)
    assert rc == 0, lines


@pytest.mark.parametrize("name", ["qwen3", *NEW])
def test_the_tiny_checkpoints_pass(tiny, capsys, name):
    rc = main(["validate", str(tiny(name)), "--family", name, "--scan-nan", "0"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", names())
def test_every_shipped_tiny_config_passes_its_schema(name):
    """The config make-tiny writes for each family at its shipped depth (transformers' config
    class over the family's tiny dims, as make_tiny_checkpoint builds it) meets the schema."""
    from transformers import AutoConfig

    spec = family(name)
    dims = {"tie_word_embeddings": False, **spec.tiny_dims}
    config = AutoConfig.for_model(spec.tiny_model_type, num_hidden_layers=spec.tiny_layers, **dims)
    refused = []
    try:
        spec.check_config(config.to_dict())
    except ConfigRefused as exc:
        refused.append(str(exc))
    assert spec.schema and refused == [], name


def _recipe_models():
    """Every ModelSpec the recipe library defines, by name."""
    import importlib
    import pkgutil

    from miles.recipes import library
    from miles.recipes.models import ModelSpec

    seen = {}
    for info in pkgutil.iter_modules(library.__path__):
        module = importlib.import_module(f"{library.__name__}.{info.name}")
        for spec in vars(module).values():
            if isinstance(spec, ModelSpec) and spec.published is not None:
                seen.setdefault(spec.name, spec)
    return sorted(seen.items())


def test_every_recipe_models_published_config_passes_its_schema():
    """Each recipe model's published config.json values (miles.recipes, typed in once with their
    source), over transformers' config class's defaults for the keys a recipe does not type in."""
    from transformers import AutoConfig

    checked = []
    for model, spec in _recipe_models():
        fam = family(spec.family)
        # the class's defaults for what the recipe does not type in, less the per-layer lists it
        # derives for its own default depth
        full = {
            k: v
            for k, v in AutoConfig.for_model(fam.tiny_model_type).to_dict().items()
            if k not in ("layer_types", "mlp_layer_types", "indexer_types", "local_layer_ids")
        }
        full.update(
            (k, list(v) if isinstance(v, tuple) else v) for k, v in spec.published.values
        )  # JSON lists
        try:
            fam.check_config(full)
        except ConfigRefused as exc:
            raise AssertionError(f"{model}: {exc}") from None
        checked.append(spec.family)
    assert set(checked) >= {"qwen3", "qwen3_moe", "glm_moe_dsa", "inkling", "deepseek_v4"}, checked


def test_make_tiny_refuses_a_dim_the_schema_refuses(tmp_path, capsys):
    rc = main(
        [
            "make-tiny",
            "--family",
            "deepseek_v4",
            "--out",
            str(tmp_path / "t"),
            "--dim",
            "num_experts_per_tok=9",
        ]
    )
    assert rc == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "num_experts_per_tok = 9: exceeds n_routed_experts = 8" in line, line
    assert not (tmp_path / "t").exists()


TORCH_DIST = [
    ("hidden_size a string", _set("hidden_size", "128"), "hidden_size = '128': must be a whole number >= 1"),
    ("top-k above the experts", _set("num_experts_per_tok", 9), "num_experts_per_tok = 9: exceeds n_routed_experts = 8"),
    ("per-layer list short", None, None),  # the family's first per-layer list (LISTS), one entry short
]  # fmt: skip


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("case, edit, said", TORCH_DIST, ids=[c[0] for c in TORCH_DIST])
def test_the_torch_dist_step_refuses_the_same_config_before_building(
    tiny, tmp_path, capsys, monkeypatch, name, case, edit, said
):
    """`prepare --plan-steps fetch,torch_dist` (validate left out of the plan, as a user may):
    the conversion checks the same schema before megatron-core builds anything."""
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "digest-cache"))
    if case == "per-layer list short":
        edit, said = _short(LISTS[name][0]), f"{LISTS[name][0]} = ["
    source = _with_config(tiny(name), tmp_path / "src", edit)
    models = tmp_path / "models"
    argv = ["prepare", "--quiet", "--family", name, "--model", "m", "--source", str(source), "--layers",
            str(LAYERS), "--model-dir", str(models), "--plan-steps", "fetch,torch_dist"]  # fmt: skip
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: torch_dist of m: ") and "config.json: " + said in line, line
    if case == "per-layer list short":
        assert "has 1 entries for num_hidden_layers = 2; write one entry per decoder layer" in line, line
    assert not (models / "m_torch_dist").exists()
