"""`ModelFacts`: what the coordinator knows of the model it serves, and the short link over which it learns them.

In process mode (`ft serve`, `--workers process` or `--attach`) the coordinator imports neither torch nor the
model-loading code. A short-lived child, `ft worker store` (gpu_worker/store_main.py), opens the model source
the engine spec names and answers with its facts: the vocabulary, the tokenizer's directory and the EOS ids (for
the coordinator's TextCodec), the shape, dtype and format of the experts (the store's size, the CPU channels, the
fetch policy's bandwidth profile). For the offload, cpu and hybrid strategies the coordinator then creates the
expert store from those facts (it is the store's creator and owner: it unlinks it at stop, and a killed
coordinator leaves a store the next start reclaims), places its pages, and the child fills it and exits.

The link: a socket pair the child inherits (`--link-fd`), length-prefixed frames (multiprocessing.connection's
send_bytes / recv_bytes), each a type byte and a msgpack map (proto/typed_messages.py; no pickle):

    coordinator -> child   OpenModel(spec, fill_store)
    child -> coordinator   ModelFacts                       the source is open; no expert read yet
    coordinator -> child   FillStore(store_name)            fill_store only: the store is created, empty
    child -> coordinator   StoreFilled(seconds)             every expert written, the store marked ready
    child -> coordinator   Failed(error)                    instead of either answer; the child exits 1

Then the child exits 0. Torch-free: the coordinator imports this module.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.expert_store import StoreShape
from ftexpert.proto.typed_messages import MessageCodec

MAX_FRAME_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    description: str               # for logs: where the weights come from ("checkpoint /m", "preset ...")
    vocab_size: int                # the model's (READY's vocabulary must match)
    hidden_size: int               # H
    top_k: int                     # experts a token is routed to
    num_layers: int                # layers with routed experts (the store's)
    num_experts: int               # routed experts a layer
    expert_intermediate_size: int  # I
    dtype: str                     # the experts' compute dtype name ("bfloat16")
    expert_format: str             # the format the experts are served in (an ExpertFormat label)
    expert_act: str                # their activation (an ExpertAct label)
    config_hash: str               # the store's config hash (shape, dtype, format): the CPU workers check it
    eos_token_ids: tuple[int, ...]  # config.json's, generation_config.json's and the tokenizer's
    tokenizer_dir: str = ""        # the directory of the tokenizer.json (and its configs); "" when there is none

    @property
    def store_shape(self) -> StoreShape:
        """The expert store that holds these experts."""
        return StoreShape(self.num_layers, self.num_experts, self.hidden_size, self.expert_intermediate_size,
                          self.dtype, self.expert_format, self.expert_act)


@dataclasses.dataclass(frozen=True)
class OpenModel:
    spec: EngineSpec               # the model (model, preset, seed, dtype, expert format) to open
    fill_store: bool               # wait for FillStore after the facts (offload, cpu, hybrid)


@dataclasses.dataclass(frozen=True)
class FillStore:
    store_name: str                # created by the coordinator from the facts, empty, its pages placed


@dataclasses.dataclass(frozen=True)
class StoreFilled:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Failed:
    error: str                     # what went wrong, with what to do (the exception's message)


CODEC = MessageCodec("model-facts link", {1: OpenModel, 2: ModelFacts, 3: FillStore, 4: StoreFilled, 5: Failed})


def encode(message: Any) -> bytes:
    """One frame: the type byte, then the msgpack map."""
    kind, payload = CODEC.encode(message)
    return kind + payload


def decode(frame: bytes) -> Any:
    """A frame of `encode` back to its message (MessageError when it is not one)."""
    return CODEC.decode([frame[:1], frame[1:]])
