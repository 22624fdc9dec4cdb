"""ftexpert: disaggregated Mixture-of-Experts serving.

One import root for the service's components, each a subpackage: `coordinator`, `gpu_worker` and
`cpu_expert_pool` (the processes), `kernels` and `proto` (the libraries they share), `workload` (the
trained MoE and its routing traces). docs/ARCHITECTURE.md draws how they fit.
"""
