from miles.train.distributed import exit_process
from miles.train.trainer import main

exit_process(main())
