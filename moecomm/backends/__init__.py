"""Transports under a Communicator: mpi (mpi4py), nccl (nccl4py), torch (torch.distributed), self (one process)."""
