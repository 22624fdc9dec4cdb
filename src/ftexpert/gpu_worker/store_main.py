"""The `ft worker store` process: `run_store_child` (the child end of proto/model_facts.py's link).

Receive the engine spec (OpenModel), open its model source on the CPU (config, tokenizer, the experts' source: no
expert read yet), answer with the model's facts; when asked (FillStore), attach the store the coordinator created
from those facts, write every expert into it, mark it ready and say so (StoreFilled). An error is answered with
Failed(its message) and exit code 1. The store stays the coordinator's: this process never unlinks it.
"""
from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

from ftexpert.gpu_worker.assembly.loader import model_facts, open_model_source
from ftexpert.gpu_worker.backends.offload.host_store import fill_expert_store
from ftexpert.proto import model_facts as mf
from ftexpert.proto.expert_store import ExpertStore

log = logging.getLogger("ft.gpu_worker.store")

EXIT_FAILED = 1


def _receive(conn: Connection, expected: type):
    try:
        message = mf.decode(conn.recv_bytes(mf.MAX_FRAME_BYTES))
    except EOFError:
        raise RuntimeError("the coordinator closed the model-facts link (it stopped or gave up)") from None
    if not isinstance(message, expected):
        raise RuntimeError(f"expected {expected.__name__} from the coordinator, got {type(message).__name__}")
    return message


def open_and_fill(conn: Connection) -> None:
    request = _receive(conn, mf.OpenModel)
    spec = request.spec
    source = open_model_source(spec.model, spec.preset, device="cpu", dtype=spec.dtype, seed=spec.seed_weights,
                               expert_format=spec.expert_format)
    conn.send_bytes(mf.encode(model_facts(source)))
    if not request.fill_store:
        return
    name = _receive(conn, mf.FillStore).store_name
    t0 = time.perf_counter()
    store = ExpertStore.attach(name, readonly=False)
    try:
        fill_expert_store(store, source.experts)
    finally:
        store.close()
    seconds = time.perf_counter() - t0
    log.info("expert store %r filled from %s in %.1f s", name, source.description, seconds)
    conn.send_bytes(mf.encode(mf.StoreFilled(seconds)))


def run_store_child(link_fd: int) -> int:
    conn = Connection(link_fd)
    try:
        open_and_fill(conn)
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the coordinator, named
        user_error = isinstance(exc, (ValueError, FileNotFoundError))     # its message says what to do
        log.log(logging.DEBUG if user_error else logging.ERROR, "opening the model or filling the expert store "
                "failed", exc_info=True)
        try:
            conn.send_bytes(mf.encode(mf.Failed(str(exc) if user_error else f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass                                   # the coordinator is gone: nobody to tell
        return EXIT_FAILED
    finally:
        conn.close()
    return 0
