"""Tuned configs kept on disk (kernels/tuning.py) through the grouped GEMMs' launcher.

    pytest tests/kernels/test_tuning.py      # a second, no GPU

The launcher (kernels/grouped.py ``_launch``) is driven with a stand-in for Triton's autotuner
that counts its tunings and records each launch's config; a "new process" is the launcher's and
the tuning module's in-memory caches cleared. Checked: the first process tunes and stores; the
next launches the stored config without tuning (its pre-hook run, as the autotuner would); a
changed kernel, candidate list or A/B switch, an entry naming no candidate, a corrupt file, storing turned
off: tuning again; the shipped table; entries of two processes merged; an unwritable folder. And
every table shipped in kernels/tuned/ still serves the current kernels (an edited kernel makes its
entries stale: a fresh machine would tune again).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from megatron_moe.kernels import grouped, tuning


class FakeJIT:
    """The JIT function: records the launch settings it is called with."""

    def __init__(self, name="_fake_kernel", src="def _fake_kernel(x, BLOCK: tl.constexpr): pass"):
        self.__name__, self.src, self.launches = name, src, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


class FakeAutotuner:
    """Triton's Autotuner as the launcher uses it: ``configs``, ``fn``, ``cache``, ``best_config``,
    ``arg_names``; a launch tunes once per key (choosing ``configs[best]``), then reuses it."""

    def __init__(self, configs, fn, best=1):
        self.configs, self.fn, self.best = configs, fn, best
        self.cache, self.best_config, self.arg_names, self.tunings = {}, None, ["x"], 0

    def __getitem__(self, grid):
        def run(*args, **meta):
            key = tuple(sorted(meta.items()))
            if key not in self.cache:
                self.tunings += 1
                self.cache[key] = self.configs[self.best]
            self.best_config = self.cache[key]
            self.fn[grid](*args, **meta, **self.best_config.all_kwargs())
        return run


hooked = []


def configs(n=3):
    return [triton.Config({"BLOCK": 16 << i}, num_warps=4, num_stages=2 + i, pre_hook=hooked.append)
            for i in range(n)]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A tuning folder of its own, the launcher out of the interpreter's path, fresh caches."""
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "tuning"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(grouped, "interpret_mode", lambda: False)
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    new_process()
    hooked.clear()
    yield tmp_path
    new_process()


def new_process():
    grouped._TUNED.clear()
    grouped._HOT.clear()
    tuning._tables.clear()


def launch(kernel, meta=None, tune_key=(64, 128)):
    grouped._launch(kernel, lambda m: (1,), (torch.zeros(4),), meta or {"EPILOGUE": "gelu"}, tune_key, {})


def stored(env):
    files = list((env / "tuning").glob("*.json"))
    return json.loads(files[0].read_text())["entries"] if files else {}


def test_a_later_process_launches_the_stored_config_without_tuning(env, capsys):
    first = FakeAutotuner(configs(), FakeJIT())
    launch(first)
    launch(first)
    assert first.tunings == 1 and first.fn.launches[-1]["BLOCK"] == 32
    assert "tuned _fake_kernel K=64 N=128 EPILOGUE=gelu" in capsys.readouterr().err
    (entry,) = stored(env).values()
    assert entry["config"] == {"BLOCK": 32, "num_ctas": 1, "num_stages": 3, "num_warps": 4}
    assert (env / "tuning" / "cpu-triton{}.json".format(triton.__version__)).exists()

    new_process()
    second = FakeAutotuner(configs(), FakeJIT(), best=2)  # would choose another config if it tuned
    hooked.clear()
    launch(second)
    launch(second)
    assert second.tunings == 0 and second.best_config is second.configs[1]
    assert [k["BLOCK"] for k in second.fn.launches] == [32, 32]
    assert [h["BLOCK"] for h in hooked] == [32, 32]  # the config's pre-hook, as the autotuner runs it
    assert capsys.readouterr().err == ""


def test_the_report_counts_the_candidates_the_prune_left(env, capsys):
    """Triton's autotuner times what its prune keeps (``configs_timings``): the report says how
    many of the candidates that was."""
    k = FakeAutotuner(configs(4), FakeJIT())
    k.configs_timings = {c: [1.0] for c in k.configs[:3]}
    launch(k)
    assert "(3 of 4 candidates timed)" in capsys.readouterr().err
    k = FakeAutotuner(configs(4), FakeJIT())  # an autotuner without the attribute: the list's length,
    launch(k, tune_key=(64, 256))  # not a count of what was timed (unknown)
    err = capsys.readouterr().err
    assert "(of 4 candidates)" in err and "timed" not in err


def test_every_launch_key_is_stored_and_only_tunings_reported(env, capsys):
    k = FakeAutotuner(configs(), FakeJIT())  # its own key: the meta-parameters alone
    launch(k, tune_key=(64, 128))
    launch(k, tune_key=(64, 256))  # the autotuner's choice for its key serves: no tuning
    launch(k, meta={"EPILOGUE": "dgelu"})
    assert k.tunings == 2 and len(stored(env)) == 3
    assert capsys.readouterr().err.count("megatron-moe: tuned") == 2


