"""miles: keeps one RL post-training stack green on NVIDIA and AMD runners at once."""

__version__ = "0.1.0"
