"""Multi-node: two `accelerate launch` commands on this machine, as two "nodes" of 2 processes each
(`--num_machines 2 --machine_rank {0,1} --main_process_ip 127.0.0.1`), train the demo (`examples/train.py
cfg.yaml`) with the LLM in HSDP (replicated across the nodes, sharded within each); the export equals one
process's on the same global batch."""

import os
import subprocess
import sys

import torch
import yaml
from launching import TESTS, free_port, subprocess_env
from safetensors.torch import load_file

TRAIN = os.path.join(os.path.dirname(TESTS), "examples", "train.py")
MODULES = {"vision": {}, "projector": {"learning_rate": 3e-3}, "llm": {"max_grad_norm": 1.0, "parallel": "fsdp"}}
HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}
CONFIG = dict(max_steps=4, learning_rate=1e-3, lr_scheduler_type="cosine", weight_decay=0.0, logging_steps=1,
              disable_tqdm=True, save_strategy="no", report_to="none", use_cpu=True, seed=0, dataloader_drop_last=True)


def write_config(folder, name: str, **values) -> str:
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(dict(CONFIG, output_dir=os.path.join(folder, name), **values), f)
    return path


def launch_two_nodes(config: str, port: int, timeout: int = 600) -> list[str]:
    """Both launchers at once (each waits for the other at the rendezvous); their stdout, node 0 first."""
    env = subprocess_env(OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(
        ["accelerate", "launch", "--multi_gpu", "--num_machines", "2", "--machine_rank", str(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes", "4",
         "--mixed_precision", "no", "--dynamo_backend", "no", TRAIN, config],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=timeout)
            if node.returncode:
                sys.stderr.write(out[-4000:] + err[-10000:])
                raise AssertionError(f"node {len(outputs)} failed (exit {node.returncode})")
            outputs.append(out)
    finally:
        for node in nodes:
            node.kill()
    return outputs


def accuracy_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("held-out caption accuracy"))


def test_two_nodes_train_the_demo_with_hsdp_equal_to_one_process(tmp_path):
    multi = write_config(tmp_path, "multi", per_device_train_batch_size=16,
                         modules=dict(MODULES, llm=dict(MODULES["llm"], parallelism=HSDP)))
    single = write_config(tmp_path, "single", per_device_train_batch_size=64, modules=MODULES)
    node0, node1 = launch_two_nodes(multi, port=free_port())
    alone = subprocess.run([sys.executable, TRAIN, single], capture_output=True, text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr[-6000:]
    assert "held-out caption accuracy" not in node1  # printed by world rank 0 only, on node 0
    got, want = accuracy_line(node0), accuracy_line(alone.stdout)
    assert got.split(" after")[0] == want.split(" after")[0]
    for module in ("vision", "projector", "llm"):
        a = load_file(tmp_path / "multi" / module / "model.safetensors")
        b = load_file(tmp_path / "single" / module / "model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.allclose(a[key], b[key], atol=1e-5), f"{module}.{key}"
