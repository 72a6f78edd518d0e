"""FP8 checkpoints as a GPU loader reads them: every quantized weight in an FP8 module, with its scale.

transformers loads an FP8 checkpoint by replacing each linear (and each fused experts
module) not listed in `modules_to_not_convert` with FP8Linear / FP8Experts before the
weights arrive, as SGLang does with its own modules. It does that only where it finds a
GPU of compute capability >= 8.9; anywhere else it dequantizes on load instead, which is
why the CPU path alone never showed that a list naming a decoder layer switches FP8 off for
the whole layer. These tests bypass exactly that check: while the quantizer validates its
environment, torch reports a CUDA device of capability 9.0 (no GPU can exist here).
Everything after it (module replacement, key renaming, scale loading) is transformers' own.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from miles.ci.register import register_cpu_ci
from miles.ckpt.families import LAYER_RE, family, mtp_prefixes, num_layers
from miles.ckpt.fp8 import dequantize_tensor
from miles.ckpt.plan import FAMILIES
from miles.ckpt.shards import CheckpointReader
from miles.families import family_of
from tests.support.ckpt import trunk_of

register_cpu_ci(est_time=3, suite="stage-b-cpu")


@contextlib.contextmanager
def gpu_capability_check_bypassed():
    """transformers' FP8 quantizer sees an H100-class GPU while it checks; nothing else does."""
    check = FineGrainedFP8HfQuantizer.validate_environment

    def validate(self, *args, **kwargs):
        with (
            mock.patch("torch.cuda.is_available", return_value=True),
            mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
        ):
            return check(self, *args, **kwargs)

    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", validate):
        yield


def _load(path, name: str):
    attention = "sdpa" if family(name).sdpa else "eager"
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=attention, output_loading_info=True, **trunk_of(path)
    )


def _is_mtp(name: str, config: dict) -> bool:
    """A tensor of an MTP layer, which transformers' classes do not build."""
    m = LAYER_RE.match(name)
    found = family_of(config)
    named = tuple(mtp_prefixes(config, found.mtp_style)) if found else ()  # MiMo's model.mtp_layers.*
    return bool(m and int(m["index"]) >= (num_layers(config) or 0)) or name.startswith(("mtp.", *named))


def _within_fp8_error(got: torch.Tensor, want: torch.Tensor, scale_grid: torch.Tensor) -> bool:
    # e4m3 keeps 3 mantissa bits: <= 2^-4 relative in the normal range, <= 2^-10 of the
    # tile's scale in the subnormal range.
    bound = torch.maximum(want.abs() * 2**-4, scale_grid * 2**-10) * (1 + 1e-6)
    return bool(torch.all((got - want).abs() <= bound))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_quantized_weight_lands_in_an_fp8_module_with_its_scale(tiny, fp8_of, name):
    out = fp8_of(name)
    config = json.loads((out / "config.json").read_text())
    with gpu_capability_check_bypassed():
        model, info = _load(out, name)
    unplaced = [k for k in info["unexpected_keys"] if not _is_mtp(k, config)]
    assert unplaced == [], "weights or scales no module took"
    assert not info["missing_keys"] and not info["mismatched_keys"]
    fp8_modules = {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    assert fp8_modules, "no module was replaced: modules_to_not_convert switched FP8 off"

    # Every e4m3 byte of the file sits in an e4m3 parameter of the model, every scale in a scale.
    with CheckpointReader(out) as reader:
        infos = [reader.info(n)[1] for n in reader.files.weight_map if not _is_mtp(n, config)]
    in_file = sum(i.numel for i in infos if i.dtype == "F8_E4M3")
    in_model = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert in_model == in_file

    # ...and reads back as the source's weights, within FP8's error.
    source, _ = _load(tiny(name), name)
    want = dict(source.named_parameters())
    for module_name, module in fp8_modules.items():
        for param_name, param in module.named_parameters(recurse=False):
            if param.dtype != torch.float8_e4m3fn:
                continue
            full = f"{module_name}.{param_name}"
            scale = getattr(module, param_name + "_scale_inv")
            got, grid = dequantize_tensor(param_name, param.data, scale.data, torch.float32, grid=True)
            assert _within_fp8_error(got, want[full].float(), grid), full
    for full, param in model.named_parameters():
        owner = full.rsplit(".", 1)[0]
        if owner not in fp8_modules:
            assert torch.equal(param, want[full]), f"{full} changed though it is not quantized"


def test_a_decoder_layer_with_its_own_fp32_parameter_is_never_listed(fp8_of):
    # DeepSeek-V4 keeps hc_attn_fn (fp32) on the decoder layer itself; naming the layer
    # would turn FP8 off for every linear in it.
    out = fp8_of("deepseek_v4")
    listed = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert not [m for m in listed if LAYER_RE.match(m + ".") and LAYER_RE.match(m + ".")["rest"] == ""]
    with CheckpointReader(out) as reader:
        quantized = [n for n in reader.files.weight_map if reader.info(n)[1].dtype == "F8_E4M3"]
    for module in listed:
        assert not [q for q in quantized if q.startswith(module + ".")], module
