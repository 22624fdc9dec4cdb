"""Decode-step kernels of Qwen3-Next and gpt-oss: the (offset + w) RMSNorm fused with the residual add and
Qwen3-Next's shared expert gate and combine; the Gated DeltaNet decode step's conv update, splits and gates before
the gated delta rule, the rule itself on the state cache's rows in place (`gdn_decode_rule`; the maths of
kernels/gated_delta) and its RMSNormGated after it; gated attention's (1 + w) q/k norm + partial rotary embedding
(+ the KV cache write) and its sigmoid output gate; the shared expert's silu * up. The routers are
kernels/moe_decode's `route_topk` (re-exported here), whose ``round_weights`` gives both models' rule.

Each a Triton kernel with its plain torch reference (reference.py, which is also the code of the models' plain
forwards), dispatched by api.py; numerics follow that code's rounding points.
"""
from ftexpert.kernels.moe_decode import KvWrite, route_topk
from ftexpert.kernels.next_decode.api import (DeltaNetHeads, SharedExpert, add_rms_norm, gated_rms_norm, gdn_decode_pre,
                                              gdn_decode_rule, qk_norm_partial_rope, rms_norm, sigmoid_gate, silu_mul)

__all__ = ["rms_norm", "add_rms_norm", "SharedExpert", "silu_mul", "gdn_decode_pre", "gdn_decode_rule", "DeltaNetHeads",
           "gated_rms_norm", "qk_norm_partial_rope", "sigmoid_gate", "route_topk", "KvWrite"]
