"""The one way the save, export and merge paths hand tensors to a collective: `on_group_device` runs it on the
device the tensors' process group serves, and moves the result back to where the tensors live.

The device is the mesh's (a DTensor's `device_mesh.device_type`, the accelerator's current index): the device the
strategy computes on, whose backend (NCCL on cuda) the mesh's groups use. FSDP2's `cpu_offload` keeps a module's
shards on the CPU while its mesh serves the accelerator, and NCCL takes no CPU tensor ("no backend type associated
with device type cpu"): each collective's tensors are copied there first (one tensor at a time: the bound on what
a rank holds is the caller's), and its result copied back. On a CPU run (gloo) the device is the CPU: nothing moves.
"""

from __future__ import annotations

import torch


def group_device(mesh) -> torch.device:
    """The device the collectives over `mesh` take (a `DeviceMesh`: its device type, at the current index)."""
    kind = mesh.device_type
    if kind in ("cpu", "meta"):
        return torch.device(kind)
    return torch.device(kind, torch.get_device_module(kind).current_device())


def moved(value, device: torch.device):
    """`value` (a tensor, a DTensor — its local shard moved, same mesh, placements and global shape —, a list or
    tuple of them, or None) on `device`; as is where it is there already."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, device) for v in value)
    if hasattr(value, "to_local"):
        from torch.distributed.tensor import DTensor

        local = value.to_local()
        if local.device == device:
            return value
        return DTensor.from_local(local.to(device), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value if value.device == device else value.to(device)


def on_group_device(collective, tensor, mesh=None):
    """`collective(tensor on its group's device)`, its result (tensors, DTensors, a list of them, or None) moved
    back to the device `tensor` lives on. `mesh`: the mesh of a plain `tensor` (a DTensor's own by default)."""
    mesh = mesh if mesh is not None else tensor.device_mesh
    home = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).device
    return moved(collective(moved(tensor, group_device(mesh))), home)
