"""What the launcher and the ranks share (torch-free): the MPI world, roles, the run directory, failure reports, process inspection."""
