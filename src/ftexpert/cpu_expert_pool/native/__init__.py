"""The compiled CPU expert kernel (expert_ffn.c): built with the system C compiler at first use, loaded with ctypes."""
