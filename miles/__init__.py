"""miles: keeps one RL post-training stack green on NVIDIA and AMD runners at once."""

# Under the CI runner this times the process's start-up and imports (miles/phases.py); else inert.
from miles import phases as _phases  # noqa: F401
from miles.megatron.compat import eager_fusions_without_cuda as _eager_fusions

# megatron-core compiles its fusions with torch.compile at import; without CUDA they run eagerly
# (miles.megatron.compat, PATCHES: its jit module), which must be decided before that import.
_eager_fusions()

__version__ = "0.1.0"
