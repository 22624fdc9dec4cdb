"""The compiled kernels' view of what an expert computes besides its matrices (expert_act.h's ``ft_expert_act``).

``expert_act_desc(shape)`` describes a store's experts for ft_moe_layer / ft_moe_layer_q: the activation
(proto/expert_act.py: silu, or gpt-oss's swiglu-clamp with its alpha and limit) and where the biases sit in an
expert's row (``StoreShape.bias_byte_offset``, in the compute dtype). Plain silu experts get None (the C side's
NULL: the silu path without biases).
"""
from __future__ import annotations

import ctypes

import torch

from ftexpert.proto.expert_store import StoreShape

ACT_IDS = {"silu": 0, "swiglu-clamp": 1}                                         # expert_act.h FT_ACT_*
BIAS_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}            # expert_act.h FT_BIAS_*


class ExpertActDesc(ctypes.Structure):
    """Mirror of expert_act.h's ft_expert_act."""
    _fields_ = [("kind", ctypes.c_int64), ("bias_offset", ctypes.c_int64), ("bias_dtype", ctypes.c_int64),
                ("alpha", ctypes.c_double), ("limit", ctypes.c_double)]


def expert_act_desc(shape: StoreShape) -> ExpertActDesc | None:
    """The descriptor of ``shape``'s experts (keep it alive while C holds its address); None for plain silu."""
    act = shape.expert_act
    if not act.bias:                        # silu: the kernels' NULL path
        return None
    return ExpertActDesc(ACT_IDS[act.name], shape.bias_byte_offset, BIAS_DTYPES[shape.torch_dtype], act.alpha,
                         act.limit)


def act_address(desc: ExpertActDesc | None) -> int | None:
    """The pointer the C functions take (None: NULL)."""
    return None if desc is None else ctypes.addressof(desc)
