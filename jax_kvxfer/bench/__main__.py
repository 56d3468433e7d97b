"""`python -m jax_kvxfer.bench [options]`: runs the transfer benchmark."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