@pytest.mark.parametrize("change", ["source", "candidates", "switch"])
def test_a_changed_kernel_candidate_list_or_switch_tunes_again(env, change, monkeypatch):
    monkeypatch.delenv("MEGATRON_MOE_TMA_ADD", raising=False)
    launch(FakeAutotuner(configs(), FakeJIT()))
    new_process()
    if change == "switch":  # an A/B switch the prune functions read
        monkeypatch.setenv("MEGATRON_MOE_TMA_ADD", "0")
    fn = FakeJIT(src="def _fake_kernel(x, BLOCK: tl.constexpr): x += 1") if change == "source" else FakeJIT()
    again = FakeAutotuner(configs(4 if change == "candidates" else 3), fn)
    launch(again)
    assert again.tunings == 1 and len(stored(env)) == 2


def test_an_entry_naming_no_candidate_is_ignored(env):
    launch(FakeAutotuner(configs(), FakeJIT()))
    path = next((env / "tuning").glob("*.json"))
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["config"]["BLOCK"] = 48
    path.write_text(json.dumps(data))
    new_process()
    again = FakeAutotuner(configs(), FakeJIT())
    launch(again)
    assert again.tunings == 1 and next(iter(stored(env).values()))["config"]["BLOCK"] == 32


def test_a_corrupt_file_is_ignored_and_replaced(env, capsys):
    folder = env / "tuning"
    folder.mkdir()
    (folder / "cpu-triton{}.json".format(triton.__version__)).write_text('{"entries": {"a":')
    k = FakeAutotuner(configs(), FakeJIT())
    launch(k)
    assert k.tunings == 1 and "ignoring the tuning file" in capsys.readouterr().err
    assert len(stored(env)) == 1  # a valid file again


def test_storing_off_tunes_in_every_process(env, monkeypatch):
    monkeypatch.setenv(tuning.ENV, "0")
    for _ in range(2):
        new_process()
        k = FakeAutotuner(configs(), FakeJIT())
        launch(k)
        assert k.tunings == 1
    assert not (env / "tuning").exists()


def test_the_shipped_table_serves_a_fresh_machine(env):
    launch(FakeAutotuner(configs(), FakeJIT()))
    (env / "tuning").rename(env / "shipped")  # what a GPU run stored, shipped with the package
    new_process()
    k = FakeAutotuner(configs(), FakeJIT(), best=0)
    launch(k)
    assert k.tunings == 0 and k.fn.launches[-1]["BLOCK"] == 32


def test_shipped_tables_off_tunes_again(env, monkeypatch):
    launch(FakeAutotuner(configs(), FakeJIT()))
    (env / "tuning").rename(env / "shipped")
    new_process()
    monkeypatch.setenv("MEGATRON_MOE_TUNING_SHIPPED", "0")
    k = FakeAutotuner(configs(), FakeJIT(), best=0)
    launch(k)
    assert k.tunings == 1 and k.fn.launches[-1]["BLOCK"] == 16


def test_entries_of_two_processes_are_merged(env):
    a = FakeAutotuner(configs(), FakeJIT())
    launch(a, tune_key=(64, 128))
    tuning._tables.clear()  # another process: it read the file before the first one wrote
    tuning._tables[next((env / "tuning").glob("*.json"))] = {}
    b = FakeAutotuner(configs(), FakeJIT())
    launch(b, tune_key=(32, 32))
    assert len(stored(env)) == 2


def test_a_single_candidate_is_neither_tuned_nor_stored(env):
    k = FakeAutotuner(configs(1), FakeJIT(), best=0)
    launch(k)
    assert not (env / "tuning").exists()


def test_an_unwritable_folder_warns_and_runs(env, monkeypatch, capsys):
    blocker = env / "file"
    blocker.write_text("")
    monkeypatch.setenv(tuning.ENV, str(blocker))  # a file where the folder should be
    k = FakeAutotuner(configs(), FakeJIT())
    launch(k)
    launch(k)
    assert k.tunings == 1 and len(k.fn.launches) == 2
    assert "cannot store tuned configs" in capsys.readouterr().err


_KERNELS_AS_ON_A_GPU = r"""
import importlib, json, pkgutil, sys
import triton
import megatron_moe.kernels as pkg
from megatron_moe.kernels import tuning
out = {}
for info in pkgutil.iter_modules(pkg.__path__):
    module = importlib.import_module(f"{pkg.__name__}.{info.name}")
    for obj in vars(module).values():
        if isinstance(obj, triton.runtime.autotuner.Autotuner):
            out[obj.fn.__name__] = [tuning.entry_key(obj, ()).split("|")[1],
                                    [tuning._config_dict(c) for c in obj.configs]]
json.dump(out, sys.stdout)
"""

