"""Start-up under MPI: the world communicator, role assignment, devices, and failure handling."""
