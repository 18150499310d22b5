"""Per-cluster topology tuning for moecomm's all-to-all (``python -m topology ...``).

Commands (see ``python -m topology -h``):

``probe``     latency and bandwidth of the intra-node link, the inter-node (rail) link and
              layout copies, measured through the communicator (collective: run under
              mpirun/mpiexec or torchrun; ``--local-size`` simulates nodes on one machine).
``tune``      times the flat and the 2DH exchange per message size and writes the cluster's
              profile (``moecomm.profile``), keyed by its fingerprint, to the default cache
              directory that ``moecomm.init`` reads (or ``--out``).
``show``      prints a profile's table and plots time against size per algorithm to a PNG
              (:mod:`topology.plot`, with matplotlib: the optional ``plot`` extra).
``simulate``  an alpha-beta model (:mod:`topology.model`) of flat vs 2DH, from link figures on
              the command line or in a profile: per-size times, the crossover size, the
              predicted ratio from 64 to 4096 GPUs, and the model's error against the
              profile's own measurements.
"""

from .cli import main

__all__ = ["main"]
