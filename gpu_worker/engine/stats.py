"""`EngineStats`: token counts and wall time spent in prefill and decode forwards."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    num_steps: int = 0
    num_decode_steps: int = 0          # steps that ran a decode forward
    num_prefill_chunks: int = 0
    prefill_tokens: int = 0            # prompt tokens put through the model
    decode_tokens: int = 0             # tokens fed by decode forwards (one per running request)
    generated_tokens: int = 0          # tokens sampled (prefill's last chunk samples one too)
    prefill_time_s: float = 0.0        # forward + sampling, device-synchronised
    decode_time_s: float = 0.0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_time_s if self.prefill_time_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out = asdict(self)
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        out["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return out
