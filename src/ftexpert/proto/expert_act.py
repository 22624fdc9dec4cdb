"""What an expert computes besides its three matrices: the activation and the biases (a cross-process contract).

``ExpertAct`` labels (``label`` / ``parse``):

    silu                      h = silu(gate) * up                           (Qwen3-MoE, Mixtral, OLMoE)
    swiglu-clamp:A:L          gpt-oss: g = min(gate, L), u = clamp(up, -L, L),
                              h = (u + 1) * g * sigmoid(A * g), with gate/up/down biases

with ``gate = W_gate x + b_gate`` and ``up = W_up x + b_up`` (biases only where ``bias``), and the expert's output
``W_down h + b_down``. A biased expert carries its biases at the end of its row, after the weights (an expert still
moves as one copy): at ``bias_offset`` bytes (a multiple of ``BIAS_ALIGN``), ``2I + H`` values of the compute dtype:
gate's I biases, up's I, then down's H.
"""
from __future__ import annotations

from dataclasses import dataclass

BIAS_ALIGN = 16
ACT_NAMES = ("silu", "swiglu-clamp")


@dataclass(frozen=True)
class ExpertAct:
    name: str = "silu"
    alpha: float = 0.0          # swiglu-clamp: the sigmoid's gain (gpt-oss: 1.702)
    limit: float = 0.0          # swiglu-clamp: the clamp (gpt-oss: 7.0)

    def __post_init__(self) -> None:
        if self.name not in ACT_NAMES:
            raise ValueError(f"expert activation {self.name!r} is not supported; use one of {', '.join(ACT_NAMES)}")
        if self.name == "swiglu-clamp" and not (self.alpha > 0 and self.limit > 0):
            raise ValueError(f"swiglu-clamp needs alpha > 0 and limit > 0 (got {self.alpha}, {self.limit})")
        if self.name == "silu" and (self.alpha or self.limit):
            raise ValueError("silu takes no alpha / limit")

    @property
    def bias(self) -> bool:
        """Whether the expert rows carry gate/up/down biases (gpt-oss's experts do)."""
        return self.name == "swiglu-clamp"

    @property
    def label(self) -> str:
        return "silu" if self.name == "silu" else f"swiglu-clamp:{self.alpha!r}:{self.limit!r}"

    @classmethod
    def parse(cls, text: str) -> "ExpertAct":
        parts = str(text).split(":")
        if parts[0] == "silu" and len(parts) == 1:
            return cls()
        if parts[0] == "swiglu-clamp" and len(parts) == 3:
            return cls("swiglu-clamp", float(parts[1]), float(parts[2]))
        raise ValueError(f"expert activation {text!r} is not understood (silu, swiglu-clamp:ALPHA:LIMIT)")

    def bias_numel(self, hidden: int, intermediate: int) -> int:
        return 2 * intermediate + hidden if self.bias else 0


SILU = ExpertAct()


def gpt_oss_act(alpha: float = 1.702, limit: float = 7.0) -> ExpertAct:
    return ExpertAct("swiglu-clamp", float(alpha), float(limit))


def bias_offset(weight_bytes: int) -> int:
    """Byte offset of a row's biases after ``weight_bytes`` of weights."""
    return -(-weight_bytes // BIAS_ALIGN) * BIAS_ALIGN
