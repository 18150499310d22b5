"""Internal: the checkpoint file format (``file``) and resharding (``reshard``) behind
:mod:`moecomm.moe.checkpoint`."""
