"""An async save writes the state as it was when `save_state` returned, though training goes on: buffers that a
forward changes (ResNet's BatchNorm statistics) are copied before it returns, parameters and optimizer state in the
background before the next optimizer step (which waits for them), and the files hold exactly the saved state."""

import torch
from accelerate import Accelerator
from real_models import Batches, build
from torch.utils.data import DataLoader

from hf_omni import OmniPlugin
from hf_omni.checkpoint import async_save as async_save_module

MODULES = {"resnet": {"learning_rate": 1e-2}, "projector": {"learning_rate": 1e-2},
           "llm": {"learning_rate": 1e-2, "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"]}}}


def prepared(tmp_path, save_async, seed=0):
    plugin = OmniPlugin(modules=MODULES, defaults={"optim": "adamw_torch", "save_async": save_async},
                        output_dir=str(tmp_path / "run"))
    model, optimizer, scheduler = plugin.prepare(Accelerator(cpu=True), build(["resnet"], seed=seed),
                                                 num_training_steps=20)
    return plugin, model, optimizer, scheduler


def step(model, optimizer, scheduler, batch):
    model(**batch).loss.backward()
    optimizer.step(), scheduler.step(), optimizer.zero_grad()


def snapshot(model, optimizer):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {name: {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
               for name, opt in optimizer.optimizers.items()}
    return weights, moments


def test_async_save_holds_the_state_of_its_moment(tmp_path, monkeypatch):
    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=True)
    batches = list(DataLoader(Batches(24), batch_size=4))
    for batch in batches[:2]:
        step(model, optimizer, scheduler, batch)
    order = []
    release = __import__("threading").Event()
    copy = async_save_module.copy_to_cpu

    def logged_copy(tensor, *args):  # the background copies wait until the loop reached its optimizer step
        if __import__("threading").current_thread().name.startswith("hf_omni_save"):
            release.wait()
            order.append("late copy")
        return copy(tensor, *args)

    monkeypatch.setattr(async_save_module, "copy_to_cpu", logged_copy)
    fence = optimizer.before_step
    optimizer.before_step = lambda: (order.append("step"), release.set(), fence())
    saved = snapshot(model, optimizer)
    plugin.save_state(str(tmp_path / "ckpt"))
    order.append("save_state returned")
    for batch in batches[2:5]:  # forwards change the BatchNorm statistics; steps change parameters and moments
        step(model, optimizer, scheduler, batch)
    plugin.wait_for_save()
    assert order.index("save_state returned") < order.index("step") < order.index("late copy")
    first_step_done = len(order) - order[::-1].index("late copy")  # every late copy before the step went on
    assert "step" not in order[order.index("step") + 1:first_step_done]
    moved = snapshot(model, optimizer)
    assert not torch.equal(moved[0]["resnet.embedder.embedder.normalization.running_mean"],
                           saved[0]["resnet.embedder.embedder.normalization.running_mean"])

    other, other_model, other_optimizer, _ = prepared(tmp_path, save_async=False, seed=3)
    other.load_state(str(tmp_path / "ckpt"))
    weights, moments = snapshot(other_model, other_optimizer)
    for key, value in saved[0].items():
        assert torch.equal(weights[key], value), key
    for name, states in saved[1].items():
        for index, values in states.items():
            for key, value in values.items():
                assert torch.equal(moments[name][index][key], value), (name, index, key)


def test_after_a_failed_copy_no_write_runs():
    """Every rank learns that a copy failed (the agreement after the copies) and every rank skips every write: no
    rank enters a write's collectives alone."""
    import pytest

    saver = async_save_module.AsyncSave()
    saver.begin([])
    saver._copies.append(lambda: 1 / 0)
    ran = []
    saver.then(lambda: ran.append("write"), "writing x")
    futures = saver.start()
    saver.fence()
    with pytest.raises(ZeroDivisionError):
        futures[0].result()
    with pytest.raises(async_save_module.BackgroundWriteError, match="writing x: skipped, the copies of this save"):
        futures[1].result()
    assert ran == []
    saver.close()


