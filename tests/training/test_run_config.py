"""Run configs: every file in configs/ loads; base inheritance; overrides; each error's message.

    pytest tests/training/test_run_config.py -q
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from megatron_moe.megatron.model_config import ModelConfig, MoESection
from megatron_moe.training.run_config import (ConfigError, LoggingConfig, RunConfig, TrainConfig,
                                     config_from_dict, load_config)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = textwrap.dedent("""
    model:
      num_layers: 2
      hidden_size: 64
      num_attention_heads: 4
      ffn_hidden_size: 256
      seq_length: 32
      vocab_size: 512
""")


# ----------------------------------------------------------------------------- shipped configs


def test_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert "tiny-cpu" in names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.model, ModelConfig)
    assert isinstance(cfg.train, TrainConfig) and isinstance(cfg.logging, LoggingConfig)
    assert cfg.name == (yaml.safe_load(path.read_text()).get("name") or path.stem)
    # --print-config output loads back to the same config
    dumped = write(tmp_path / "dumped.yaml", cfg.to_yaml())
    assert load_config(dumped) == cfg


def test_tiny_cpu_is_the_small_moe_default():
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (2, 128, 4, 512)
    assert m.moe is not None and (m.moe.num_experts, m.moe.top_k) == (8, 2)
    assert m.vocab_size >= cfg.data.tokenizer_vocab_size
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0
    assert cfg.logging.wandb is True


# ----------------------------------------------------------------------------- inheritance


def test_base_inheritance_deep_merges_and_name_is_not_inherited(tmp_path):
    write(tmp_path / "base.yaml", """
        name: the-base
        model:
          num_layers: 2
          hidden_size: 64
          num_attention_heads: 4
          ffn_hidden_size: 256
          seq_length: 32
          vocab_size: 512
          moe:
            num_experts: 8
            top_k: 2
        train:
          lr: 1.0e-3
          train_iters: 50
          lr_warmup_iters: 5
    """)
    child = write(tmp_path / "sub" / "child.yaml", """
        base: ../base.yaml
        model:
          num_layers: 4
          moe:
            top_k: 1
        train:
          lr: 5e-4
    """)
    cfg = load_config(child)
    assert cfg.name == "child"  # the file's stem: a base's name is never inherited
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 64
    assert cfg.model.moe == MoESection(num_experts=8, top_k=1)
    assert cfg.train.lr == 5e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.train_iters == 50
    assert cfg.train.micro_batch_size == TrainConfig().micro_batch_size  # default


def test_base_chain_and_null_replaces_a_section(tmp_path):
    write(tmp_path / "a.yaml", MINIMAL + "  moe: {num_experts: 4}\n")
    write(tmp_path / "b.yaml", "base: a.yaml\nname: bee\ntrain: {seed: 7}\n")
    c = write(tmp_path / "c.yaml", "base: b.yaml\nmodel: {moe: null}\n")
    cfg = load_config(c)
    assert cfg.name == "c" and cfg.train.seed == 7 and cfg.model.moe is None


def test_base_cycle_is_detected(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n" + MINIMAL)
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_missing_base(tmp_path):
    p = write(tmp_path / "a.yaml", "base: nope.yaml\n" + MINIMAL)
    with pytest.raises(ConfigError, match=r"base config 'nope\.yaml' does not exist: neither a file relative "
                                          r"to this one \(.*nope\.yaml\) nor a shipped config \(shipped: .*tiny-cpu"):
        load_config(p)


# ----------------------------------------------------------------------------- overrides


def test_overrides_parse_as_yaml(tmp_path):
    p = write(tmp_path / "run.yaml", MINIMAL)
    cfg = load_config(p, ["train.lr=3e-4", "train.train_iters=20", "train.lr_warmup_iters=2",
                          "model.moe.num_experts=16", "model.moe.top_k=2",
                          "data.paths=[a.txt, b.jsonl]", "name=my-run", "logging.wandb=false",
                          "train.lr_decay_iters=null", "logging.wandb_group=sweep"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.train_iters == 20
    assert cfg.model.moe.num_experts == 16 and cfg.model.moe.top_k == 2  # created from null
    assert cfg.data.paths == ["a.txt", "b.jsonl"]
    assert cfg.name == "my-run" and cfg.logging.wandb is False
    assert cfg.logging.wandb_group == "sweep" and cfg.train.lr_decay_iters is None


def test_override_null_makes_dense(tmp_path):
    p = write(tmp_path / "run.yaml", MINIMAL + "  moe: {num_experts: 4}\n")
    assert load_config(p, ["model.moe=null"]).model.moe is None


def test_int_is_accepted_for_float_fields_but_not_the_reverse(tmp_path):
    p = write(tmp_path / "run.yaml", MINIMAL)
    assert load_config(p, ["train.clip_grad=2"]).train.clip_grad == 2.0
    with pytest.raises(ConfigError, match=r"train\.train_iters=10\.5 has the wrong type: expected an int"):
        load_config(p, ["train.train_iters=10.5"])


def test_config_from_dict_matches_load_config(tmp_path):
    p = write(tmp_path / "x.yaml", MINIMAL)
    cfg = load_config(p)
    assert config_from_dict(cfg.to_dict()) == cfg
    assert config_from_dict(cfg.to_dict(), ["train.seed=3"]).train.seed == 3


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("override, message", [
    ("trian.lr=1e-3", r"unknown key 'trian': did you mean 'train'\?"),
    ("train.lrr=1e-3", r"unknown key 'train\.lrr': did you mean 'train\.lr'\?"),
    ("model.moe.num_expert=8", r"model\.moe\.num_expert.*did you mean.*model\.moe\.num_experts"),
    ("logging.wandb_projekt=x", r"did you mean 'logging\.wandb_project'"),
    ("train.zzz=1", r"unknown key 'train\.zzz': valid keys in 'train' are micro_batch_size, "),
    ("train.micro_batch_size=eight", r"train\.micro_batch_size='eight' has the wrong type: expected an int"),
    ("train.bf16=1", r"train\.bf16=1 has the wrong type: expected true or false"),
    ("train.overlap_grad_reduce=sometimes", r"train\.overlap_grad_reduce='sometimes' has the wrong type"),
    ("train.grad_accumulation_fusion=2",
     r"train\.grad_accumulation_fusion=2 has the wrong type: expected true or false"),
    ("train.fused_optimizer=fast", r"train\.fused_optimizer='fast' has the wrong type: expected true or false"),
    ("data.default_corpus_mb=-5", r"data\.default_corpus_mb=-5.*positive number of megabytes"),
    ("logging.wandb=yes please", r"logging\.wandb='yes please' has the wrong type"),
    ("train.lr=fast", r"train\.lr='fast' has the wrong type: expected a number"),
    ("model.hidden_size=[64]", r"model\.hidden_size=\[64\] has the wrong type"),
    ("data.paths=7", r"data\.paths=7 has the wrong type: expected a list of a string"),
    ("train.global_batch_size=12", r"train\.global_batch_size=12 is invalid: expected a multiple of "
                                   r"train\.micro_batch_size \(8\)"),
    ("train.min_lr=1.0", r"train\.min_lr=1\.0 is invalid: expected <= train\.lr"),
    ("train.adam_beta2=1.0", r"train\.adam_beta2=1\.0 is invalid: expected a number in \[0, 1\)"),
    ("train.lr_warmup_iters=5000", r"train\.lr_warmup_iters=5000 is invalid: expected <= the decay length"),
    ("train.micro_batch_size=0", r"train\.micro_batch_size=0 is invalid: expected an int >= 1"),
    ("train.exit_interval=0", r"train\.exit_interval=0 is invalid"),
    ("logging.wandb_mode=maybe", r"logging\.wandb_mode='maybe' is invalid: expected one of"),
    ("name=a/b", r"name='a/b' is invalid"),
    ("model.num_attention_heads=3", r"model\.num_attention_heads=3"),
    ("model.moe.top_k=99", r"model\.moe\.top_k=99"),
    ("model.hidden_size.x=1", r"override 'model\.hidden_size\.x=1' is invalid: model\.hidden_size is a value"),
    ("train.lr.x=1", r"train\.lr=\{'x': 1\} has the wrong type: expected a number"),
    ("train.lr", r"override 'train\.lr' is invalid: expected key=value"),
    ("base=x.yaml", r"base can only be set inside a config file"),
    ("train..lr=1", r"expected a dotted key"),
])
def test_errors_name_the_key(tmp_path, override, message):
    p = write(tmp_path / "run.yaml", MINIMAL + "  moe: {num_experts: 8}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(p, [override])


@pytest.mark.parametrize("overrides, message", [
    (["train.adam_moments_dtype=fp16"], r"train\.adam_moments_dtype='fp16' is invalid: expected one of "
                                       r"\('fp32', 'bf16'\)"),
    (["train.adam_moments_dtype=bf16", "train.fused_optimizer=false"],
     r"train\.adam_moments_dtype='bf16' is invalid: expected fp32 with train\.fused_optimizer=false"),
    (["train.adam_moments_dtype=bf16", "train.adam_beta2=0.999"],
     r"train\.adam_beta2=0\.999 is invalid: expected <= 0\.99 with train\.adam_moments_dtype=bf16 .*"
     r"measured 8% off at 0\.995, 44% at 0\.999\): lower train\.adam_beta2 or set train\.adam_moments_dtype=fp32"),
])
def test_bf16_moments_errors(tmp_path, overrides, message):
    p = write(tmp_path / "run.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=message):
        load_config(p, overrides)
    ok = load_config(p, ["train.adam_moments_dtype=bf16", "train.adam_beta2=0.99"]).train
    assert ok.adam_moments_dtype == "bf16" and load_config(p).train.adam_moments_dtype == "fp32"


def test_unknown_key_in_file(tmp_path):
    p = write(tmp_path / "run.yaml", MINIMAL + "trian:\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trian': did you mean 'train'\?"):
        load_config(p)


def test_missing_file_bad_yaml_non_mapping_duplicates(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = write(tmp_path / "bad.yaml", "model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(bad)
    lst = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of sections"):
        load_config(lst)
    dup = write(tmp_path / "dup.yaml", MINIMAL + "train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr'"):
        load_config(dup)


def test_section_must_be_a_mapping(tmp_path):
    p = write(tmp_path / "run.yaml", MINIMAL + "train: 5\n")
    with pytest.raises(ConfigError, match=r"train=5 has the wrong type: expected a mapping"):
        load_config(p)


def test_print_config_cli(tmp_path, capsys):
    from megatron_moe.training.train import main

    p = write(tmp_path / "run.yaml", MINIMAL)
    assert main(["--config", str(p), "--print-config", "train.seed=99", "name=printed"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["name"] == "printed" and printed["train"]["seed"] == 99
    assert config_from_dict(printed) == load_config(p, ["train.seed=99", "name=printed"])


def test_cli_config_error_exits_2_with_one_line(tmp_path, capsys):
    from megatron_moe.training.train import main

    p = write(tmp_path / "run.yaml", MINIMAL)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(p), "train.lrr=1", "--print-config"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean 'train.lr'" in err and len(err.strip().splitlines()) == 1


def test_every_config_key_is_documented_with_its_default():
    """docs/configuration.md lists each section's keys with their defaults: a key added, removed
    or given another default in the code fails here until the page says the same."""
    import dataclasses
    import re

    import yaml

    from megatron_moe.megatron.model_config import ModelConfig, MoESection
    from megatron_moe.megatron.yaml_config import _Loader
    from megatron_moe.training.data import DataConfig
    from megatron_moe.training.run_config import LoggingConfig, TrainConfig

    doc = (REPO / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", doc, flags=re.M))
    want = {}
    for prefix, cls in (("model", ModelConfig), ("model.moe", MoESection), ("train", TrainConfig),
                        ("data", DataConfig), ("logging", LoggingConfig)):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            want[f"{prefix}.{f.name}"] = default
    documented = {k: v for k, v in rows.items() if k.split(".")[0] in ("model", "train", "data", "logging")}
    assert sorted(documented) == sorted(want)
    for key, default in want.items():
        assert yaml.load(documented[key], Loader=_Loader) == default, (key, documented[key], default)
