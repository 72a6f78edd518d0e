import os
import sys

from miles.train.trainer import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# End without running C++ static destructors: torch's gloo process groups occasionally leave a
# joinable thread behind that aborts the process at exit (std::terminate, about one run in 16
# on two CPU ranks), turning a finished run into a failed one. Everything the run writes
# (checkpoints, metric records) is complete and closed before main() returns.
os._exit(code)
