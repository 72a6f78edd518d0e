import sys

from miles.train.trainer import main

sys.exit(main())
