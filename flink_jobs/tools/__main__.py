import sys

from flink_jobs.tools.cli import main

sys.exit(main())
