"""`python -m tidal.cli ...`: the `tidal` command, as torchrun, mpirun and srun start it."""

import sys

from tidal.cli import main

sys.exit(main())
