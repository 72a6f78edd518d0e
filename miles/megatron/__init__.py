"""The one adapter to megatron-core: everything miles asks of it goes through this package.

config.py maps a Hugging Face config to megatron-core's TransformerConfig (per family:
families/), spec.py and attention.py give the Transformer Engine layer spec with or without
TE (and context-parallel attention without it), model.py builds the GPTModel chunks,
hf_names.py and export.py say where every megatron weight comes from in the HF checkpoint
and hand the weights back under HF names, checkpoint.py reads and writes torch_dist,
training.py holds the parallel state, DDP, optimizer and schedules the training backend
drives, lora.py the adapters on its linear layers, routing.py rollout routing replay in its
routers, loss.py the vocabulary-parallel logprobs, proof.py and ranks.py run megatron-core's
rank grids under gloo, options.py says what the backend does with every Megatron flag, and
compat.py runs megatron-core's CPU-placed work on the CPU and binds its TE-only names without
TE: every place megatron-core is patched is there, under one `stale()` check (te_names.py finds
every TE-only name megatron-core reads). Nothing outside this package imports megatron-core;
importing the package itself imports nothing heavy.
"""

# The module this package wraps, for callers that only ask whether it is installed.
CORE_MODULE = "megatron.core"
# What a rank that builds GPTModel imports from it (the CPU launcher imports it before the fork).
MODEL_MODULE = CORE_MODULE + ".models.gpt"


def import_model_module() -> None:
    """Import MODEL_MODULE (a process that forks ranks or test processes does it once, before the fork)."""
    import megatron.core.models.gpt  # noqa: F401
