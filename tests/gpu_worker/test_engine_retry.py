"""A decode step the expert backend reports as failed (the device hand-off's `step_end() -> False`) is run
again before anything is sampled; a step that keeps failing is an error, never a sampled token. With linear-attention
layers (Qwen3-Next) the re-run starts from the states the failed run advanced, restored from the copy the engine
keeps only where the backend says a step may fail (`step_may_fail`)."""
from __future__ import annotations

import pytest

from ftexpert.gpu_worker.engine import Engine, SamplingParams
from tests.built_engines import build, engine_of

PROMPT = [5, 17, 42, 99, 3, 250, 7]


class FailingSteps:
    """The model's expert backend, with step hooks whose step_end fails the calls numbered in `fail_on`
    (1-based, counting every step_end call, retries included)."""

    def __init__(self, backend, fail_on):
        self.backend, self.fail_on = backend, set(fail_on)
        self.begins = self.ends = 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def step_begin(self) -> None:
        self.begins += 1

    def step_end(self) -> bool:
        self.ends += 1
        return self.ends not in self.fail_on

    def step_may_fail(self) -> bool:
        return True


def run(built, n: int = 6, experts=None) -> tuple[list[int], Engine]:
    engine = engine_of(built, experts=experts)
    prompt = [t % built.cfg.vocab_size for t in PROMPT]
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0], engine


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield build(max_running_requests=1, max_context_tokens=64)


def test_a_failed_decode_step_runs_again_and_gives_the_same_tokens(loaded):
    want, _ = run(loaded)
    hooks = FailingSteps(loaded.experts, fail_on=(1, 4))                    # steps 1 and 3, once each
    got, engine = run(loaded, experts=hooks)
    assert got == want
    assert engine.stats.decode_step_retries == 2
    assert hooks.begins == hooks.ends == engine.stats.num_decode_steps + 2


def test_a_step_that_keeps_failing_is_an_error_not_a_sampled_token(loaded):
    with pytest.raises(RuntimeError, match="failed the decode step 2 times"):
        run(loaded, experts=FailingSteps(loaded.experts, fail_on=range(1, 100)))


class Undeclared(FailingSteps):
    """Fails steps while saying it cannot."""

    def step_may_fail(self) -> bool:
        return False


@pytest.fixture(scope="module")
def next_tiny(tmp_path_factory):
    from tests.gpu_worker.qwen3_next_util import hf_qwen3_next, save
    path = save(hf_qwen3_next(seed=7), tmp_path_factory.mktemp("qwen3next"))
    return build(path, dtype="float32", max_running_requests=1, max_context_tokens=64)


def test_a_retried_step_restores_the_linear_layers_states(next_tiny, monkeypatch):
    """Qwen3-Next: steps 1 and 3 fail after their forwards advanced the state rows; the re-runs start from the kept
    copy and the tokens equal a run without failures. A backend whose steps cannot fail keeps no copy."""
    from ftexpert.gpu_worker.engine.state_cache import StateCache
    snapshots = []
    plain = StateCache.snapshot
    monkeypatch.setattr(StateCache, "snapshot", lambda self, slots: snapshots.append(1) or plain(self, slots))
    want, engine = run(next_tiny, n=8)
    assert engine.states is not None and snapshots == [], "a step that cannot fail copied the state rows"
    got, engine = run(next_tiny, n=8, experts=FailingSteps(next_tiny.experts, fail_on=(1, 4)))
    assert got == want
    assert engine.stats.decode_step_retries == 2 and len(snapshots) == engine.stats.num_decode_steps


def test_a_failed_step_the_backend_did_not_declare_is_an_error(next_tiny):
    with pytest.raises(RuntimeError, match="step_may_fail"):
        run(next_tiny, n=4, experts=Undeclared(next_tiny.experts, fail_on=(1,)))
