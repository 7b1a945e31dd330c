"""The dtypes FSDP2's collectives carry (gathered parameters, reduced gradients), recorded by wrapping the
`torch.distributed` collectives FSDP2 calls (tests/scripts/mp_master_weights.py, tests/scripts/mp_step.py)."""

import torch
import torch.distributed as dist


class CollectiveDtypes:
    """Records the dtype of every all-gather / reduce-scatter issued through `torch.distributed` while active."""

    def __init__(self):
        self.seen, self.saved = set(), {}

    def __enter__(self):
        for name in [n for n in dir(dist) if n.startswith(("all_gather", "reduce_scatter"))]:
            original = getattr(dist, name)
            if not callable(original) or name.endswith("object"):
                continue
            self.saved[name] = original

            def wrapped(*args, _kind=name[:10] if name.startswith("all") else name[:14], _original=original,
                        **kwargs):
                tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]  # (output, input): input's
                if tensors:
                    self.seen.add((_kind, str(tensors[-1].dtype)))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)
