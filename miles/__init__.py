"""miles: keeps one RL post-training stack green on NVIDIA and AMD runners at once."""

# Under the CI runner this times the process's start-up and imports (miles/phases.py); else inert.
from miles import phases as _phases  # noqa: F401

__version__ = "0.1.0"
