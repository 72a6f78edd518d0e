"""No code path miles reaches reads a name megatron-core defines only with Transformer Engine.

megatron-core 0.16.1 binds `te_general_gemm` (and the fused permutation functions) only when TE
imports, then reads `te_general_gemm` on every MoE router forward and backward: without TE,
and without the CPU shim, that was a NameError on the first MoE step on a GPU. The scan
(miles.megatron.te_names) reads the installed megatron-core's source with `ast`; every read of
a TE-only name must be guarded by megatron-core itself, be a None check of a name
miles binds to None (compat.MISSING_SYMBOLS, on every device), or sit in a function no miles
flag reaches (te_names.UNREACHED, with its reason). A megatron-core upgrade that adds one fails here.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.megatron import compat, te_names

register_cpu_ci(est_time=6, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def _fallbacks() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for module, name, _ in compat.MISSING_SYMBOLS:
        out.setdefault(module, []).append(name)
    return out


@functools.cache
def _uses() -> tuple[te_names.Use, ...]:
    return tuple(te_names.scan(te_names.installed_megatron_core())[1])


def test_every_te_only_name_megatron_core_reads_is_guarded_bound_or_unreached():
    found = [u for u in _uses() if not te_names.handled(u, _fallbacks())]
    assert found == [], "\n".join(map(str, found)) + (
        "\n(bind the name to None in compat.MISSING_SYMBOLS if megatron-core reads it as `is None`, "
        "or add the function to te_names.UNREACHED with the reason no miles flag reaches it)"
    )


def test_the_scan_finds_the_reads_that_broke_the_moe_router_without_te():
    uses = _uses()
    router = [u for u in uses if u.name == "te_general_gemm"]
    assert {u.function.split(":")[1] for u in router} == {
        "RouterGatingLinearFunction.forward",
        "RouterGatingLinearFunction.backward",
    }
    imports = {u.name for u in uses if u.kind == "import" and u.module.endswith("transformer_config")}
    assert "fused_permute" in imports and "fused_unpermute" in imports
    # without the bindings, none of them is acceptable
    assert all(not te_names.handled(u, {}) for u in router if u.none_checked)
    assert not [u for u in uses if u.kind == "import" and te_names.handled(u, {})]


def test_an_unguarded_read_is_reported_and_a_guarded_one_is_not(tmp_path):
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "layer.py").write_text(
        textwrap.dedent(
            """
            try:
                from transformer_engine.pytorch import fused_op
                HAVE_TE = True
            except ImportError:
                HAVE_TE = False

            def guarded(x):
                if HAVE_TE:
                    return fused_op(x)
                return x

            def checked_first(x):
                if not HAVE_TE:
                    raise ValueError("install TE")
                return fused_op(x)

            def forgotten(x):
                return fused_op(x)
            """
        )
    )
    (core / "user.py").write_text("from megatron.core.layer import fused_op\n")
    found = te_names.unhandled(core, {})
    assert [str(u) for u in found] == [
        "megatron/core/layer.py:19: forgotten reads fused_op unguarded",
        "megatron/core/user.py:1: <module> imports fused_op unguarded",
    ]
    assert te_names.unhandled(core, {"megatron.core.layer": ["fused_op"]})[0].kind == "read"


def test_every_unreached_entry_names_a_read_the_installed_release_has():
    keys = {u.key for u in _uses()}
    assert [k for k in te_names.UNREACHED if k not in keys] == []


def test_moe_routing_and_permute_fusion_work_without_te_and_without_the_cpu_redirects(tmp_path):
    # The GPU code path: the adapter is used without compat.install(); only the names megatron-core
    # reads as "None means absent" are bound. The router's GEMM then takes megatron-core's torch
    # fallback, and a TE-only switch gets megatron-core's own ValueError, not an ImportError.
    script = textwrap.dedent(
        """
        import warnings; warnings.simplefilter("ignore")
        import torch
        from miles.megatron import compat
        from miles.families.transformer import transformer_config
        config = {"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "moe_intermediate_size": 8,
                  "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300, "rms_norm_eps": 1e-6,
                  "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "dtype": "float32"}
        try:
            transformer_config(config, moe_permute_fusion=True)
            print("permute fusion accepted")
        except ValueError as exc:
            print("permute fusion:", exc)
        from megatron.core.transformer.moe.moe_utils import router_gating_linear
        x = torch.randn(5, 8, requires_grad=True)
        w = torch.randn(4, 8, requires_grad=True)
        out = router_gating_linear(x, w, None, torch.float32)
        out.sum().backward()
        print("router", torch.allclose(out, x @ w.t()), torch.allclose(x.grad, torch.ones(5, 4) @ w))
        print("redirects installed", compat._process_on_cpu)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "permute fusion: fused permutation is not available. Please install TE >= 2.1.0.",
        "router True True",
        "redirects installed False",
    ]
