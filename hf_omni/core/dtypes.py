"""dtypes, named once: safetensors' name of each torch dtype (the files hf_omni writes and reads), and that table's
order as small integer codes (shapes and dtypes sent between ranks)."""

from __future__ import annotations

import torch

SAFETENSORS: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    **{getattr(torch, f"uint{n}"): f"U{n}" for n in (16, 32, 64) if hasattr(torch, f"uint{n}")}}
BY_SAFETENSORS_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS.items()}
CODES: tuple[torch.dtype, ...] = tuple(SAFETENSORS)  # a dtype's code is its index here
