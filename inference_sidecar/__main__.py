"""``python -m inference_sidecar``: same as the ``inference-sidecar`` command."""

import sys

from inference_sidecar.cli import main

sys.exit(main())
