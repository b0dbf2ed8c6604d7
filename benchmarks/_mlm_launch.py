"""Run Megatron-LM's pretrain_gpt.py (argv[1]) with the rest of argv, for benchmarks/megatron_lm.py.

megatron-core 0.16.1's MoE router (moe_utils.RouterGatingLinearFunction) tests
``te_general_gemm is not None``, a name that module defines only when Transformer Engine imports:
without it, megatron-core's own MoE layer fails with a NameError. Defining it as None selects the
router's torch.mm path, as the test intends. Nothing else is changed.
"""
import runpy
import sys
from pathlib import Path

import megatron.core.transformer.moe.moe_utils as moe_utils

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

script = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(script.parent))  # pretrain_gpt.py imports gpt_builders, model_provider beside it
sys.argv = [str(script)] + sys.argv[2:]
runpy.run_path(str(script), run_name="__main__")
