"""The GPU worker's decode engine: KV cache, attention, scheduler, sampling, the step loop."""
from ftexpert.gpu_worker.engine.decode_step import DecodeInputs
from ftexpert.gpu_worker.engine.engine import Engine, EngineConfig
from ftexpert.gpu_worker.engine.request import StepOutput
from ftexpert.gpu_worker.engine.sampling import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from ftexpert.gpu_worker.engine.stats import EngineStats

__all__ = ["DecodeInputs", "Engine", "EngineConfig", "StepOutput", "SamplingParams", "EngineStats",
           "FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP"]
