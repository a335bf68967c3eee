"""`python -m spark_drain`: the Spark drain job (see `spark_drain.job.main`)."""

import sys

from spark_drain.job import main

sys.exit(main())
