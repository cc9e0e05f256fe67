"""``python -m inference_sidecar``: same as the ``inference-sidecar`` command.

The guard matters: the router's tokenizer processes are spawned, and a spawned process
imports this module again (as ``__mp_main__``), where it must not start a router.
"""

import sys

from inference_sidecar.cli import main

if __name__ == "__main__":
    sys.exit(main())