SHIPPED = sorted(tuning.SHIPPED_DIR.glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_entry_serves_the_current_kernels(path):
    """A shipped table is keyed by a hash of each kernel's source, candidates and switches: an
    edited kernel silently drops its entries and a fresh machine tunes again. This fails first.
    The kernels are read in a process without the interpreter (which narrows the candidates) and
    with the default switches, as a GPU run that wrote the table saw them."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_MOE_")}
    env["TRITON_INTERPRET"] = "0"
    kernels = json.loads(subprocess.run([sys.executable, "-c", _KERNELS_AS_ON_A_GPU], env=env, check=True,
                                        capture_output=True, text=True).stdout)
    entries = json.loads(path.read_text())["entries"]
    assert entries, f"{path.name} has no entries"
    fix = "rerun `python3 benchmarks/first_step.py` on that GPU and ship its table"
    for key, entry in entries.items():
        name, digest, _ = key.split("|", 2)
        assert name in kernels, f"{path.name}: no autotuned kernel named {name}; {fix}"
        assert digest == kernels[name][0], f"{path.name}: {name} changed since its entries were tuned; {fix}"
        assert entry["config"] in kernels[name][1], f"{path.name}: {name}'s stored config is no candidate; {fix}"


# ----------------------------------------------------------------------------- parallel compiles


@pytest.mark.slow
def test_a_new_tuning_compiles_its_candidates_in_forked_processes(tmp_path):
    """tuning.precompile on a real launch of the row-grouped GEMM, compiled for Hopper without a
    GPU (tests/kernels/_precompile_sm90.py): two forked processes compile every candidate the
    autotuner would time, the parent then finds each in Triton's file cache (no compile reaches
    ptxas in it); one worker is no parallelism (nothing done); a worker whose compile fails
    leaves only its share undone, silently (the autotuner compiles it)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_precompile_sm90.py")),
                           str(tmp_path / "triton-cache"), "check"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    n = out["candidates"]
    assert n >= 4 and out["one_worker"] == 0 and out["compiled_by_workers"] == n
    assert out["cubins_after_loading_all"] == out["cubins_in_parent"]  # all n loaded from the cache
    assert out["compiled_with_a_failing_worker"] == n - (n + 1) // 2  # the failing share is configs[0::2]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_compile_workers_switch(monkeypatch):
    from megatron_moe.kernels import switches

    monkeypatch.setenv("MEGATRON_MOE_COMPILE_WORKERS", "3")
    assert switches.compile_workers() == 3
    monkeypatch.setenv("MEGATRON_MOE_COMPILE_WORKERS", "0")
    assert switches.compile_workers() == 0
    monkeypatch.setenv("MEGATRON_MOE_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match=r"MEGATRON_MOE_COMPILE_WORKERS='many': expected a whole number"):
        switches.compile_workers()
    monkeypatch.delenv("MEGATRON_MOE_COMPILE_WORKERS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000000")  # more ranks than CPUs: still one
    assert switches.compile_workers() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert 1 <= switches.compile_workers() <= 8


_GPU_SCRIPT = r"""
import json, torch
from megatron_moe.kernels import grouped, tuning
done = []
real = tuning.precompile
tuning.precompile = lambda *a, **k: done.append(real(*a, **k)) or done[-1]
torch.manual_seed(0)
a = torch.randn(700, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(3, 256, 384, device="cuda", dtype=torch.bfloat16) / 16
offsets = torch.tensor([0, 300, 300, 700], device="cuda", dtype=torch.int32)
out = grouped.grouped_gemm(a, w, offsets)
ref = torch.cat([a[s:e].double() @ w[i].double() for i, (s, e) in enumerate(zip(offsets[:-1].tolist(),
                                                                               offsets[1:].tolist()))])
print(json.dumps({"precompiled": done, "candidates": len(grouped._grouped_gemm_kernel.configs),
                  "rel_err": ((out.double() - ref).abs().max() / ref.abs().max()).item()}))
"""


@pytest.mark.gpu
def test_a_new_tuning_on_the_gpu_compiles_in_forked_processes_and_computes_the_reference(tmp_path):
    """With a CUDA context in the parent: a fresh tuning (empty Triton cache, nothing stored) of
    the row-grouped GEMM, its candidates compiled by 4 forked processes, then timed and launched
    by the autotuner: the workers compiled candidates, and the product equals a float64 loop's.
    The Gluon GEMMs are switched off: on sm_90 they take this bf16 call, and they are not tuned."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MEGATRON_MOE_AUTOTUNE="1", MEGATRON_MOE_TUNING_CACHE="0", MEGATRON_MOE_COMPILE_WORKERS="4",
               MEGATRON_MOE_GLUON_GEMM="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    proc = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["precompiled"] and out["precompiled"][0] >= 2, out
    assert out["rel_err"] < 2e-2, out  # a bf16 output of an fp32 accumulation (a wrong tile: ~1)
    assert "Traceback" not in proc.stderr and "one by one" not in proc.stderr, proc.stderr[-3000:]