def test_saving_before_any_step_leaves_the_optimizer_as_it_was(tmp_path):
    """torch initialises optimizer state for a save with a zero-lr step: the live optimizer must not keep it (its
    next step would count as the second)."""
    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=False)
    plugin.save_state(str(tmp_path / "ckpt"))
    assert all(len(opt.state) == 0 for opt in optimizer.optimizers.values())
    batch = next(iter(DataLoader(Batches(4), batch_size=4)))
    step(model, optimizer, scheduler, batch)
    steps = {float(s["step"]) for opt in optimizer.optimizers.values() for s in opt.state.values()}
    assert steps == {1.0}


def test_a_re_save_into_a_folder_drops_its_old_shards(tmp_path):
    """Shards left by an earlier save into the same folder (another world size, another file count) would be read
    back beside the new ones: a re-save starts from an empty state/."""
    import shutil

    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=False)
    batches = list(DataLoader(Batches(12), batch_size=4))
    step(model, optimizer, scheduler, batches[0])
    plugin.save_state(str(tmp_path / "old"))
    for batch in batches[1:]:
        step(model, optimizer, scheduler, batch)
    state = tmp_path / "ckpt" / "llm" / "state"
    state.mkdir(parents=True)
    for i, shard in enumerate(sorted((tmp_path / "old" / "llm" / "state").glob("*.safetensors"))):
        shutil.copy(shard, state / f"shard-00009-{i:05d}-of-00009.safetensors")  # sorts after the new ones
    plugin.save_state(str(tmp_path / "ckpt"))
    assert not list(state.glob("shard-00009-*"))
    saved = snapshot(model, optimizer)
    other, other_model, other_optimizer, _ = prepared(tmp_path, save_async=False, seed=3)
    other.load_state(str(tmp_path / "ckpt"))
    for name, states in saved[1].items():
        for index, values in states.items():
            for key, value in values.items():
                assert torch.equal(snapshot(other_model, other_optimizer)[1][name][index][key], value)


def test_async_copies_reuse_their_staging_buffers_and_hold_each_saves_values(tmp_path):
    """The parameters' host copies of an async save go into buffers kept from one save to the next (pinned when
    CUDA is there: the same path runs here without it), on the copy stream; each checkpoint's files still hold the
    values of its own moment, though the second save overwrote the buffers the first one wrote from."""
    from safetensors.torch import load_file

    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=True)
    batches = list(DataLoader(Batches(24), batch_size=4))
    saver, saved, buffers = plugin.checkpointer.async_save, [], []
    for number, batch in enumerate(batches[:2]):
        step(model, optimizer, scheduler, batch)
        saved.append(model.projector.state_dict()["layers.0.weight"].clone())
        plugin.save_state(str(tmp_path / f"ckpt{number}"))
        plugin.wait_for_save()
        buffers.append({name: tensor.data_ptr() for name, tensor in saver.staging.buffers.items()})
    assert buffers[0] and buffers[0] == buffers[1] and any(name.startswith("projector/") for name in buffers[0])
    assert all(t.is_pinned() == torch.cuda.is_available() for t in saver.staging.buffers.values())
    assert saver.stream.cuda == torch.cuda.is_available()
    assert not torch.equal(saved[0], saved[1])
    for number in (0, 1):
        written = load_file(str(tmp_path / f"ckpt{number}" / "projector" / "model.safetensors"))
        assert torch.equal(written["layers.0.weight"], saved[number])
    plugin.close()
    assert saver.staging.buffers == {}


