import atexit
import os
import sys

from miles.train.trainer import main

code = main()
# Python's own exit work runs as usual: multiprocessing shuts down the helper processes it
# started (megatron's checkpoint writer keeps a Manager server alive; left running, it holds
# the caller's stdout/stderr pipes open and a parent reading them waits forever).
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
# Then end without C++ static destructors: torch's gloo process groups occasionally leave a
# joinable thread behind that aborts the process at exit (std::terminate, about one run in 16
# on two CPU ranks), turning a finished run into a failed one. Everything the run writes
# (checkpoints, metric records) is complete and closed before main() returns.
os._exit(code)
