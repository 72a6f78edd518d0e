"""The Megatron training backend: megatron-core GPTModel, DDP and distributed optimizer.

backend.py is the TrainBackend, model.py builds and loads the model, loss.py computes logprobs
on vocabulary-parallel logits, weights.py streams HF weights to the rollout engine, and
compat.py lets megatron-core run on a machine without a GPU.
"""
