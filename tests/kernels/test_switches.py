"""kernels/switches.py's environment reads: ``getenv`` answers as ``os.environ.get`` does after every
way a test or a user changes the environment, and ``setting`` restores what was there."""
from __future__ import annotations

import os

import pytest

from megatron_moe.kernels import switches

NAME = "MEGATRON_MOE_TEST_SWITCH"


@pytest.mark.parametrize("value", [None, "", "0", "1", "é ü", "a=b"])
def test_getenv_reads_what_os_environ_reads(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    for default in (None, "1", ""):
        assert switches.getenv(NAME, default) == os.environ.get(NAME, default)


def test_getenv_follows_changes_after_its_first_read(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert switches.getenv(NAME, "d") == "d"
    os.environ[NAME] = "x"
    try:
        assert switches.getenv(NAME) == "x"
        monkeypatch.setenv(NAME, "y")
        assert switches.getenv(NAME) == "y"
    finally:
        os.environ.pop(NAME, None)
    assert switches.getenv(NAME) is None


def test_getenv_without_os_environs_table(monkeypatch):
    monkeypatch.setattr(os, "environ", {NAME: "plain"})
    assert switches.getenv(NAME) == "plain" and switches.getenv(NAME + "_UNSET", "d") == "d"


def test_switch_functions_see_a_setting(monkeypatch):
    monkeypatch.delenv("MEGATRON_MOE_ROUTER_GEMM", raising=False)
    assert switches.router_gemm()
    with switches.setting("MEGATRON_MOE_ROUTER_GEMM", False):
        assert not switches.router_gemm() and os.environ["MEGATRON_MOE_ROUTER_GEMM"] == "0"
    assert switches.router_gemm() and "MEGATRON_MOE_ROUTER_GEMM" not in os.environ
    monkeypatch.setenv("MEGATRON_MOE_ROUTER_GEMM", "0")
    with switches.setting("MEGATRON_MOE_ROUTER_GEMM", True):
        assert switches.router_gemm()
    assert os.environ["MEGATRON_MOE_ROUTER_GEMM"] == "0"


def test_wgrad_add_takes_its_ways_and_names_the_fix_for_others(monkeypatch):
    monkeypatch.delenv("MEGATRON_MOE_WGRAD_ADD", raising=False)
    assert switches.wgrad_add() == "prefetch4"
    for way in switches.WGRAD_ADD_WAYS:
        monkeypatch.setenv("MEGATRON_MOE_WGRAD_ADD", way)
        assert switches.wgrad_add() == way
    monkeypatch.setenv("MEGATRON_MOE_WGRAD_ADD", "prefetch3")
    with pytest.raises(ValueError, match="MEGATRON_MOE_WGRAD_ADD='prefetch3': expected one of prefetch4, atomic"):
        switches.wgrad_add()


@pytest.mark.parametrize("name", ["SORTED_DY", "SORTED_X"])
def test_sorted_rows_on_from_2048_rows_an_expert_unless_set(monkeypatch, name):
    var, rule = f"MEGATRON_MOE_{name}", getattr(switches, name.lower())
    monkeypatch.delenv(var, raising=False)
    rows = getattr(switches, f"{name}_MIN_ROWS") * 64
    assert rows == 2048 * 64
    assert rule(rows, 64) and not rule(rows - 1, 64)
    assert not rule(32768, 64)  # dmoe-small at micro-batch 32: 512 rows an expert
    assert rule(131072, 64)  # at micro-batch 128: 2,048
    assert not rule(0, 0)
    assert not rule(131072, 64, sm90=False)  # measured on sm_90 only
    monkeypatch.setenv(var, "auto")
    assert rule(rows, 64) and not rule(rows - 1, 64)
    monkeypatch.setenv(var, "1")
    assert rule(1, 64) and rule(1, 64, sm90=False)
    monkeypatch.setenv(var, "0")
    assert not rule(10 * rows, 64)
    monkeypatch.setenv(var, "yes")
    with pytest.raises(ValueError, match=f"{var}='yes': expected auto .* 1 .* or 0"):
        rule(rows, 64)


def test_peer_reads_takes_its_two_ways_and_names_them_for_others(monkeypatch):
    monkeypatch.delenv("MEGATRON_MOE_PEER_READS", raising=False)
    assert switches.peer_reads() == "one_launch"
    monkeypatch.setenv("MEGATRON_MOE_PEER_READS", "per_peer")
    assert switches.peer_reads() == "per_peer"
    monkeypatch.setenv("MEGATRON_MOE_PEER_READS", "1")
    with pytest.raises(ValueError) as e:
        switches.peer_reads()
    assert str(e.value) == "MEGATRON_MOE_PEER_READS='1': expected one_launch (the default) or per_peer"
