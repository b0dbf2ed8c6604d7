"""The flags megatron-moe-megatron-lm-args prints pass Megatron-LM's own argument parsing and
validation (``megatron.training.arguments.parse_args`` and ``validate_args``, as pretrain_gpt.py
calls them), for every shipped config, and configure our layer as the config does.

    MEGATRON_LM=path/to/Megatron-LM pytest tests/megatron/test_megatron_lm_args_parse.py

Megatron-LM is not on PyPI and is not part of CI: without ``MEGATRON_LM`` (a source tree at
``core_v0.16.1``, or its ``megatron/training`` beside ``pretrain_gpt.py``) these tests skip.
Each config runs in its own process (Megatron's parser keeps global state), on the CPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_moe.megatron.yaml_config import find_config, shipped_configs
from megatron_moe.tools.megatron_lm_args import megatron_lm_command
from megatron_moe.training.run_config import load_config

MLM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(not MLM or not (Path(MLM) / "megatron" / "training").is_dir(),
                                reason="MEGATRON_LM does not name a Megatron-LM source tree")

PARSE = r"""
import json, sys
sys.argv = ["pretrain_gpt.py"] + json.loads(sys.argv[1])
from megatron.training.arguments import parse_args, validate_args
args = validate_args(parse_args(), {})
keys = ["num_experts", "moe_router_topk", "num_layers", "hidden_size", "ffn_hidden_size",
        "micro_batch_size", "global_batch_size", "train_iters", "save", "load", "spec", "transformer_impl"]
print("ARGS " + json.dumps({k: getattr(args, k) for k in keys}))
"""

OVERRIDES = ["train.train_iters=40", "train.lr_warmup_iters=10", "train.exit_interval=20"]


@pytest.mark.parametrize("name", shipped_configs())
def test_generated_flags_pass_megatron_lms_parser(name, tmp_path):
    cfg = load_config(find_config(name), OVERRIDES)
    if cfg.model.moe is not None and cfg.model.moe.mlp_impl == "capacity":
        pytest.skip("capacity-factor configs are our program's baseline, refused under Megatron-LM")
    flags, _, _ = megatron_lm_command(cfg, name, OVERRIDES, nproc=1, save=str(tmp_path / "ckpt"))
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    r = subprocess.run([sys.executable, "-c", PARSE, json.dumps(flags)], cwd=MLM, env=env,
                       capture_output=True, text=True, timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ARGS ")), None)
    assert r.returncode == 0 and line, f"{name}: Megatron-LM refused the flags:\n{r.stderr[-2000:]}"
    args = json.loads(line[5:])
    assert args["spec"] == ["megatron_moe.megatron.spec", "layer_spec"]
    assert args["transformer_impl"] == "local"
    assert (args["num_layers"], args["hidden_size"]) == (cfg.model.num_layers, cfg.model.hidden_size)
    assert (args["micro_batch_size"], args["global_batch_size"], args["train_iters"]) == (
        cfg.train.micro_batch_size, cfg.train.global_batch_size, 40)
    assert args["save"] == args["load"] == str(tmp_path / "ckpt")
    if cfg.model.moe is None:
        assert args["num_experts"] is None
    else:
        assert (args["num_experts"], args["moe_router_topk"]) == (cfg.model.moe.num_experts, cfg.model.moe.top_k)
