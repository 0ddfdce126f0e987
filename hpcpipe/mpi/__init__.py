"""Everything that imports mpi4py lives here: communicators from a RankMap (`comms`) and failure
handling (`guard`, which imports mpi4py only when it must, so the CLI can use it before MPI starts).
"""
