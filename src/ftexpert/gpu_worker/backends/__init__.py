"""The expert backends behind the one `ExpertBackend` protocol (expert_backend.py): `resident` (resident.py),
`offload` (offload/), `cpu` and `hybrid` (hybrid/). They import the checkpoint layer, never the models or the
engine; a factory above them (assembly/backends.py) picks one."""
