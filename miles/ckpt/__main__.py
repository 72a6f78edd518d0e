import sys

from miles.ckpt.cli import main

sys.exit(main())
