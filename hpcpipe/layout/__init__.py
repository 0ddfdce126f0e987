"""Choosing a layout (pp x dp x ep, order, schedule, microbatches) from the model and the
machine: a machine model ([machine]), per-layout costs, and a search that ranks every layout
that fits by its predicted step."""