def test_masters_and_moe_groups_are_staged_once_off_the_training_thread(tmp_path, monkeypatch):
    """A bf16 MoE module with fp32 masters, saved async: every tensor the writes read was copied in the save thread
    into a staging buffer (the experts split per expert for the HF files too: none copied on the training thread),
    each master weight once (`state/` keeps it in fp32, the HF files its bf16 rounding, cast from the same staged
    copy), and the files hold what a sync save of the same moment writes."""
    import threading

    from moe_runs import LLM, LanguageModel, Tokens
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = LanguageModel.from_modules({"llm": MixtralForCausalLM(MixtralConfig(**LLM)).to(torch.bfloat16)})
    plugin = OmniPlugin(modules={"llm": {"learning_rate": 1e-2, "master_dtype": "float32"}},
                        defaults={"optim": "adamw_torch", "save_async": True}, output_dir=str(tmp_path / "run"))
    model, optimizer, scheduler = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=4)
    batch = next(iter(DataLoader(Tokens(), batch_size=4)))
    step(model, optimizer, scheduler, batch)
    copies, copy = [], async_save_module.copy_to_cpu

    def logged_copy(tensor, into=None, *args):
        copies.append((threading.current_thread().name, into is not None))
        return copy(tensor, into, *args)

    monkeypatch.setattr(async_save_module, "copy_to_cpu", logged_copy)
    plugin.save_state(str(tmp_path / "async"))
    plugin.wait_for_save()
    assert copies and all(name.startswith("hf_omni_save") and into for name, into in copies)  # no buffers here
    buffers = plugin.checkpointer.async_save.staging.buffers
    masters = [name for name, p in model.llm.named_parameters()]
    assert masters and all(p.dtype == torch.float32 for p in model.llm.parameters())
    assert all(f"llm/state/tensors.{name}" in buffers for name in masters)
    staged_bytes = sum(b.numel() * b.element_size() for b in buffers.values())
    state_bytes = sum(b.numel() * b.element_size() for n, b in buffers.items() if n.startswith("llm/state/"))
    experts = sum(getattr(model.llm.model.layers[0].mlp.experts, n).numel() * 2 for n in ("gate_up_proj", "down_proj"))
    assert staged_bytes - state_bytes == experts  # beside state/: the experts alone, split and converted to bf16
    plugin.save_state(str(tmp_path / "sync"))  # the same moment (no step between), written by the same process
    plugin.wait_for_save()
    written, expected = (load_file(str(tmp_path / which / "llm" / "model.safetensors")) for which in ("async", "sync"))
    assert written.keys() == expected.keys() and any(".experts.0." in k for k in written)
    for key, value in expected.items():
        assert value.dtype == torch.bfloat16 and torch.equal(written[key], value), key
    plugin.close()


def test_staging_is_ordered_by_events_never_by_a_device_wide_synchronize():
    """The copies of an async save wait for an event recorded on the training stream and hand off to the writes by
    an event recorded after them on the copy stream: nothing in the checkpoint code waits for the whole device or a
    whole stream (DCP's DefaultStager ends its non-blocking staging in `torch.accelerator.synchronize()`). The CUDA
    run of these calls is the GPU check of docs/checkpoints.md; here the same code path runs without events."""
    import pathlib

    import hf_omni.checkpoint as package

    sources = {p.name: p.read_text() for p in pathlib.Path(package.__file__).parent.glob("*.py")}
    for name, text in sources.items():
        for waits in ("cuda.synchronize(", "accelerator.synchronize(", "stream.synchronize(", "DefaultStager"):
            assert waits not in text, (name, waits)
    assert "copied.synchronize()" in sources["staging.py"] and "wait_event" in sources["staging.py"]
    stream = async_save_module.CopyStream()
    stream.mark()
    with stream.copying():
        pass
    assert stream.cuda == torch.cuda.is_available() and (stream.after is None) != stream.cuda


def test_a_writer_process_writes_the_files_holding_no_socket_and_no_group(tmp_path, monkeypatch):
    """The background writes run in a process of their own (forked at the first async save), not in a thread of the
    training process: it writes every HF row and every `state/` shard from the shared staging buffers, holds no
    socket (the training process's gloo and store connections are closed in it: it joins no process group), and a
    write that fails there names the module's folder, raised at the save's wait."""
    import os
    import socket

    import pytest

    from hf_omni.files import in_place

    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=True)
    batches = list(DataLoader(Batches(8), batch_size=4))
    step(model, optimizer, scheduler, batches[0])
    held = socket.socketpair()  # as a process group's connections would be
    log, write = tmp_path / "writers.txt", in_place.Files.write

    def logged(self, name, offset, data):  # inherited by the forked writer
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {self.folder}\n")
        if "broken" in self.folder and "projector" in self.folder:
            raise OSError(28, "No space left on device", os.path.join(self.folder, name))
        return write(self, name, offset, data)

    monkeypatch.setattr(in_place.Files, "write", logged)
    plugin.save_state(str(tmp_path / "ckpt"))
    plugin.wait_for_save()
    writer = plugin.checkpointer.async_save.writer
    lines = [line.split() for line in log.read_text().splitlines()]  # (the LoRA base: written once, at once)
    assert {pid for pid, folder in lines if "/ckpt/" in folder} == {str(writer.pid)} != {str(os.getpid())}
    shards = list((tmp_path / "ckpt" / "llm" / "state").glob("shard-*.safetensors"))
    assert shards and all(f.stat().st_size > 0 for f in shards)
    links = [os.readlink(f"/proc/{writer.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{writer.pid}/fd")]
    assert links and not any(link.startswith("socket:") for link in links), links
    step(model, optimizer, scheduler, batches[1])
    plugin.save_state(str(tmp_path / "broken"))
    with pytest.raises(Exception, match=r"writing .*broken/projector: OSError: \[Errno 28\] No space left"):
        plugin.wait_for_save()
    held[0].close(), held[1].close()
    plugin.close()
    assert not os.path.exists(f"/proc/{writer.pid}") or open(f"/proc/{writer.pid}/stat").read().split()[2] == "Z"


