"""A decode step the expert backend reports as failed (the device hand-off's `step_end() -> False`) is run
again before anything is sampled; a step that keeps failing is an error, never a sampled token."""
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


def run(built, n: int = 6, experts=None) -> tuple[list[int], Engine]:
    engine = engine_of(built, experts=experts)
    return engine.generate([PROMPT], SamplingParams(max_new_tokens=n, ignore_eos=True))[0], engine


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
