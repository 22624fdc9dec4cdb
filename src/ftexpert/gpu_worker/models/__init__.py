"""The architectures' forwards, one module each: `MoeModel` (model.py: Qwen3-MoE, Mixtral, OLMoE), Qwen3-Next
(qwen3_next.py), gpt-oss (gpt_oss.py), and the stateless layers they share. They take an `ExpertBackend`
object; they never pick or import a backend implementation."""
