"""Discrete-ordinates transport on a 3-D Cartesian mesh with a KBA pipelined wavefront sweep.

Modules, in the order data flows: `config` ([sweep] deck section), `quadrature` (angular sets),
`mesh` (problem generation), `plan` (pure KBA decomposition, task order, simulator), `kernel`
(vectorised hyperplane sweep of one block), `parallel` (MPI executor of a plan), `solver`
(source iteration and particle balance), `output` (flux.h5, flux.xmf, PNG), `workload` (the
`hpcpipe run` entry point). Nothing is imported here, so the pure modules stay MPI-free.
"""
