"""``python -m megatron_moe.training`` (and ``torchrun ... -m megatron_moe.training``): the trainer."""
import sys

from .train import main

sys.exit(main())
