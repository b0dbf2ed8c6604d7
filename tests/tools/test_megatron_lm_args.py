"""megatron-moe-megatron-lm-args: the printed Megatron-LM flags describe the config's model.

    pytest tests/tools/test_megatron_lm_args.py      # a few seconds

Reference: the flags are read back the way Megatron-LM's arguments.py turns them into a
TransformerConfig (a table written here from its source, core_v0.16.1), and our layer's own
resolution (flags.py) of that TransformerConfig with the printed environment must give the
config's ModelConfig exactly; the training flags must carry the config's values.
"""
import shlex

import pytest
import torch.nn.functional as F

from megatron_moe.training.run_config import load_config
from megatron_moe.tools import megatron_lm_args as tool

CONFIGS = ["tiny-cpu", "gpt-xs", "dmoe-xs", "moe-xs", "gpt-small", "dmoe-small", "moe-small", "dmoe-medium"]

# flag -> TransformerConfig field (value flags), as core_transformer_config_from_args maps them
VALUE_FIELDS = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size", "--num-attention-heads": "num_attention_heads",
    "--ffn-hidden-size": "ffn_hidden_size", "--init-method-std": "init_method_std",
    "--attention-dropout": "attention_dropout", "--hidden-dropout": "hidden_dropout",
    "--num-experts": "num_moe_experts", "--moe-router-topk": "moe_router_topk",
    "--moe-router-score-function": "moe_router_score_function", "--moe-aux-loss-coeff": "moe_aux_loss_coeff",
    "--moe-router-load-balancing-type": "moe_router_load_balancing_type", "--moe-z-loss-coeff": "moe_z_loss_coeff",
    "--moe-ffn-hidden-size": "moe_ffn_hidden_size", "--moe-layer-freq": "moe_layer_freq",
    "--moe-input-jitter-eps": "moe_input_jitter_eps", "--moe-router-bias-update-rate": "moe_router_bias_update_rate",
    "--moe-shared-expert-intermediate-size": "moe_shared_expert_intermediate_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
}
SWITCH_FIELDS = {"--moe-router-pre-softmax": "moe_router_pre_softmax",
                 "--moe-router-enable-expert-bias": "moe_router_enable_expert_bias"}


def parse(flags: list[str]) -> dict:
    """The flags as {flag: value or True}."""
    out, i = {}, 0
    while i < len(flags):
        name = flags[i]
        assert name.startswith("--"), (name, flags)
        if name == "--spec":
            out[name] = flags[i + 1:i + 3]
            i += 3
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[name] = flags[i + 1]
            i += 2
        else:
            out[name] = True
            i += 1
    return out


