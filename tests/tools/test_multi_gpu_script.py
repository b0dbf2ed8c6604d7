"""benchmarks/multi_gpu.sh without GPUs: its override splitting (benchmarks/device_env.sh's
``split_overrides``, shared with train_ab.sh) and its closing table (the Python at its end) on
hand-made metrics files."""
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _function(path: Path, name: str) -> str:
    text = path.read_text()
    m = re.search(rf"^{name}\(\) {{.*?^}}$", text, re.S | re.M)
    assert m, f"{name} not found in {path}"
    return m.group(0)


def test_split_overrides_takes_the_micro_batch_environment_variables_and_the_rest():
    fn = _function(REPO / "benchmarks" / "device_env.sh", "split_overrides")
    script = fn + '''
split_overrides "$1" 8
echo "mb=$mb"; printf 'env %s\\n' "${env_extra[@]}"; printf 'cfg %s\\n' "${extra[@]}"
'''
    own = "mb=32,model.moe.a2a_splits=symmetric,MEGATRON_MOE_PEER_READS=per_peer,train.cuda_graphs=micro_batch,A1_B=2"
    out = subprocess.run(["bash", "-c", script, "x", own], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["mb=32", "env MEGATRON_MOE_PEER_READS=per_peer", "env A1_B=2",
                                "cfg model.moe.a2a_splits=symmetric", "cfg train.cuda_graphs=micro_batch"]
    out = subprocess.run(["bash", "-c", script, "x", ""], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "mb=8"


def test_the_table_scales_each_run_against_its_fewest_gpus_with_the_same_variant_words(tmp_path):
    text = (REPO / "benchmarks" / "multi_gpu.sh").read_text()
    summary = re.search(r'^python3 - "\$OUT" "\$MEASURE_FROM" <<\'EOF\'\n(.*?)^EOF$', text, re.S | re.M).group(1)

    def write(name, tokens_per_s, **extra):
        rows = [dict(step=s, tokens_per_s=tokens_per_s, step_time_s=0.2, **extra) for s in range(1, 11)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    write("dmoe-small-ep1-graphs", 1000.0)
    write("dmoe-small-ep1-sigmoid-graphs", 800.0)
    write("dmoe-small-ep4-symmetric-graphs", 3600.0, a2a_gb=1.25, **{"expert_load/ep_rank_imbalance": 1.3})
    write("dmoe-small-ep4-sigmoid-symmetric-graphs", 3040.0, a2a_gb=1.5)
    write("dmoe-small-ep4-symmetric-perpeer-graphs", 3400.0, a2a_gb=1.25)
    proc = subprocess.run([sys.executable, "-", str(tmp_path), "5"], input=summary, capture_output=True, text=True,
                          check=True)
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines()[1:]}
    assert proc.stdout.splitlines()[0].split()[:12] == ["run", "GPUs", "tok/s/GPU", "scaling", "s/step", "a2a", "ms",
                                                        "a2a", "%", "a2a", "GB", "TFLOP/s"]
    assert "0.90 of 1 GPU" in lines["dmoe-small-ep4-symmetric-graphs"]  # 3600 / 4 against 1000
    assert "0.95 of 1 GPU" in lines["dmoe-small-ep4-sigmoid-symmetric-graphs"]  # against the sigmoid one
    assert "0.85 of 1 GPU" in lines["dmoe-small-ep4-symmetric-perpeer-graphs"]
    assert lines["dmoe-small-ep4-symmetric-graphs"].split()[10] == "1.25"  # a2a GB (the scaling takes 4 words)
    assert lines["dmoe-small-ep4-symmetric-graphs"].split()[-1] == "1.30"  # rank imbalance
    scaling = json.loads((tmp_path / "scaling.json").read_text())
    assert scaling["dmoe-small-ep4-sigmoid-symmetric-graphs"]["a2a_gb"] == 1.5