def test_each_rank_plans_its_shards_alone_and_every_chunk_is_written_once():
    """`state/` shards are planned on each rank without a collective (the writer process joins no group): across the
    4 ranks of an HSDP mesh (2 replicas x 2 shards) every chunk of every tensor is written by exactly one rank — a
    replicated shard by one of its replicas, a plain (replicated) tensor by one rank, the load spread by size — and
    in a tensor-parallel module a norm on `(dp_shard,)` alone, the same on both tp ranks, by one of them."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hf_omni.checkpoint.shard_plan import shard_files
    from hf_omni.compat import dcp_sharding_info_key, init_fake_process_group

    def written(world, shape, placements, names, full_of=None):
        out = []
        for rank in range(world):
            init_fake_process_group(rank, world)
            try:
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
                sub = mesh[placements[0]] if isinstance(placements[0], str) else mesh
                kinds = placements[1:] if isinstance(placements[0], str) else placements
                state = {"optimizer": {"state": {f"w{i}": {"exp_avg": DTensor.from_local(
                    torch.zeros(2 + i, 3), sub, kinds, run_check=False)} for i in range(4)}},
                    "tensors": {f"b{i}": torch.zeros(5 * (i + 1)) for i in range(3)}}
                for _, head, _ in shard_files(state, rank, world, 2, mesh if full_of else None):
                    sharding = json.loads(json.loads(head[8:])["__metadata__"][dcp_sharding_info_key()])
                    out += [(rank, (key, tuple(value["saved_offsets"]))) for key, value in sharding.items()]
            finally:
                dist.destroy_process_group()
        return out

    hsdp = written(4, (2, 2), [Replicate(), Shard(0)], ("dp_replicate", "dp_shard"))
    chunks = [chunk for _, chunk in hsdp]
    assert len(chunks) == len(set(chunks)) == 4 * 2 + 3  # 4 tensors x 2 shards, 3 plain tensors: once each
    assert len({rank for rank, _ in hsdp}) == 4  # spread over every rank
    tp = written(2, (1, 2), ["dp_shard", Shard(0)], ("dp_shard", "tp"), full_of=True)
    chunks = [chunk for _, chunk in tp]
    assert len(chunks) == len(set(chunks)) == 4 + 3 and {rank for rank, _ in tp} == {0, 1}


def test_a_full_dev_shm_is_a_clear_error_at_the_buffers_allocation(monkeypatch):
    """The staging buffers are /dev/shm files, their pages reserved when allocated: a /dev/shm too small for them
    (a container's default 64 MB) is an OSError naming the buffer and `--shm-size`, not a SIGBUS at the copy."""
    import errno
    import os

    import pytest

    from hf_omni.checkpoint import staging

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    held = staging.Staging(shared=True)
    with pytest.raises(OSError, match=r"cannot hold the 4000 bytes staging 'llm/state/w' .*--shm-size.*No space"):
        held.buffer("llm/state/w", torch.zeros(1000))
    assert not [n for n in os.listdir(staging.SHM) if n.startswith(f"hf_omni_{os.getpid()}_")]
