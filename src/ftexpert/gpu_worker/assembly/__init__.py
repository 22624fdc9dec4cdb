"""Assembly: where a model and its expert backend are built from a checkpoint and the settings (the backend
factory, the loader, the device choice). Above the engine, the models, the backends and the checkpoint layer."""
