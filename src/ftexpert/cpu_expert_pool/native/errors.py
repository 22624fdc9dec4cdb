"""The compiled kernels' return codes (expert_ffn.c, quant_ffn.c) and what each means, for the messages of
build.py's `NativeLib` and quant_desc.py's `QuantBindings` (both import this module; build.py imports quant_desc)."""

ERRORS = {-1: "a token index is outside [0, T)", -2: "an expert id is outside [0, E)",
          -3: "out of memory for scratch buffers", -4: "that ISA is not supported by this CPU",
          -5: "bad sizes (H, I, T, n, E and num_threads must be positive) or an invalid split (split_limit "
              "must be 0, or in (0, I) and a multiple of 32 with split_expert in [0, E))",
          -6: "the quantized format descriptor does not match the kernel's formats (fp8, int4 g32/64/128, mxfp4, "
              "nvfp4) or its regions do not fit one expert's bytes; rebuild it with quant_format_desc",
          -7: "the activation descriptor is not one the kernel knows (swiglu-clamp with alpha, limit > 0 and its "
              "biases; silu is no descriptor) or its biases do not fit one expert's row; rebuild it with "
              "act_desc.expert_act_desc"}
