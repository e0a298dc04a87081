"""weft training: `torchrun --nproc_per_node=N train.py --job.config_file X.toml [--section.key value ...]`.

Also runs as a single process: `python train.py --job.config_file X.toml`.
"""

import sys

from trainer.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