def transformer_config(args: dict):
    """The TransformerConfig Megatron-LM would build from these flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {"use_cpu_initialization": True}
    for flag, field in VALUE_FIELDS.items():
        if flag in args:
            text = args[flag]
            fields[field] = int(text) if text.lstrip("-").isdigit() else (
                float(text) if text.replace(".", "", 1).replace("e-", "", 1).isdigit() else text)
    for flag, field in SWITCH_FIELDS.items():
        fields[field] = flag in args
    if "--swiglu" in args:
        fields.update(gated_linear_unit=True, activation_func=F.silu)
    else:
        fields.update(activation_func=F.gelu)
    if "num_moe_experts" in fields and "moe_ffn_hidden_size" not in fields:
        fields["moe_ffn_hidden_size"] = fields["ffn_hidden_size"]  # arguments.py's default
    return TransformerConfig(**fields)


@pytest.mark.parametrize("config, overrides", [(c, []) for c in CONFIGS] + [
    ("dmoe-xs", ["model.moe.top_k=2", "model.moe.normalize_top_k=true", "model.moe.mlp_impl=torch_grouped_mm"]),
    ("dmoe-xs", ["model.moe.score_function=sigmoid", "model.moe.expert_bias=true", "model.moe.z_loss_coeff=0.001",
                 "model.moe.moe_layer_freq=2", "model.moe.expert_parallel_size=8", "model.activation=swiglu"]),
    ("moe-xs", ["model.moe.capacity_factor=2.0", "model.moe.aux_loss_coeff=0"]),
])
def test_the_flags_and_environment_rebuild_the_configs_model(config, overrides, monkeypatch):
    from megatron_moe.megatron import flags as megatron_flags
    from megatron_moe.megatron import spec

    cfg = load_config(config, overrides)
    flags, env, notes = tool.megatron_lm_command(cfg, config, overrides, nproc=1)
    args = parse(flags)
    assert args["--spec"] == ["megatron_moe.megatron.spec", "layer_spec"]
    assert args["--transformer-impl"] == "local" and "--no-gradient-accumulation-fusion" in args
    assert ("--num-experts" in args) == (cfg.model.moe is not None)
    for var in ("MEGATRON_MOE_CONFIG", "MEGATRON_MOE_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec._env_config_cache.clear()
    ours, source = spec._env_model_section()
    model = megatron_flags.resolve_model_config(transformer_config(args), ours, source)
    assert model == cfg.model
    # training: the config's values
    tc = cfg.train
    assert (int(args["--micro-batch-size"]), int(args["--global-batch-size"]), int(args["--train-iters"])) == \
        (tc.micro_batch_size, tc.global_batch_size, tc.train_iters)
    assert (float(args["--lr"]), float(args["--min-lr"]), int(args["--lr-warmup-iters"])) == \
        (tc.lr, tc.min_lr, tc.lr_warmup_iters)
    assert (float(args["--weight-decay"]), float(args["--adam-beta2"]), float(args["--clip-grad"])) == \
        (tc.weight_decay, tc.adam_beta2, tc.clip_grad)
    assert ("--bf16" in args) == tc.bf16 and int(args["--seq-length"]) == cfg.model.seq_length
    assert args["--mock-data"] is True and int(args["--vocab-size"]) == cfg.model.vocab_size - 1
    assert notes and "--mock-data stands in" in notes[0]


def test_a_sigmoid_router_megatron_cannot_express_is_refused():
    cfg = load_config("dmoe-xs", ["model.moe.score_function=sigmoid", "model.moe.top_k=2",
                                  "model.moe.normalize_top_k=false"])
    with pytest.raises(ValueError, match="model.moe.normalize_top_k=False with score_function='sigmoid'"):
        tool.megatron_lm_command(cfg, "dmoe-xs")


def test_cli_prints_a_command_and_a_flag_list(capsys):
    assert tool.main(["dmoe-xs", "--nproc", "4", "model.moe.top_k=2"]) == 0
    out = capsys.readouterr()
    words = shlex.split(out.out.replace("\\\n", " "))
    assert words[:2] == ["MEGATRON_MOE_CONFIG=dmoe-xs", "MEGATRON_MOE_OVERRIDES=model.moe.top_k=2"]
    assert words[2:6] == ["torchrun", "--nproc-per-node", "4", "pretrain_gpt.py"]
    assert words[words.index("--moe-router-topk") + 1] == "2"
    assert "--mock-data stands in" in out.err
    assert tool.main(["gpt-xs", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "MEGATRON_MOE_CONFIG=gpt-xs" and "--num-experts" not in lines


def test_save_gives_megatrons_save_and_load_of_one_folder(capsys):
    assert tool.main(["dmoe-xs", "--nproc", "1", "--save", "ckpt dir"]) == 0
    words = shlex.split(capsys.readouterr().out.replace("\\\n", " "))
    assert words[words.index("--save") + 1] == words[words.index("--load") + 1] == "ckpt dir"
    assert tool.main(["dmoe-xs", "--list"]) == 0
    assert "--save" not in capsys.readouterr().out.split()


def test_cli_bad_config_is_one_line(capsys):
    assert tool.main(["dmoe-xs", "model.moe.top_k=99"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.moe.top_k=99" in err[0]


def test_data_prefix_gives_megatrons_data_and_tokenizer_flags(tmp_path):
    model = tmp_path / "tok.model"
    model.write_text("")
    for f in ("d.bin", "d.idx"):
        (tmp_path / f).write_text("")
    cfg = load_config("dmoe-xs", ["data.paths=[]", f"data.data_prefix={tmp_path / 'd'}",
                                  f"data.tokenizer_model={model}"])
    flags, _, notes = tool.megatron_lm_command(cfg, "dmoe-xs")
    args = parse(flags)
    assert args["--data-path"] == str(tmp_path / "d") and args["--split"] == cfg.data.split
    assert args["--tokenizer-type"] == "GPTSentencePieceTokenizer" and args["--tokenizer-model"] == str(model)
    assert "--mock-data" not in args and not notes
