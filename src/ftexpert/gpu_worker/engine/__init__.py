"""The GPU worker's decode engine: KV cache, attention, scheduler, sampling, the step loop."""
from .engine import DecodeInputs, Engine, EngineConfig
from .request import StepOutput
from .sampling import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from .stats import EngineStats

__all__ = ["DecodeInputs", "Engine", "EngineConfig", "StepOutput", "SamplingParams", "EngineStats",
           "FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP"]
