"""HDF5 outputs: checkpoints (`checkpoint`) and traces (`trace`); formats in docs/formats.md."""
