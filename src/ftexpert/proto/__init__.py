"""Every cross-process contract in one place: config schema, environment knobs, messages, layouts."""
